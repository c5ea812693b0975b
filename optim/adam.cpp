#include "optim/adam.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"
#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

absl::Status check_tensor(const rt::TensorInfo& info, rt::Role role, std::string_view what) {
  if (info.spec.dtype != rt::DType::kFloat32) {
    return absl::InvalidArgumentError(str_cat("Adam: ", what, " '", info.spec.name, "' is ",
                                              rt::dtype_name(info.spec.dtype),
                                              "; Adam steps float32 tensors"));
  }
  if (info.spec.role != role) {
    return absl::InvalidArgumentError(str_cat("Adam: ", what, " '", info.spec.name, "' has role ",
                                              rt::role_name(info.spec.role), ", not ",
                                              rt::role_name(role)));
  }
  return absl::OkStatus();
}

// Hyperparameters torch.optim.AdamW would accept; NaN fails every comparison, so it is refused too.
absl::Status check_hyper(const AdamHyper& h, std::size_t group) {
  auto bad = [&](std::string_view what, float value, std::string_view want) {
    return absl::InvalidArgumentError(
        str_cat("Adam: group ", group, ": ", what, " ", value, " is invalid; ", want));
  };
  if (!(h.lr >= 0.0f) || std::isinf(h.lr)) return bad("lr", h.lr, "use a finite lr >= 0");
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f)) return bad("beta1", h.beta1, "use 0 <= beta1 < 1");
  if (!(h.beta2 >= 0.0f && h.beta2 < 1.0f)) return bad("beta2", h.beta2, "use 0 <= beta2 < 1");
  if (!(h.eps > 0.0f) || std::isinf(h.eps)) return bad("eps", h.eps, "use a finite eps > 0");
  if (!(h.weight_decay >= 0.0f) || std::isinf(h.weight_decay)) {
    return bad("weight_decay", h.weight_decay, "use a finite weight_decay >= 0");
  }
  return absl::OkStatus();
}

// Every layer's step working set must fit the GPU: the kernel reads GPU memory only, and a layer
// that cannot be brought there whole would fail its step half way through the model.
absl::Status check_fits_gpu(rt::Runtime& runtime, const std::map<int, std::size_t>& step_bytes) {
  const std::size_t budget = runtime.gpu_budget();
  for (auto [layer, bytes] : step_bytes) {
    if (bytes > budget) {
      return absl::ResourceExhaustedError(str_cat(
          "Adam: layer ", layer, " needs ", format_bytes(bytes),
          " on the GPU for its step (parameters, gradients and moments; the kernel reads GPU "
          "memory only), more than the GPU budget of ",
          format_bytes(budget)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Adam::Adam(rt::Runtime& runtime, AdamOptions options)
    : runtime_(runtime), options_(std::move(options)) {}

Adam::~Adam() = default;

absl::StatusOr<std::unique_ptr<Adam>> Adam::create(rt::Runtime& runtime, AdamOptions options) {
  std::unique_ptr<Adam> adam(new Adam(runtime, std::move(options)));
  std::set<std::uint64_t> seen;
  // Check everything first, so a bad input registers nothing.
  for (std::size_t g = 0; g < adam->groups_.size(); ++g) {
    STRATA_RETURN_IF_ERROR(check_hyper(adam->groups_[g].hyper, g));
    for (auto [param, grad] : adam->groups_[g].params) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo p, runtime.info(param));
      if (!grad.valid()) {
        return absl::InvalidArgumentError(
            str_cat("Adam: parameter '", p.spec.name, "' has no gradient"));
      }
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo d, runtime.info(grad));
      STRATA_RETURN_IF_ERROR(check_tensor(p, rt::Role::kParameter, "parameter"));
      STRATA_RETURN_IF_ERROR(check_tensor(d, rt::Role::kGradient, "gradient"));
      if (p.spec.shape != d.spec.shape || p.spec.layer != d.spec.layer) {
        return absl::InvalidArgumentError(str_cat("Adam: gradient '", d.spec.name,
                                                  "' does not match parameter '", p.spec.name,
                                                  "' in shape or layer"));
      }
      if (!seen.insert(param.id).second) {
        return absl::InvalidArgumentError(
            str_cat("Adam: parameter '", p.spec.name, "' is listed twice"));
      }
      const std::size_t moments = adam->groups_[g].hyper.amsgrad ? 3 : 2;
      adam->step_bytes_[p.spec.layer] += p.bytes + d.bytes + moments * p.bytes;
    }
  }
  STRATA_RETURN_IF_ERROR(check_fits_gpu(runtime, adam->step_bytes_));
  for (std::size_t g = 0; g < adam->groups_.size(); ++g) {
    for (auto [param, grad] : adam->groups_[g].params) {
      rt::TensorInfo p = *runtime.info(param);
      Slot slot{param, grad, {},           {},
                {},    g,    p.spec.layer, static_cast<std::int64_t>(p.bytes / sizeof(float))};
      auto add_state = [&](std::string_view suffix,
                           rt::Role role) -> absl::StatusOr<rt::TensorHandle> {
        rt::TensorSpec spec = p.spec;
        spec.name = str_cat(p.spec.name, ".", suffix);
        spec.role = role;
        return runtime.register_tensor(spec, nullptr);  // zeros
      };
      STRATA_ASSIGN_OR_RETURN(slot.exp_avg, add_state("exp_avg", rt::Role::kExpAvg));
      STRATA_ASSIGN_OR_RETURN(slot.exp_avg_sq, add_state("exp_avg_sq", rt::Role::kExpAvgSq));
      if (adam->groups_[g].hyper.amsgrad) {
        STRATA_ASSIGN_OR_RETURN(slot.max_exp_avg_sq, add_state("max_exp_avg_sq", rt::Role::kOther));
      }
      for (rt::TensorHandle h : {slot.exp_avg, slot.exp_avg_sq, slot.max_exp_avg_sq}) {
        if (h.valid()) adam->slot_of_state_[h.id] = adam->slots_.size();
      }
      adam->slot_of_param_[param.id] = adam->slots_.size();
      adam->by_layer_[slot.layer].push_back(adam->slots_.size());
      adam->slots_.push_back(slot);
    }
  }
  adam->steps_.assign(adam->groups_.size(), 0);
  return adam;
}

absl::Status Adam::set_lr(std::size_t group, float lr) {
  if (group >= groups_.size()) {
    return absl::InvalidArgumentError(str_cat("Adam: no parameter group ", group));
  }
  if (!(lr >= 0.0f) || std::isinf(lr)) {
    return absl::InvalidArgumentError(
        str_cat("Adam: group ", group, ": lr ", lr, " is invalid; use a finite lr >= 0"));
  }
  groups_[group].hyper.lr = lr;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<rt::TensorHandle>> Adam::state(rt::TensorHandle param) const {
  for (const Slot& s : slots_) {
    if (s.param == param) {
      std::vector<rt::TensorHandle> out = {s.exp_avg, s.exp_avg_sq};
      if (s.max_exp_avg_sq.valid()) out.push_back(s.max_exp_avg_sq);
      return out;
    }
  }
  return absl::NotFoundError("Adam: no state for that parameter");
}

absl::Status Adam::check_can_step() {
  // The handles were checked, and nothing was unregistered since: all still there.
  const std::uint64_t unregistrations = runtime_.unregistrations();
  if (unregistrations == checked_unregistrations_) return check_fits_gpu(runtime_, step_bytes_);
  for (const Slot& s : slots_) {
    for (rt::TensorHandle h : {s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq}) {
      if (!h.valid()) continue;
      if (!runtime_.is_registered(h)) {
        return absl::FailedPreconditionError(
            str_cat("Adam: tensor handle ", h.id, " of layer ", s.layer,
                    " was unregistered after the optimizer was made"));
      }
    }
  }
  checked_unregistrations_ = unregistrations;
  return check_fits_gpu(runtime_, step_bytes_);
}

absl::Status Adam::step(const float* grad_scale, const float* found_inf) {
  rt::Runtime& rt = runtime_;
  STRATA_RETURN_IF_ERROR(check_can_step());
  last_step_.clear();
  if (absl::Status begin = rt.begin_optimizer_step(); !begin.ok()) {
    // The runtime has put back what the policy staged.
    return absl::Status(begin.code(), str_cat("Adam step failed before any kernel ran (nothing "
                                              "changed; it can be retried): ",
                                              begin.message()));
  }
  for (std::int64_t& s : steps_) ++s;
  // Note [A failed step]: parameters are stepped one launch after another, so a step that fails
  // part way has stepped those launched before the failure (last_step_parameters() lists them).
  // What it guarantees: no tensor is left held, the policy's end of step runs (staged states go
  // home), every byte is intact (each tensor is either stepped or as it was), and the runtime
  // takes the next step. If no kernel was queued yet, the step counters go back too, so a retry
  // is exact; otherwise the error says which layers were stepped (restore a checkpoint to redo the
  // step).
  std::vector<rt::TensorHandle> held;
  int failed_layer = -1;
  absl::Status status = step_layers(grad_scale, found_inf, held, failed_layer);
  if (status.ok()) {
    // Every layer is stepped; the policy's end of step is resumable, so one failure is retried.
    absl::Status end = rt.end_optimizer_step();
    if (!end.ok()) end = rt.end_optimizer_step();
    if (!end.ok()) {
      return absl::Status(end.code(), str_cat("Adam step ", steps_.empty() ? 0 : steps_[0],
                                              " stepped every layer, but the policy's end of "
                                              "step failed twice (the next hook finishes it): ",
                                              end.message()));
    }
    return absl::OkStatus();
  }
  // Two tries: a device that cannot record one event may record the next.
  for (int attempt = 0; attempt < 2 && !held.empty(); ++attempt) {
    if (rt.release(held, rt.compute_stream()).ok()) held.clear();
  }
  (void)rt.end_optimizer_step();  // what it cannot finish, the next hook does
  if (last_step_.empty()) {
    for (std::int64_t& s : steps_) --s;
    return absl::Status(status.code(), str_cat("Adam step failed before any kernel ran (nothing "
                                               "changed; it can be retried): ",
                                               status.message()));
  }
  std::string layers;
  for (int l : last_step_layers()) str_append(&layers, layers.empty() ? "" : ", ", l);
  return absl::Status(status.code(),
                      str_cat("Adam step ", steps_.empty() ? 0 : steps_[0], " failed at layer ",
                              failed_layer, " after stepping ", last_step_.size(), " of ",
                              slots_.size(), " parameters (in layers ", layers,
                              "); restore a checkpoint to redo the step: ", status.message()));
}

std::vector<int> Adam::last_step_layers() const {
  std::vector<int> out;
  for (rt::TensorHandle p : last_step_) {
    const int layer = slots_[slot_of_param_.at(p.id)].layer;
    if (std::find(out.begin(), out.end(), layer) == out.end()) out.push_back(layer);
  }
  return out;
}

absl::Status Adam::step_layers(const float* grad_scale, const float* found_inf,
                               std::vector<rt::TensorHandle>& held, int& failed_layer) {
  rt::Runtime& rt = runtime_;
  std::vector<AdamScalars> scalars;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    scalars.push_back(adam_scalars(groups_[g].hyper, steps_[g]));
  }
  const rt::StreamHandle stream = rt.compute_stream();
  const bool simulated = rt.device().is_simulated();

  // Queues the kernel for `list` (tensors of one group, of the slots `of`) on the compute stream;
  // once queued, those parameters count as stepped.
  auto launch = [&](const std::vector<AdamTensor>& list, const std::vector<std::size_t>& of,
                    std::size_t g) -> absl::Status {
    if (list.empty()) return absl::OkStatus();
    absl::Status queued;
    if (simulated) {
      const int threads = options_.cpu_threads;
      queued =
          rt.device().enqueue_host(stream, [list, s = scalars[g], threads, grad_scale, found_inf] {
            if (found_inf != nullptr && *found_inf != 0.0f) return;
            const float inv = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
            adam_step_cpu(list.data(), list.size(), s, inv, threads);
          });
    } else {
#ifdef STRATA_HAS_CUDA
      const cudaError_t err = adam_step_cuda(list.data(), list.size(), scalars[g], grad_scale,
                                             found_inf, static_cast<cudaStream_t>(stream));
      if (err != cudaSuccess) {
        queued =
            absl::InternalError(str_cat("Adam kernel launch failed: ", cudaGetErrorString(err)));
      }
#else
      queued = absl::UnavailableError("Adam on a CUDA device needs strata built with CUDA");
#endif
    }
    if (queued.ok()) {
      for (std::size_t index : of) last_step_.push_back(slots_[index].param);
    }
    return queued;
  };

  for (int layer : rt.optimizer_layer_order()) {
    auto it = by_layer_.find(layer);
    // Note [Per-parameter pipelining]: a staged layer arrives tensor by tensor, so its parameters
    // are stepped one at a time in the order their moments arrive (Note [Staging order] in
    // runtime.h), each released right after its kernel: the first kernel starts when the first
    // parameter's moments are in, and each write-back can start while the rest of the layer is
    // still arriving. That shortens the time only one copy direction is busy at the start and end
    // of the step. A resident layer gets one multi-tensor launch per group instead.
    failed_layer = layer;
    const std::vector<std::size_t>& arrived = arrival_order(layer);
    const bool pipelined = !arrived.empty();
    std::vector<std::vector<AdamTensor>> per_group(groups_.size());
    std::vector<std::vector<std::size_t>> slots_of_group(groups_.size());
    if (it != by_layer_.end()) {
      for (std::size_t index : pipelined ? arrived : it->second) {
        const Slot* s = &slots_[index];
        AdamTensor t;
        void* ptrs[5] = {};
        const rt::TensorHandle hs[5] = {s->param, s->grad, s->exp_avg, s->exp_avg_sq,
                                        s->max_exp_avg_sq};
        for (int k = 0; k < 5; ++k) {
          if (!hs[k].valid()) continue;
          absl::StatusOr<void*> p = rt.acquire(hs[k], rt::Tier::kGpu, stream);
          if (!p.ok()) return p.status();  // step() releases what is held
          held.push_back(hs[k]);
          ptrs[k] = *p;
        }
        t.param = static_cast<float*>(ptrs[0]);
        t.grad = static_cast<const float*>(ptrs[1]);
        t.exp_avg = static_cast<float*>(ptrs[2]);
        t.exp_avg_sq = static_cast<float*>(ptrs[3]);
        t.max_exp_avg_sq = static_cast<float*>(ptrs[4]);
        t.numel = s->numel;
        if (pipelined) {
          STRATA_RETURN_IF_ERROR(launch({t}, {index}, s->group));
          STRATA_RETURN_IF_ERROR(rt.release(held, stream));
          held.clear();
        } else {
          per_group[s->group].push_back(t);
          slots_of_group[s->group].push_back(index);
        }
      }
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      STRATA_RETURN_IF_ERROR(launch(per_group[g], slots_of_group[g], g));
    }
    STRATA_RETURN_IF_ERROR(rt.release(held, stream));
    held.clear();
    // Tell the policy the layer is done (write-back, next prefetch); its tensors are released.
    STRATA_RETURN_IF_ERROR(rt.release_layer(layer, rt::RoleSet(), stream));
  }
  return absl::OkStatus();
}

const std::vector<std::size_t>& Adam::arrival_order(int layer) {
  arrival_order_.clear();
  runtime_.staged_tensors(layer, arrived_);
  if (arrived_.empty()) return arrival_order_;
  auto listed = [&](std::size_t index) {
    return std::find(arrival_order_.begin(), arrival_order_.end(), index) != arrival_order_.end();
  };
  for (rt::TensorHandle h : arrived_) {
    auto it = slot_of_state_.find(h.id);
    if (it != slot_of_state_.end() && slots_[it->second].layer == layer && !listed(it->second)) {
      arrival_order_.push_back(it->second);
    }
  }
  // Slots with nothing staged (empty tensors take no slot space) follow in registration order.
  if (auto it = by_layer_.find(layer); it != by_layer_.end()) {
    for (std::size_t index : it->second) {
      if (!listed(index)) arrival_order_.push_back(index);
    }
  }
  return arrival_order_;
}

// Checkpoint format (little-endian, as the machine writes it):
//   "STRATA-ADAM-1\n", u32 groups, per group {i64 step, AdamHyper}, u32 tensors, per tensor
//   {u32 name length, name, u64 bytes, bytes}, u64 FNV-1a of everything before it.
namespace {

constexpr char kMagic[] = "STRATA-ADAM-1\n";

struct Hasher {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* data, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

class Writer {
 public:
  explicit Writer(std::ostream& out) : out_(out) {}
  void bytes(const void* data, std::size_t n) {
    hash_.add(data, n);
    out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  }
  template <typename T>
  void pod(const T& v) {
    bytes(&v, sizeof(T));
  }
  std::uint64_t hash() const { return hash_.h; }
  bool ok() const { return static_cast<bool>(out_); }

 private:
  std::ostream& out_;
  Hasher hash_;
};

class Reader {
 public:
  explicit Reader(std::istream& in) : in_(in) {}
  bool bytes(void* data, std::size_t n) {
    in_.read(static_cast<char*>(data), static_cast<std::streamsize>(n));
    if (static_cast<std::size_t>(in_.gcount()) != n) return false;
    hash_.add(data, n);
    return true;
  }
  template <typename T>
  bool pod(T& v) {
    return bytes(&v, sizeof(T));
  }
  std::uint64_t hash() const { return hash_.h; }

 private:
  std::istream& in_;
  Hasher hash_;
};

absl::Status truncated() {
  return absl::DataLossError("Adam checkpoint is truncated or not a strata Adam checkpoint");
}

}  // namespace

absl::Status Adam::save(std::ostream& out) {
  Writer w(out);
  w.bytes(kMagic, sizeof(kMagic) - 1);
  w.pod(static_cast<std::uint32_t>(groups_.size()));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    w.pod(steps_[g]);
    w.pod(groups_[g].hyper);
  }
  std::vector<rt::TensorHandle> tensors;
  for (const Slot& s : slots_) {
    for (rt::TensorHandle h : {s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq}) {
      if (h.valid()) tensors.push_back(h);
    }
  }
  w.pod(static_cast<std::uint32_t>(tensors.size()));
  std::vector<unsigned char> buffer;
  for (rt::TensorHandle h : tensors) {
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(h));
    w.pod(static_cast<std::uint32_t>(info.spec.name.size()));
    w.bytes(info.spec.name.data(), info.spec.name.size());
    w.pod(static_cast<std::uint64_t>(info.bytes));
    buffer.resize(info.bytes);
    STRATA_RETURN_IF_ERROR(runtime_.read(h, buffer.data()));  // from its tier, to host memory
    w.bytes(buffer.data(), buffer.size());
  }
  const std::uint64_t sum = w.hash();
  out.write(reinterpret_cast<const char*>(&sum), sizeof(sum));
  if (!out) return absl::InternalError("Adam checkpoint: writing failed");
  return absl::OkStatus();
}

absl::Status Adam::load(std::istream& in) {
  // Read and check everything first; write into the runtime only once the whole file is good.
  Reader r(in);
  char magic[sizeof(kMagic) - 1];
  if (!r.bytes(magic, sizeof(magic)) || std::string_view(magic, sizeof(magic)) != kMagic) {
    return truncated();
  }
  std::uint32_t groups = 0;
  if (!r.pod(groups)) return truncated();
  if (groups != groups_.size()) {
    return absl::InvalidArgumentError(str_cat(
        "Adam checkpoint has ", groups, " parameter groups; this optimizer has ", groups_.size()));
  }
  std::vector<std::int64_t> steps(groups);
  std::vector<AdamHyper> hypers(groups);
  for (std::uint32_t g = 0; g < groups; ++g) {
    if (!r.pod(steps[g]) || !r.pod(hypers[g])) return truncated();
    if (steps[g] < 0) return absl::DataLossError("Adam checkpoint: negative step counter");
  }
  std::uint32_t count = 0;
  if (!r.pod(count)) return truncated();
  std::vector<std::pair<rt::TensorHandle, std::vector<unsigned char>>> values;
  for (std::uint32_t i = 0; i < count; ++i) {
    std::uint32_t len = 0;
    if (!r.pod(len) || len > (1u << 20)) return truncated();
    std::string name(len, '\0');
    std::uint64_t bytes = 0;
    if (!r.bytes(name.data(), len) || !r.pod(bytes)) return truncated();
    absl::StatusOr<rt::TensorHandle> h = runtime_.find(name);
    if (!h.ok()) {
      return absl::InvalidArgumentError(
          str_cat("Adam checkpoint has state '", name, "', which this optimizer does not"));
    }
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(*h));
    if (info.bytes != bytes) {
      return absl::InvalidArgumentError(str_cat("Adam checkpoint: state '", name, "' has ", bytes,
                                                " bytes; here it has ", info.bytes));
    }
    std::vector<unsigned char> data(bytes);
    if (!r.bytes(data.data(), bytes)) return truncated();
    values.emplace_back(*h, std::move(data));
  }
  const std::uint64_t expect = r.hash();
  std::uint64_t sum = 0;
  in.read(reinterpret_cast<char*>(&sum), sizeof(sum));
  if (in.gcount() != sizeof(sum)) return truncated();
  if (sum != expect) return absl::DataLossError("Adam checkpoint: checksum mismatch (corrupt)");
  std::size_t states = 0;
  for (const Slot& s : slots_) states += s.max_exp_avg_sq.valid() ? 3 : 2;
  if (values.size() != states) {
    return absl::InvalidArgumentError(str_cat("Adam checkpoint has ", values.size(),
                                              " state tensors; this optimizer has ", states));
  }
  // All or nothing: the current values are kept, and written back if a write fails part way.
  std::vector<std::vector<unsigned char>> previous(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    previous[i].resize(values[i].second.size());
    if (absl::Status s = runtime_.read(values[i].first, previous[i].data()); !s.ok()) {
      return absl::Status(s.code(), str_cat("Adam checkpoint: nothing loaded: ", s.message()));
    }
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    absl::Status s = runtime_.write(values[i].first, values[i].second.data());
    if (s.ok()) continue;
    absl::Status restored;
    for (std::size_t j = 0; j <= i && restored.ok(); ++j) {
      restored = runtime_.write(values[j].first, previous[j].data());
    }
    if (!restored.ok()) {
      return absl::Status(
          s.code(),
          str_cat("Adam checkpoint: writing a state failed (", s.message(),
                  ") and putting the previous values back "
                  "failed too (",
                  restored.message(), "): the optimizer state is partly loaded; load again"));
    }
    return absl::Status(s.code(), str_cat("Adam checkpoint: nothing loaded: ", s.message()));
  }
  steps_ = steps;
  for (std::uint32_t g = 0; g < groups; ++g) groups_[g].hyper = hypers[g];
  return absl::OkStatus();
}

}  // namespace strata::optim
