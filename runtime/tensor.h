// runtime/tensor.h: what the runtime knows about a registered tensor.
//
// A tensor is registered with a name, a layer index, a role (parameter, gradient, optimizer state,
// other), for an optimizer state the name its optimizer declared it under, a dtype, a shape and a
// home tier; the runtime owns its storage from then on and hands out a TensorHandle. TensorInfo
// says where the tensor lives now and whether a migration is in flight.
//
// Example:
//   TensorSpec spec{.name = "layer3.mlp.exp_avg", .layer = 3, .role = Role::kOptimizerState,
//                   .dtype = DType::kFloat32, .shape = {4096, 1024}, .home = Tier::kPinnedHost,
//                   .state = "exp_avg"};
//   STRATA_ASSIGN_OR_RETURN(TensorHandle h, runtime.register_tensor(spec, initial_values));
//   TensorInfo info = *runtime.info(h);   // info.tier == Tier::kPinnedHost, !info.in_flight
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "allocator/tier.h"

namespace strata::rt {

using alloc::Tier;

// Note [Roles]
// ~~~~~~~~~~~~
// The runtime knows what training state is made of, not what an optimizer does with it: a
// parameter, its gradient, and the states an optimizer declares for it (optim/optimizer.h: Adam's
// moments, a low-precision parameter's float32 master copy, another optimizer's own), each with the
// name it was declared under in TensorSpec::state. Policies move roles; they never ask which state
// a tensor is. kOther is anything else a client registers (a buffer of its own).
enum class Role : std::uint8_t { kParameter, kGradient, kOptimizerState, kOther };
inline constexpr int kNumRoles = 4;
std::string_view role_name(Role role);
absl::StatusOr<Role> parse_role(std::string_view name);

// A set of roles as a bit mask.
class RoleSet {
 public:
  constexpr RoleSet() = default;
  constexpr RoleSet(std::initializer_list<Role> roles) {
    for (Role r : roles) bits_ |= bit(r);
  }
  static constexpr RoleSet optimizer_states() { return {Role::kOptimizerState}; }
  static constexpr RoleSet all() {
    return {Role::kParameter, Role::kGradient, Role::kOptimizerState, Role::kOther};
  }
  constexpr bool contains(Role r) const { return (bits_ & bit(r)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr bool operator==(const RoleSet&) const = default;
  constexpr RoleSet operator|(Role r) const {
    RoleSet out = *this;
    out.bits_ |= bit(r);
    return out;
  }
  // "parameter,optimizer_state"
  std::string to_string() const;
  // Parses a comma-separated list of role names ("parameter,optimizer_state"), "all" or
  // "optimizer_states".
  static absl::StatusOr<RoleSet> parse(std::string_view text);

 private:
  static constexpr std::uint8_t bit(Role r) {
    return static_cast<std::uint8_t>(1u << static_cast<int>(r));
  }
  std::uint8_t bits_ = 0;
};

enum class DType : std::uint8_t { kFloat32, kFloat16, kBFloat16, kFloat64, kInt64, kInt32, kUInt8 };
std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);

struct TensorSpec {
  std::string name;
  int layer = 0;
  Role role = Role::kOther;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  // Where the tensor lives at rest (the policy may place it elsewhere at registration).
  Tier home = Tier::kGpu;
  // For Role::kOptimizerState: the state's name as its optimizer declared it ("exp_avg"); else
  // empty. See Note [Roles].
  std::string state = {};
};

// numel * dtype size, or kInvalidArgument for a negative dimension or an overflow.
absl::StatusOr<std::size_t> spec_bytes(const TensorSpec& spec);

struct TensorHandle {
  std::uint64_t id = 0;
  constexpr bool valid() const { return id != 0; }
  constexpr bool operator==(const TensorHandle&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const TensorHandle& t) {
    return H::combine(std::move(h), t.id);
  }
};

struct TensorInfo {
  TensorSpec spec;
  std::size_t bytes = 0;
  Tier tier = Tier::kGpu;           // where the authoritative data is now
  void* data = nullptr;             // its address there
  bool in_flight = false;           // a migration is under way
  Tier destination = Tier::kGpu;    // where to, when in flight
  int holds = 0;                    // active acquire() guards
  bool staged = false;              // the data is in a GPU staging slot rather than a pool block
  Tier kept_tier = Tier::kGpu;      // while staged: the tier of the home block it keeps
  bool destination_staged = false;  // in flight into a staging slot
  std::uint64_t version = 0;        // migrations completed so far
};

}  // namespace strata::rt
