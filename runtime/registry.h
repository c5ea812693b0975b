// runtime/registry.h (internal to runtime/): the registry room. It owns every Entry, hands out
// handles, and finds entries by handle, by name and by layer, in registration order.
//
// It holds bookkeeping only: no memory, no device work. The runtime calls it with its mutex held;
// the public registry calls (register_tensor, unregister, info, find, ...) are in registry.cpp.
//
// Example (inside the runtime, lock held):
//   Entry& e = registry.add(spec, bytes, {Tier::kPinnedHost, ptr});
//   for (Entry* s : registry.layer_entries(3, RoleSet::optimizer_states())) ...;
//   registry.remove(e);
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "runtime/entry.h"

namespace strata::rt::internal {

class Registry {
 public:
  // A new entry at `loc`, with the next handle. The name must be free (checked by the caller).
  Entry& add(const TensorSpec& spec, std::size_t bytes, Location loc);
  // Forgets the entry (its memory is the caller's to free first).
  void remove(Entry& e);

  Entry* find(TensorHandle h) const;
  // kNotFound naming the handle.
  absl::StatusOr<Entry*> get(TensorHandle h) const;
  Entry* find_name(std::string_view name) const;
  // The layer's entries with a role in `roles`, in registration order.
  std::vector<Entry*> layer_entries(int layer, RoleSet roles) const;
  bool has_layer(int layer) const { return by_layer_.count(layer) > 0; }
  // Distinct layers, ascending.
  std::vector<int> layers() const;
  // "0..3" or "0, 2, 5": for messages about a layer that does not exist.
  std::string describe_layers() const;

  const std::vector<std::unique_ptr<Entry>>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  std::uint64_t unregistrations() const { return unregistrations_; }

 private:
  std::uint64_t next_id_ = 1;
  std::uint64_t unregistrations_ = 0;
  std::vector<std::unique_ptr<Entry>> entries_;  // registration order
  absl::flat_hash_map<std::uint64_t, Entry*> by_id_;
  std::map<std::string, Entry*, std::less<>> by_name_;
  std::map<int, std::vector<Entry*>> by_layer_;  // registration order within a layer
};

}  // namespace strata::rt::internal
