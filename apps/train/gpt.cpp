#include "apps/train/gpt.h"

#include <cmath>
#include <limits>

namespace strata::apps {

BlockImpl::BlockImpl(std::int64_t d_model, std::int64_t heads) : heads_(heads) {
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  fc1_ = register_module("fc1", torch::nn::Linear(d_model, 4 * d_model));
  fc2_ = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  const std::int64_t b = x.size(0), t = x.size(1), d = x.size(2), dh = d / heads_;
  std::vector<torch::Tensor> qkv = qkv_->forward(ln1_->forward(x)).chunk(3, -1);
  auto heads = [&](const torch::Tensor& y) { return y.view({b, t, heads_, dh}).transpose(1, 2); };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  // Attention by matmuls rather than a fused kernel: some fused backward passes accumulate with
  // atomics, and every policy must see the same numbers.
  torch::Tensor att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
  torch::Tensor y = att.matmul(v).transpose(1, 2).reshape({b, t, d});
  torch::Tensor h = x + proj_->forward(y);
  return h + fc2_->forward(torch::gelu(fc1_->forward(ln2_->forward(h))));
}

GptImpl::GptImpl(const GptConfig& config) : config_(config) {
  tok_ = register_module("tok", torch::nn::Embedding(config.vocab, config.d_model));
  pos_ = register_module("pos", torch::nn::Embedding(config.seq, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (std::int64_t i = 0; i < config.layers; ++i) {
    blocks_->push_back(Block(config.d_model, config.heads));
  }
  ln_f_ =
      register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
  head_ = register_module("head", torch::nn::Linear(config.d_model, config.vocab));
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens,
                               const std::function<void(int)>& before_layer,
                               const std::function<void(int)>& after_backward) {
  const std::int64_t t = tokens.size(1);
  // The gradient of a layer's input is complete once everything of the layer that leads to it has
  // run, and autograd runs a parameter's gradient accumulation as soon as it can (ahead of every
  // other ready node), so when the hook runs the layer's gradients are all in. Nothing of the
  // layer below can run before: it needs this very gradient.
  auto hook_input = [&](torch::Tensor& input, int layer) {
    if (!after_backward || !input.requires_grad()) return;
    input.register_hook([after_backward, layer](const at::TensorBase&) { after_backward(layer); });
  };
  before_layer(0);
  torch::Tensor positions = torch::arange(t, tokens.options());
  torch::Tensor x = tok_->forward(tokens) + pos_->forward(positions);
  torch::Tensor mask =
      torch::ones({t, t}, tokens.options().dtype(torch::kBool)).triu(/*diagonal=*/1);
  for (std::size_t i = 0; i < blocks_->size(); ++i) {
    const int layer = static_cast<int>(i) + 1;
    before_layer(layer);
    hook_input(x, layer);
    x = blocks_[i]->as<Block>()->forward(x, mask);
  }
  before_layer(num_layers() - 1);
  hook_input(x, num_layers() - 1);
  return head_->forward(ln_f_->forward(x));
}

std::vector<std::vector<std::string>> GptImpl::layer_grouping() const {
  std::vector<std::vector<std::string>> groups(num_layers());
  for (const auto& p : named_parameters(/*recurse=*/true)) {
    const std::string& name = p.key();
    int layer = num_layers() - 1;  // ln_f., head.
    if (name.rfind("tok.", 0) == 0 || name.rfind("pos.", 0) == 0) {
      layer = 0;
    } else if (name.rfind("blocks.", 0) == 0) {
      layer = 1 + std::stoi(name.substr(7, name.find('.', 7) - 7));
    }
    groups[layer].push_back(name);
  }
  return groups;
}

bool GptImpl::decays(const std::string& name) {
  const bool bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  const bool norm = name.find("ln") != std::string::npos;
  return !bias && !norm;
}

torch::Tensor synthetic_batch(const GptConfig& config, std::uint64_t seed, int step) {
  BatchRandom random(seed, step);
  torch::Tensor out = torch::empty({config.batch, config.seq + 1}, torch::kInt64);
  auto a = out.accessor<std::int64_t, 2>();
  for (std::int64_t b = 0; b < config.batch; ++b) {
    // Each sequence has its own stride; one token in eight is noise.
    const std::int64_t stride = 1 + static_cast<std::int64_t>(random.next() % 7);
    std::int64_t token = static_cast<std::int64_t>(random.next() % config.vocab);
    for (std::int64_t t = 0; t <= config.seq; ++t) {
      a[b][t] = token;
      const std::uint64_t r = random.next();
      token = (r % 8 == 0) ? static_cast<std::int64_t>((r >> 8) % config.vocab)
                           : (token * 3 + stride) % config.vocab;
    }
  }
  return out;
}

std::vector<std::int64_t> layer_parameter_counts(const GptConfig& c) {
  const std::int64_t d = c.d_model;
  const std::int64_t block = 2 * 2 * d            // two LayerNorms
                             + d * 3 * d + 3 * d  // qkv
                             + d * d + d          // proj
                             + d * 4 * d + 4 * d  // fc1
                             + 4 * d * d + d;     // fc2
  std::vector<std::int64_t> out;
  out.push_back(c.vocab * d + c.seq * d);  // embeddings
  for (std::int64_t i = 0; i < c.layers; ++i) out.push_back(block);
  out.push_back(2 * d + d * c.vocab + c.vocab);  // ln_f, head
  return out;
}

std::int64_t parameter_bytes(const GptConfig& config) {
  std::int64_t params = 0;
  for (std::int64_t n : layer_parameter_counts(config)) params += n;
  return params * 4;
}

}  // namespace strata::apps
