#include "optim/adam.h"

#include <algorithm>
#include <map>
#include <set>

#include "base/status.h"
#include "base/strings.h"
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

}  // namespace

Adam::Adam(rt::Runtime& runtime, AdamOptions options)
    : runtime_(runtime), options_(std::move(options)) {}

Adam::~Adam() = default;

absl::StatusOr<std::unique_ptr<Adam>> Adam::create(rt::Runtime& runtime, AdamOptions options) {
  std::unique_ptr<Adam> adam(new Adam(runtime, std::move(options)));
  std::set<std::uint64_t> seen;
  // Check everything first, so a bad input registers nothing.
  for (std::size_t g = 0; g < adam->groups_.size(); ++g) {
    for (auto [param, grad] : adam->groups_[g].params) {
      STRATA_ASSIGN_OR_RETURN(rt::TensorInfo p, runtime.info(param));
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
    }
  }
  for (std::size_t g = 0; g < adam->groups_.size(); ++g) {
    for (auto [param, grad] : adam->groups_[g].params) {
      rt::TensorInfo p = *runtime.info(param);
      Slot slot{param, grad, {}, {}, {}, g, p.spec.layer};
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
  if (!(lr >= 0.0f)) return absl::InvalidArgumentError(str_cat("Adam: learning rate ", lr));
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

absl::Status Adam::step(const float* grad_scale, const float* found_inf) {
  rt::Runtime& rt = runtime_;
  STRATA_RETURN_IF_ERROR(rt.begin_optimizer_step());
  for (std::int64_t& s : steps_) ++s;
  std::vector<AdamScalars> scalars;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    scalars.push_back(adam_scalars(groups_[g].hyper, steps_[g]));
  }
  std::map<int, std::vector<const Slot*>> by_layer;
  for (const Slot& s : slots_) by_layer[s.layer].push_back(&s);
  const rt::StreamHandle stream = rt.compute_stream();
  const bool simulated = rt.device().is_simulated();

  for (int layer : rt.optimizer_layer_order()) {
    auto it = by_layer.find(layer);
    std::vector<rt::TensorHandle> held;
    std::vector<std::vector<AdamTensor>> per_group(groups_.size());
    if (it != by_layer.end()) {
      for (const Slot* s : it->second) {
        AdamTensor t;
        void* ptrs[5] = {};
        const rt::TensorHandle hs[5] = {s->param, s->grad, s->exp_avg, s->exp_avg_sq,
                                        s->max_exp_avg_sq};
        for (int k = 0; k < 5; ++k) {
          if (!hs[k].valid()) continue;
          absl::StatusOr<void*> p = rt.acquire(hs[k], rt::Tier::kGpu, stream);
          if (!p.ok()) {
            for (rt::TensorHandle h : held) (void)rt.release(h, stream);
            return p.status();
          }
          held.push_back(hs[k]);
          ptrs[k] = *p;
        }
        t.param = static_cast<float*>(ptrs[0]);
        t.grad = static_cast<const float*>(ptrs[1]);
        t.exp_avg = static_cast<float*>(ptrs[2]);
        t.exp_avg_sq = static_cast<float*>(ptrs[3]);
        t.max_exp_avg_sq = static_cast<float*>(ptrs[4]);
        t.numel = static_cast<std::int64_t>(rt.info(s->param)->bytes / sizeof(float));
        per_group[s->group].push_back(t);
      }
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (per_group[g].empty()) continue;
      if (simulated) {
        const int threads = options_.cpu_threads;
        STRATA_RETURN_IF_ERROR(rt.device().enqueue_host(
            stream, [list = per_group[g], s = scalars[g], threads, grad_scale, found_inf] {
              if (found_inf != nullptr && *found_inf != 0.0f) return;
              const float inv = grad_scale != nullptr ? 1.0f / *grad_scale : 1.0f;
              adam_step_cpu(list.data(), list.size(), s, inv, threads);
            }));
      } else {
#ifdef STRATA_HAS_CUDA
        const cudaError_t err =
            adam_step_cuda(per_group[g].data(), per_group[g].size(), scalars[g], grad_scale,
                           found_inf, static_cast<cudaStream_t>(stream));
        if (err != cudaSuccess) {
          return absl::InternalError(
              str_cat("Adam kernel launch failed: ", cudaGetErrorString(err)));
        }
#else
        return absl::UnavailableError("Adam on a CUDA device needs strata built with CUDA");
#endif
      }
    }
    for (rt::TensorHandle h : held) STRATA_RETURN_IF_ERROR(rt.release(h, stream));
    // Tell the policy the layer is done (write-back, next prefetch); its tensors are released.
    STRATA_RETURN_IF_ERROR(rt.release_layer(layer, rt::RoleSet(), stream));
  }
  return rt.end_optimizer_step();
}

}  // namespace strata::optim
