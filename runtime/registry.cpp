// runtime/registry.cpp: the registry room (registry.h) and the public registry calls of Runtime:
// registering and unregistering tensors, what the runtime knows about them, and reading and
// writing their bytes on the host.
#include "runtime/registry.h"

#include <algorithm>
#include <cstdio>

#include "base/status.h"
#include "base/strings.h"
#include "runtime/runtime_impl.h"

namespace strata::rt {
namespace internal {

Entry& Registry::add(const TensorSpec& spec, std::size_t bytes, Location loc) {
  auto entry = std::make_unique<Entry>();
  entry->handle = {next_id_++};
  entry->spec = spec;
  entry->bytes = bytes;
  entry->loc = loc;
  Entry& e = *entry;
  by_id_[e.handle.id] = &e;
  by_name_[spec.name] = &e;
  by_layer_[spec.layer].push_back(&e);
  entries_.push_back(std::move(entry));
  return e;
}

void Registry::remove(Entry& e) {
  by_id_.erase(e.handle.id);
  by_name_.erase(e.spec.name);
  auto layer = by_layer_.find(e.spec.layer);
  std::erase(layer->second, &e);
  if (layer->second.empty()) by_layer_.erase(layer);
  ++unregistrations_;
  std::erase_if(entries_, [&](const std::unique_ptr<Entry>& p) { return p.get() == &e; });
}

Entry* Registry::find(TensorHandle h) const {
  auto it = by_id_.find(h.id);
  return it == by_id_.end() ? nullptr : it->second;
}

absl::StatusOr<Entry*> Registry::get(TensorHandle h) const {
  Entry* e = find(h);
  if (e == nullptr) {
    return absl::NotFoundError(str_cat("tensor handle ", h.id, " is not registered"));
  }
  return e;
}

Entry* Registry::find_name(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<Entry*> Registry::layer_entries(int layer, RoleSet roles) const {
  std::vector<Entry*> out;
  auto it = by_layer_.find(layer);
  if (it == by_layer_.end()) return out;
  for (Entry* e : it->second) {
    if (roles.contains(e->spec.role)) out.push_back(e);
  }
  return out;
}

std::vector<int> Registry::layers() const {
  std::vector<int> out;
  out.reserve(by_layer_.size());
  for (const auto& [layer, members] : by_layer_) out.push_back(layer);
  return out;
}

std::string Registry::describe_layers() const {
  if (by_layer_.empty()) return "none (nothing is registered)";
  const int first = by_layer_.begin()->first;
  const int last = by_layer_.rbegin()->first;
  if (static_cast<std::size_t>(last - first + 1) == by_layer_.size()) {
    return first == last ? str_cat(first) : str_cat(first, "..", last);
  }
  std::string out;
  for (const auto& [layer, members] : by_layer_) str_append(&out, out.empty() ? "" : ", ", layer);
  return out;
}

}  // namespace internal

using internal::Entry;

absl::StatusOr<TensorHandle> Runtime::register_tensor(const TensorSpec& spec, const void* data) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& im = *impl_;
  if (spec.name.empty()) return absl::InvalidArgumentError("register_tensor: empty name");
  if (spec.layer < 0) {
    return absl::InvalidArgumentError(
        str_cat("register_tensor '", spec.name, "': layer ", spec.layer, " is negative"));
  }
  if (im.registry.find_name(spec.name) != nullptr) {
    return absl::AlreadyExistsError(
        str_cat("register_tensor: a tensor named '", spec.name, "' is registered already"));
  }
  STRATA_ASSIGN_OR_RETURN(std::size_t bytes, spec_bytes(spec));
  Tier tier = im.policy->placement(spec);
  void* ptr = nullptr;
  if (bytes > 0) {
    absl::StatusOr<void*> block = im.allocator->allocate(tier, bytes, {.owner = spec.name});
    if (block.status().code() == absl::StatusCode::kResourceExhausted &&
        tier == Tier::kPinnedHost) {
      // Pinned memory is the host tier policies prefer; when it has no room the tensor rests in
      // pageable memory, as bulk's moves to the host do, rather than not at all.
      absl::StatusOr<void*> pageable =
          im.allocator->allocate(Tier::kPageableHost, bytes, {.owner = spec.name});
      if (pageable.ok()) {
        tier = Tier::kPageableHost;
        block = pageable;
      } else {
        block = absl::Status(
            pageable.status().code(),
            str_cat(block.status().message(),
                    "; pageable memory, where it would go instead: ", pageable.status().message()));
      }
    }
    if (!block.ok()) {
      return absl::Status(block.status().code(),
                          str_cat("register_tensor '", spec.name, "': ", block.status().message()));
    }
    ptr = *block;
    absl::Status filled;
    if (data != nullptr) {
      filled = im.engine.host_copy(ptr, data, bytes);
    } else {
      std::vector<std::byte> zeros(std::min(bytes, kBounceChunkBytes));
      for (std::size_t off = 0; off < bytes && filled.ok(); off += zeros.size()) {
        filled = im.engine.host_copy(static_cast<std::byte*>(ptr) + off, zeros.data(),
                                     std::min(zeros.size(), bytes - off));
      }
    }
    if (!filled.ok()) {
      // The copy may still be writing the block: it is reused only once the copy stream is past.
      im.engine.free_after(tier, ptr, {im.engine.d2h()});
      return absl::Status(filled.code(), str_cat("register_tensor '", spec.name,
                                                 "': filling its memory failed (nothing is "
                                                 "registered): ",
                                                 filled.message()));
    }
  }
  Entry& e = im.registry.add(spec, bytes, {tier, ptr, -1});
  PolicyContext ctx(*this);
  if (absl::Status s = im.policy->on_register(ctx, e.handle); !s.ok()) {
    im.erase_refused(e);
    return s;
  }
  return e.handle;
}

// Undoes a registration the policy refused, whatever the policy did with the tensor meanwhile: it
// was registered only inside this call, so nothing outside it holds or uses the tensor, and the
// holds the policy may have taken queued no work (only waits).
void Runtime::Impl::erase_refused(Entry& e) {
  if (e.in_flight) {
    // A move the policy queued: its destination is written by a copy that may still run.
    engine.device().release(e.arrival);
    if (e.dst.slot < 0 && e.dst.ptr != nullptr) {
      engine.free_after(e.dst.tier, e.dst.ptr, {e.copy_stream});
    }
    std::erase(engine.in_flight(), &e);
    e.in_flight = false;
  }
  for (const Entry::Ready& r : e.ready) engine.device().release(r.event);
  e.ready.clear();
  staging.forget(e);
  if (e.bytes > 0) {
    for (const internal::Location& loc : {e.loc, e.rest}) {
      if (loc.ptr != nullptr && loc.slot < 0) {
        engine.free_after(loc.tier, loc.ptr, {engine.h2d(), engine.d2h()});
      }
    }
  }
  registry.remove(e);
}

absl::Status Runtime::unregister(TensorHandle tensor) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->unregister_locked(tensor);
}

absl::Status Runtime::Impl::unregister_locked(TensorHandle tensor) {
  STRATA_ASSIGN_OR_RETURN(Entry * e, registry.get(tensor));
  if (e->holds > 0) {
    return absl::FailedPreconditionError(str_cat("unregister '", e->spec.name, "': held by ",
                                                 e->holds, " acquire(s); release it first"));
  }
  if (e->undo_kept)
    STRATA_RETURN_IF_ERROR(undo.check_empty(str_cat("unregister '", e->spec.name, "'")));
  STRATA_RETURN_IF_ERROR(engine.wait_entry(*e));
  STRATA_RETURN_IF_ERROR(engine.wait_ready_on_host(*e));
  staging.forget(*e);
  if (e->bytes > 0) {
    engine.free_location(*e, e->loc);
    if (e->rest.ptr != nullptr) engine.free_location(*e, e->rest);  // staged: its home too
  }
  registry.remove(*e);
  // With nothing registered the runtime holds no memory of its own either, so a leak report taken
  // now is empty. The tensor is gone either way: if a wait fails, what is left of the scratch
  // memory goes the next time the registry empties, or with the runtime.
  if (registry.empty()) {
    if (absl::Status s = release_scratch(); !s.ok()) {
      std::fprintf(stderr, "strata: keeping the staging ring and bounce buffers for now: %s\n",
                   std::string(s.message()).c_str());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorInfo> Runtime::info(TensorHandle tensor) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->info_locked(tensor);
}

absl::StatusOr<TensorInfo> Runtime::Impl::info_locked(TensorHandle tensor) const {
  STRATA_ASSIGN_OR_RETURN(Entry * e, registry.get(tensor));
  TensorInfo out;
  out.spec = e->spec;
  out.bytes = e->bytes;
  out.tier = e->loc.tier;
  out.data = e->loc.ptr;
  out.in_flight = e->in_flight;
  out.destination = e->in_flight ? e->dst.tier : e->loc.tier;
  out.holds = e->holds;
  out.staged = e->loc.slot >= 0;
  out.kept_tier = out.staged ? e->rest.tier : e->loc.tier;
  out.destination_staged = e->in_flight && e->dst.slot >= 0;
  out.version = e->version;
  return out;
}

std::uint64_t Runtime::unregistrations() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->registry.unregistrations();
}

bool Runtime::is_registered(TensorHandle tensor) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->registry.find(tensor) != nullptr;
}

absl::StatusOr<TensorHandle> Runtime::find(std::string_view name) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Entry* e = impl_->registry.find_name(name);
  if (e == nullptr)
    return absl::NotFoundError(str_cat("no tensor named '", name, "' is registered"));
  return e->handle;
}

std::vector<TensorHandle> Runtime::tensors() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->tensors_locked();
}

std::vector<TensorHandle> Runtime::Impl::tensors_locked() const {
  std::vector<TensorHandle> out;
  out.reserve(registry.entries().size());
  for (const auto& e : registry.entries()) out.push_back(e->handle);
  return out;
}

std::vector<TensorHandle> Runtime::layer_tensors(int layer, RoleSet roles) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->layer_tensors_locked(layer, roles);
}

std::vector<TensorHandle> Runtime::Impl::layer_tensors_locked(int layer, RoleSet roles) const {
  std::vector<TensorHandle> out;
  for (const Entry* e : registry.layer_entries(layer, roles)) out.push_back(e->handle);
  return out;
}

std::vector<int> Runtime::layers() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->registry.layers();
}

std::size_t Runtime::layer_bytes(int layer, RoleSet roles) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->layer_bytes_locked(layer, roles);
}

std::size_t Runtime::Impl::layer_bytes_locked(int layer, RoleSet roles) const {
  std::size_t total = 0;
  for (const Entry* e : registry.layer_entries(layer, roles)) total += e->bytes;
  return total;
}

absl::Status Runtime::read(TensorHandle tensor, void* host_dst) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  STRATA_ASSIGN_OR_RETURN(Entry * e, impl_->registry.get(tensor));
  if (host_dst == nullptr && e->bytes > 0) {
    return absl::InvalidArgumentError(
        str_cat("read '", e->spec.name, "': the destination is null"));
  }
  STRATA_RETURN_IF_ERROR(impl_->engine.wait_entry(*e));
  STRATA_RETURN_IF_ERROR(impl_->engine.wait_ready_on_host(*e));
  if (e->bytes == 0) return absl::OkStatus();
  return impl_->engine.host_copy(host_dst, e->loc.ptr, e->bytes);
}

absl::Status Runtime::write(TensorHandle tensor, const void* host_src) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  STRATA_ASSIGN_OR_RETURN(Entry * e, impl_->registry.get(tensor));
  if (host_src == nullptr && e->bytes > 0) {
    return absl::InvalidArgumentError(str_cat("write '", e->spec.name, "': the source is null"));
  }
  if (e->holds > 0) {
    return absl::FailedPreconditionError(
        str_cat("write '", e->spec.name, "': held by ", e->holds, " acquire(s)"));
  }
  STRATA_RETURN_IF_ERROR(impl_->engine.wait_entry(*e));
  STRATA_RETURN_IF_ERROR(impl_->engine.wait_ready_on_host(*e));
  if (e->bytes == 0) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(impl_->engine.host_copy(e->loc.ptr, host_src, e->bytes));
  // A staged tensor's home block must agree, or discarding the staged copy would lose the write.
  if (e->rest.ptr != nullptr) return impl_->engine.host_copy(e->rest.ptr, host_src, e->bytes);
  return absl::OkStatus();
}

}  // namespace strata::rt
