// bridge/model_hooks.h: what a training loop calls around forward and backward of a model bound
// layer by layer (TorchBinding::register_module and register_gradients), one implementation for
// strata-train, the Python package and any other client: the runtime's hooks in a step's order;
// each layer's part of the gradient norm and of loss scaling's inf check (GradientStats), taken
// right after its backward, before the policy sends its gradients away; and, for loops that never
// zero their gradients themselves, each layer's gradients zeroed just before its backward
// (See Note [Zeroing streamed gradients] in model_hooks.cpp). Throws c10 errors, as bridge/ does.
//
// Example (one step; hooks installed on the layers call before_forward and after_backward):
//   ModelHooks hooks(runtime, /*zero_before_backward=*/true);
//   hooks.set_layer_gradients(grads_of_layer);  // the bound gradients of each layer
//   hooks.begin_step();
//   ...forward, hooks.before_forward(l) before layer l...
//   hooks.begin_backward();
//   ...backward: hooks.before_backward(l) as layer l's backward begins (a hook on its output),
//      hooks.after_backward(l) once it is done (a hook on its input)...
//   hooks.finish_backward();  // layers whose after_backward did not run (the first one)
//   adam->step(hooks.stats().grad_scale(...)...);
//   hooks.end_step();
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "ATen/core/Tensor.h"
#include "bridge/grad_stats.h"
#include "bridge/torch_runtime.h"
#include "c10/core/Stream.h"
#include "runtime/runtime.h"

namespace strata::bridge {

class ModelHooks {
 public:
  explicit ModelHooks(rt::Runtime& runtime, bool zero_before_backward = false);

  // The bound gradients of each layer (index = layer); layers with none may be empty.
  void set_layer_gradients(std::vector<std::vector<at::Tensor>> grads);
  // The bound parameters of each layer, which before_forward checks are where torch can use them
  // once the policy's hook ran (TorchBinding::check_accessible), so that a forward over data that
  // is away raises a clear error instead of reading a null pointer. `binding` must outlive this.
  void set_layer_parameters(std::vector<std::vector<at::Tensor>> params,
                            const TorchBinding& binding);
  int num_layers() const { return static_cast<int>(grads_.size()); }

  // Gradient accumulation: a step's micro-batches each run forward and backward between
  // begin_step and end_step; only the first zeroes the gradients (the others add to them), and
  // only the last takes the statistics and calls set_after_layer's function (the gradients are
  // final only then).
  struct MicroBatch {
    bool first = true;
    bool last = true;
  };
  // Begins a step (or a micro-batch of one): the runtime's begin_step, and on the first
  // micro-batch the step's gradient statistics reset.
  void begin_step(MicroBatch micro_batch);
  void begin_step() { begin_step(MicroBatch{.first = true, .last = true}); }
  bool in_step() const { return in_step_; }
  // Before layer `layer` computes its forward (in any order; the order is remembered).
  void before_forward(int layer);
  // Once forward is done: with zero_before_backward, zeroes the last forwarded layer's gradients.
  void begin_backward();
  // Once the gradient of layer `layer`'s output is complete, before anything of its backward runs
  // (a hook on the output): the runtime's before_backward. Optional for a model whose backward
  // runs its layers in the reverse order of forward; needed otherwise (parallel branches, two
  // embeddings summed; See Note [Backward out of order] in policies/parameter_streaming.cpp).
  void before_backward(int layer);
  // Once layer `layer`'s backward is done (its gradients accumulated): its part of the statistics,
  // then the runtime's after_backward; with zero_before_backward, then zeroes the gradients of the
  // layer forwarded before it, whose backward comes next. Once per layer per step.
  void after_backward(int layer);
  // Called with the layer in after_backward, right after the runtime's after_backward: where an
  // optimizer steps each layer during backward (Adam::step_layer; See Note [Overlapped step] in
  // optim/adam.h). Empty: nothing. kOwnStream runs it, on a GPU, on a stream of its own with the
  // runtime computing there (See Note [The step stream] in model_hooks.cpp); kComputeStream on the
  // compute stream as the hook found it.
  enum class AfterLayerStream { kComputeStream, kOwnStream };
  void set_after_layer(std::function<void(int)> fn,
                       AfterLayerStream where = AfterLayerStream::kComputeStream);
  // The runtime's compute stream and torch's current stream wait for what set_after_layer's
  // function queued on its own stream; finish_backward does it, and whatever reads what that
  // function wrote before finish_backward (a step taken back) must call it first.
  void join_after_layer_stream();
  // after_backward for every layer forwarded this step whose after_backward has not run, last
  // forwarded first; a step with no forward hooks forwards every layer in order first. Then
  // join_after_layer_stream().
  void finish_backward();
  void end_step();

  GradientStats& stats() { return stats_; }

 private:
  void zero(int layer);
  void check_backward_hook(const char* hook, int layer) const;
  void run_after_layer(int layer);

  rt::Runtime& runtime_;
  const bool zero_before_backward_;
  std::vector<std::vector<at::Tensor>> grads_;
  std::vector<std::vector<at::Tensor>> params_;
  const TorchBinding* binding_ = nullptr;
  std::vector<int> forwarded_;  // this step, in order
  std::vector<bool> backward_done_;
  std::vector<bool> backward_begun_;  // before_backward ran
  std::vector<bool> zeroed_;          // zero_before_backward done
  bool in_step_ = false;
  MicroBatch micro_batch_;
  GradientStats stats_;
  std::function<void(int)> after_layer_;
  AfterLayerStream after_layer_stream_ = AfterLayerStream::kComputeStream;
  std::optional<c10::Stream> step_stream_;  // made at its first use
  bool step_stream_used_ = false;           // work queued there since the last join
};

}  // namespace strata::bridge
