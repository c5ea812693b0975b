// optim/adam_placement.cpp: where Adam steps each layer (See Note [Step placement] in
// runtime/policy.h): the layers' costs and the machine's rates handed to the policy at create
// (place_steps), each step's time handed to a policy that measures them (measure_step), and the
// optimizer following the policy when it moves steps between two steps (follow_placement), float32
// masters included (See Note [Float32 masters follow the split]). Stepping the host's layers is
// adam_host_step.cpp's.
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "optim/adam.h"
#include "optim/step_rates.h"

namespace strata::optim {

absl::Status Adam::place_steps() {
  std::map<int, rt::LayerCost> by_layer;
  std::set<int> fixed;  // layers whose states depend on where they step
  for (const ParamGroup& group : groups_) {
    for (auto [param, grad] : group.params) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo p, runtime_.info(param));
      rt::DType grad_dtype = p.spec.dtype;
      if (grad.valid()) {
        STRATA_ASSIGN_OR_RETURN(rt::TensorInfo g, runtime_.info(grad));
        grad_dtype = g.spec.dtype;
      }
      const double n = static_cast<double>(p.bytes / rt::dtype_size(p.spec.dtype));
      rt::LayerCost& c = by_layer[p.spec.layer];
      c.layer = p.spec.layer;
      c.params += static_cast<std::int64_t>(n);
      // Weighted sums, divided by the parameters below: bytes a parameter over the layer.
      const StepRule& rule = *options_.rule;
      const auto numel = static_cast<std::int64_t>(n);
      c.state_bytes += static_cast<double>(state_bytes(
          rule.states(group.hyper, p.spec.dtype, rt::StepPlace::kGpu, options_.state_dtype),
          numel));
      c.grad_bytes += n * static_cast<double>(rt::dtype_size(grad_dtype));
      c.param_bytes += n * static_cast<double>(rt::dtype_size(p.spec.dtype));
      // See Note [Measured split] in policies/split_search.h: a layer moves between steps only
      // where its states stay what they are, but for a float32 parameter's master (See Note
      // [Float32 masters follow the split]).
      if (!host_master(group.hyper, p.spec.dtype).ok()) fixed.insert(p.spec.layer);
    }
  }
  rt::StepCosts costs;
  for (auto& [layer, c] : by_layer) {
    if (c.params > 0) {
      const double n = static_cast<double>(c.params);
      c.state_bytes /= n;
      c.grad_bytes /= n;
      c.param_bytes /= n;
    }
    c.movable = fixed.count(layer) == 0 && step_bytes_[layer] <= runtime_.gpu_budget();
    costs.layers.push_back(c);
  }
  // See Note [Measuring the step's rates] in step_rates.h; small on the simulated device, where the
  // figures say nothing about a GPU anyway.
  MeasureOptions measure;
  if (runtime_.device().is_simulated()) {
    measure = {.link_bytes = 1 << 20,
               .adam_params = 1 << 16,
               .memory_bytes = 1 << 20,
               .repeats = 1,
               .loaded_seconds = 0};
  }
  measure.moments = options_.state_dtype;
  measure.rule = options_.rule.get();
  if (options_.step_rates.has_value()) {
    costs.rates = *options_.step_rates;
  } else {
    STRATA_ASSIGN_OR_RETURN(costs.rates, measure_step_rates(runtime_, pool(), measure));
  }
  step_rates_ = costs.rates;
  STRATA_ASSIGN_OR_RETURN(placement_, runtime_.place_steps(costs));
  host_layers_.clear();
  for (const rt::LayerCost& c : costs.layers) {
    if (runtime_.step_place(c.layer) == rt::StepPlace::kHost) host_layers_.push_back(c.layer);
  }
  return absl::OkStatus();
}

absl::Status Adam::measure_step(rt::StepKind kind) {
  rt::Runtime& rt = runtime_;
  rt::Device& dev = rt.device();
  if (rt.wants_step_times()) {
    absl::Status s = time_step(kind);
    if (s.ok()) return absl::OkStatus();
    // See Note [Measured split] in policies/split_search.h: the step was taken and stands. The
    // search is an optimization: it stops, and the policy puts back what it moved for this step.
    absl::Status back = rt.refuse_step_move();
    const std::string why = str_cat("hybrid: the measured split stopped: ", s.message(),
                                    back.ok() ? "" : str_cat("; moving back: ", back.message()));
    std::fprintf(stderr, "strata: %s\n", why.c_str());
    placement_ = why;
  }
  if (step_end_ != nullptr) dev.release_timed(step_end_);
  step_end_ = nullptr;
  return absl::OkStatus();
}

absl::Status Adam::time_step(rt::StepKind kind) {
  rt::Runtime& rt = runtime_;
  rt::Device& dev = rt.device();
  // See Note [Measured split] in policies/split_search.h: from one step's end to the next on the
  // compute stream, so forward, backward and whatever the loop does between steps count too.
  STRATA_ASSIGN_OR_RETURN(rt::EventHandle end, dev.record_timed(rt.compute_stream()));
  if (absl::Status s = dev.synchronize(end); !s.ok()) {
    dev.release_timed(end);
    return s;
  }
  // The host kernel of this step has run by now: its parameters' copies precede the end. Its time
  // goes to the policy only for a step whose host layers all stepped after backward: one in
  // backward copies their undo too, and one redone runs the kernel twice (See Note [Host rate in
  // the step] in policies/hybrid.cpp).
  const std::int64_t kernel_ns = host_kernel_ns_.load();
  const std::int64_t kernel_ns_before = std::exchange(step_end_kernel_ns_, kernel_ns);
  const bool speculated =
      std::exchange(step_end_speculated_, host_speculation_.posted()) != host_speculation_.posted();
  const rt::EventHandle start = std::exchange(step_end_, end);
  if (start == nullptr) return absl::OkStatus();
  absl::StatusOr<double> ms = dev.elapsed_ms(start, end);
  dev.release_timed(start);
  STRATA_RETURN_IF_ERROR(ms.status());
  STRATA_ASSIGN_OR_RETURN(
      std::string line,
      rt.step_measured(
          {.seconds = *ms / 1e3,
           .host_kernel_seconds =
               speculated ? 0.0 : static_cast<double>(kernel_ns - kernel_ns_before) * 1e-9,
           .kind = kind}));
  STRATA_RETURN_IF_ERROR(follow_placement());
  if (line.empty()) return absl::OkStatus();
  placement_ = std::move(line);
  // The search is over: the host buffers of the splits it tried go back to the system, not to
  // the pinned pool's cache for the rest of the run (a failure only keeps them cached). Not in a
  // run that has stepped in backward: its next step there writes states back to fresh pinned
  // blocks and keeps the old ones for a redo (See Note [Undo log] in runtime/undo_log.cpp), which
  // the cache serves, where taking gigabytes from the system again stalls that step for seconds.
  if (host_speculation_.posted() > 0 || rt.stats().undo_peak_bytes > 0) return absl::OkStatus();
  if (absl::StatusOr<std::size_t> trimmed = rt.allocator().trim(rt::Tier::kPinnedHost);
      !trimmed.ok()) {
    std::fprintf(stderr, "strata: hybrid: keeping the pinned pool's cached segments: %s\n",
                 std::string(trimmed.status().message()).c_str());
  }
  return absl::OkStatus();
}

// Note [Float32 masters follow the split]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A float32 parameter keeps a master copy only while its layer steps on the host (See Note
// [Host-stepped layers] in adam_host_step.cpp), and the master is the parameter's value: the host
// step writes the one from the other, bit for bit. So a float32 layer may move with the measured
// split (See Note [Measured split] in policies/split_search.h): when the policy brings it to the
// host, follow_placement registers its masters from the parameters as they are (where the policy
// places the host layers' states, in pinned memory); when it leaves, the masters are unregistered
// once no host step reads them. The policy has laid the ring out by then, counting them; it lays
// it out again at the next step, as after any unregistration. Checkpoints and state dicts hold no
// master of a float32 parameter, which would be there or not with the split; load takes it from
// the parameter, and drops one that a checkpoint saved before this holds.
absl::StatusOr<std::optional<StateDecl>> Adam::host_master(const AdamHyper& hyper,
                                                           rt::DType param_dtype) const {
  const StepRule& rule = *options_.rule;
  std::vector<StateDecl> host =
      rule.states(hyper, param_dtype, rt::StepPlace::kHost, options_.state_dtype);
  const std::vector<StateDecl> gpu =
      rule.states(hyper, param_dtype, rt::StepPlace::kGpu, options_.state_dtype);
  if (host == gpu) return std::nullopt;
  if (param_dtype == rt::DType::kFloat32 && host.size() == gpu.size() + 1 &&
      host.back().from_parameter && std::equal(gpu.begin(), gpu.end(), host.begin())) {
    return host.back();
  }
  return absl::FailedPreconditionError(str_cat(
      rule.name(), ": a ", rt::dtype_name(param_dtype),
      " parameter's states on the host differ from its states on the GPU by more than a master"));
}

std::optional<StateDecl> Adam::float32_master_decl(const Slot& s) const {
  if (s.param_type != ElemType::kF32) return std::nullopt;
  absl::StatusOr<std::optional<StateDecl>> m =
      host_master(groups_[s.group].hyper, rt::DType::kFloat32);
  return m.ok() ? *m : std::nullopt;
}

absl::Status Adam::add_masters(int layer, std::vector<std::size_t>& added) {
  for (std::size_t index : by_layer_.at(layer)) {
    const Slot& s = slots_[index];
    if (s.master.valid()) continue;
    const std::optional<StateDecl> master = float32_master_decl(s);
    if (!master) continue;
    int j = 0;
    while (j < kMaxStates && s.declared[j].valid()) ++j;
    if (j == kMaxStates) {
      return absl::InternalError(str_cat("optimizer ", options_.rule->name(),
                                         " declares more than ", kMaxStates,
                                         " states with a master"));
    }
    STRATA_RETURN_IF_ERROR(register_state(index, j, *master));
    added.push_back(index);
  }
  return absl::OkStatus();
}

absl::Status Adam::drop_master(std::size_t index) {
  Slot& s = slots_[index];
  const rt::TensorHandle master = s.master;
  STRATA_RETURN_IF_ERROR(runtime_.unregister(master));
  std::erase_if(owned_, [&](rt::TensorHandle h) { return h.id == master.id; });
  slot_of_state_.erase(master.id);
  s.declared[s.master_at] = rt::TensorHandle{};
  s.suffixes[s.master_at].clear();
  s.master = rt::TensorHandle{};
  s.master_at = -1;
  return absl::OkStatus();
}

absl::Status Adam::follow_placement() {
  // As each step begins too: nothing is built unless the policy moved a layer.
  const bool same = std::all_of(by_layer_.begin(), by_layer_.end(), [&](const auto& entry) {
    const int layer = entry.first;
    return steps_on_host(layer) == (runtime_.step_place(layer) == rt::StepPlace::kHost);
  });
  if (same) return absl::OkStatus();
  std::vector<int> host;
  for (const auto& [layer, slots] : by_layer_) {
    if (runtime_.step_place(layer) == rt::StepPlace::kHost) host.push_back(layer);
  }
  // Until the layers coming to the host have their buffers nothing changes: every layer stepped on
  // the GPU must fit there, and a buffer that cannot be made takes back those made before it
  // (nothing has used them).
  std::map<int, std::size_t> step_bytes = all_step_bytes_;
  for (int layer : host) step_bytes.erase(layer);
  STRATA_RETURN_IF_ERROR(check_fits_gpu(runtime_, step_bytes));
  std::vector<int> made;
  std::vector<std::size_t> mastered;  // See Note [Float32 masters follow the split]
  for (int layer : host) {
    if (steps_on_host(layer)) continue;
    absl::Status s = make_layer_buffer(layer);
    if (s.ok()) {
      made.push_back(layer);
      s = add_masters(layer, mastered);
    }
    if (!s.ok()) {
      for (std::size_t i : mastered) (void)drop_master(i);
      for (int l : made) (void)free_layer_buffer(l);
      return absl::Status(s.code(), str_cat("Adam: the host buffers and masters for the layers the "
                                            "policy now steps on the host: ",
                                            s.message()));
    }
  }
  std::vector<int> leaving;
  std::set_difference(host_layers_.begin(), host_layers_.end(), host.begin(), host.end(),
                      std::back_inserter(leaving));
  host_layers_ = std::move(host);
  step_bytes_ = std::move(step_bytes);
  // The undo of host steps in backward is sized for the host slots: made again at the next one.
  void* const old_undo = host_speculation_.forget_undo();
  // The optimizer now follows the policy. What is left frees the buffers and masters of the
  // layers that left the host once no copy of the last step reads or writes them: all of it tried,
  // the first error returned. What cannot go is memory kept, no wrong step: a layer stepped on the
  // GPU with its master still there steps it as a low-precision parameter's.
  host_speculation_.wait_for_host_steps();
  absl::Status first = sync_host_streams();
  if (first.ok()) {  // else a copy may still use them: they are kept
    for (int layer : leaving) {
      first.Update(free_layer_buffer(layer));
      for (std::size_t index : by_layer_.at(layer)) {
        if (slots_[index].float32_master(slots_[index].master)) first.Update(drop_master(index));
      }
    }
  }
  first.Update(host_speculation_.free_undo(old_undo));  // host threads only, done with it
  return first;
}

}  // namespace strata::optim
