#include "base/strings.h"
#include "policies/builtin.h"
#include "runtime/runtime.h"

namespace strata::policy {
namespace {

// Everything on the GPU, nothing moves: the baseline every other policy is compared with, and what
// a model whose state fits the GPU should use. Running out of GPU memory here is the allocator's
// out-of-memory error at registration.
class KeepOnGpu final : public rt::ResidencyPolicy {
 public:
  explicit KeepOnGpu(const rt::PolicyConfig& c) : ResidencyPolicy(c) {}
  std::string_view name() const override { return "keep_on_gpu"; }
  rt::Tier placement(const rt::TensorSpec&) const override { return rt::Tier::kGpu; }
};

}  // namespace

absl::StatusOr<std::unique_ptr<rt::ResidencyPolicy>> make_keep_on_gpu(const rt::PolicyConfig& c) {
  return std::unique_ptr<rt::ResidencyPolicy>(new KeepOnGpu(c));
}

}  // namespace strata::policy
