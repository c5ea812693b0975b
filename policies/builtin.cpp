#include "policies/builtin.h"

#include "base/status.h"

namespace strata::policy {

const rt::PolicyRegistry& builtin_policies() {
  static const rt::PolicyRegistry* registry = [] {
    auto* r = new rt::PolicyRegistry();
    STRATA_CHECK(r->add("keep_on_gpu", make_keep_on_gpu).ok(), "keep_on_gpu");
    STRATA_CHECK(r->add("bulk", make_bulk).ok(), "bulk");
    STRATA_CHECK(r->add("layer_prefetch", make_layer_prefetch).ok(), "layer_prefetch");
    STRATA_CHECK(r->add("hybrid", make_hybrid).ok(), "hybrid");
    return r;
  }();
  return *registry;
}

}  // namespace strata::policy
