// apps/train/gpt.h: the GPT-style decoder strata-train trains, and its synthetic data.
//
// Token and position embeddings, `layers` pre-norm transformer blocks (causal self-attention
// written with matmuls, so forward and backward are deterministic on CPU and GPU alike, and a 4x
// GELU MLP), a final LayerNorm and an output head. strata's layers are: 0 the embeddings, 1..layers
// the blocks, layers + 1 the final norm and head; forward() calls a hook before each of them so a
// residency policy can bring that layer's tensors in, and can have autograd call another once each
// layer's backward is done, so the policy can send that layer's gradients out and bring the next
// layer in while backward goes on.
//
// Example:
//   torch::manual_seed(7);
//   Gpt model(GptConfig{.vocab = 256, .d_model = 128, .heads = 4, .layers = 4});
//   torch::Tensor tokens = synthetic_batch(model->config(), /*seed=*/7, /*step=*/0);
//   torch::Tensor logits = model->forward(tokens.slice(1, 0, -1), [](int layer) {});
//   // ...a loss of logits, loss.backward()...
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace strata::apps {

struct GptConfig {
  std::int64_t vocab = 256;
  std::int64_t d_model = 128;
  std::int64_t heads = 4;
  std::int64_t layers = 4;  // transformer blocks
  std::int64_t seq = 64;    // tokens per sequence
  std::int64_t batch = 8;   // sequences per step
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(std::int64_t d_model, std::int64_t heads);
  // x: [batch, seq, d_model]; mask: [seq, seq], true above the diagonal (the future).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask);

 private:
  std::int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& config);
  // tokens: [batch, seq] int64 -> logits [batch, seq, vocab]. before_layer(l) runs before layer l.
  // after_backward, when given, runs for layers num_layers() - 1 down to 1 during the backward
  // pass of the returned logits, each once the layer's backward is done: its parameters' gradients
  // are accumulated and nothing of it runs again. It runs from a hook on the layer's input, on the
  // thread autograd runs backward on, before anything of the layer below starts. Layer 0 (the
  // embeddings) has no input to hook: its backward is done when backward() returns.
  torch::Tensor forward(const torch::Tensor& tokens, const std::function<void(int)>& before_layer,
                        const std::function<void(int)>& after_backward = {});
  // strata layers: layers + 2.
  int num_layers() const { return static_cast<int>(config_.layers) + 2; }
  // Every parameter's full name, grouped by strata layer (TorchBinding::register_module).
  std::vector<std::vector<std::string>> layer_grouping() const;
  // Whether a parameter (by full name) takes weight decay: matrices do; biases, norms don't.
  static bool decays(const std::string& name);
  const GptConfig& config() const { return config_; }

 private:
  GptConfig config_;
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Gpt);

// SplitMix64 over (seed, step): the random numbers a step's batch is drawn from, the same on every
// machine, without torch's generators.
class BatchRandom {
 public:
  BatchRandom(std::uint64_t seed, int step)
      : state_(seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(step)) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t state_;
};

// The step's batch, [batch, seq + 1] int64 on the CPU, the same for a given (seed, step) on every
// machine: sequences that follow a noisy affine rule over the vocabulary, so the loss has something
// to learn. Inputs are [:, :-1], targets [:, 1:].
torch::Tensor synthetic_batch(const GptConfig& config, std::uint64_t seed, int step);

// Parameters per strata layer, from the sizes alone (no model is built).
std::vector<std::int64_t> layer_parameter_counts(const GptConfig& config);
// Bytes of float32 parameters in the model.
std::int64_t parameter_bytes(const GptConfig& config);

}  // namespace strata::apps
