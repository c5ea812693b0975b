#include "bridge/torch_runtime.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ops/empty.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "base/status.h"
#include "bridge/binding_state.h"
#include "bridge/status.h"
#include "bridge/torch_undo_memory.h"
#include "c10/core/Storage.h"
#include "c10/core/StorageImpl.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "c10/util/StringUtil.h"

namespace strata::bridge {
namespace {

// The deleter of every DataPtr that points into the runtime's memory: the runtime owns that memory
// and frees it on unregister, so torch must never free it. Its address also marks a storage as
// bound, which is how a second binding's attempt to register the same storage is caught.
void runtime_owned(void* /*ctx*/) {}

c10::DataPtr runtime_data_ptr(void* data, c10::Device device) {
  return c10::DataPtr(data, data, &runtime_owned, device);
}

// Leaves a storage with no data, for good: any later access to it (a torch op, data_ptr()) throws
// `why` instead of dereferencing a stale or null pointer. LibTorch cannot undo this, which is why
// a tensor that is only away for now (See Note [Where a bound tensor's data pointer points]) gets a
// plain null pointer instead.
void detach_for_good(c10::StorageImpl& storage, c10::Device device, std::string why) {
  storage.set_data_ptr_noswap(c10::DataPtr(nullptr, device));
  storage.release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(why));
}

// "[2, 3]". Written with str_cat rather than c10::str: an ostream instantiated in a module built
// with another toolchain than LibTorch's (the Python extension on a GPU machine with GCC 13)
// crashed there, and these messages must not.
std::string dims(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) str_append(&out, i ? ", " : "", sizes[i]);
  return out + "]";
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return str_cat(c10::toString(t.scalar_type()), " ", dims(t.sizes()), " on ", t.device().str());
}

// Waits until torch's queued work on `device` is done: the runtime copies on its own streams, which
// do not wait for torch's.
absl::Status wait_for_torch(c10::Device device) {
  if (!device.is_cuda()) return absl::OkStatus();
  return capture_exceptions([&] {
    const c10::impl::VirtualGuardImpl guard(device.type());
    guard.getStream(device).synchronize();
  });
}

// Everything register_tensor refuses that can be told from the tensor alone.
// `cuda_device`: the runtime's (-1 when its GPU is simulated).
absl::StatusOr<rt::DType> validate(const at::Tensor& t, const std::string& name, int cuda_device) {
  const bool gpu_is_simulated = cuda_device < 0;
  const std::string prefix = str_cat("cannot register '", name, "': ");
  if (!t.defined()) return absl::InvalidArgumentError(str_cat(prefix, "the tensor is undefined"));
  if (t.layout() != c10::kStrided) {
    return absl::InvalidArgumentError(
        str_cat(prefix, "only strided tensors can be registered, not sparse or other layouts"));
  }
  if (!t.unsafeGetTensorImpl()->has_storage()) {
    return absl::InvalidArgumentError(
        str_cat(prefix, "the tensor (", describe(t), ") has no storage"));
  }
  const c10::Device device = t.device();
  if (!device.is_cpu() && !device.is_cuda()) {
    return absl::InvalidArgumentError(
        str_cat(prefix, "strata takes CPU and CUDA tensors, not one on ", device.str()));
  }
  if (device.is_cuda() && gpu_is_simulated) {
    return absl::InvalidArgumentError(
        str_cat(prefix, "a CUDA tensor needs a runtime on a CUDA device; this runtime's GPU is ",
                "simulated"));
  }
  if (device.is_cuda() && device.index() != cuda_device) {
    // See Note [One CUDA device a runtime] in runtime/runtime.h.
    return absl::InvalidArgumentError(str_cat(
        prefix, "the tensor is on ", device.str(), " but this runtime runs on cuda:", cuda_device,
        "; make the runtime with device='", device.str(), "' (with that device current)"));
  }
  absl::StatusOr<rt::DType> dtype = dtype_from_torch(t.scalar_type());
  if (!dtype.ok()) return absl::InvalidArgumentError(str_cat(prefix, dtype.status().message()));
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError(str_cat(prefix, "the tensor is not contiguous (sizes ",
                                              dims(t.sizes()), ", strides ", dims(t.strides()),
                                              "); register a contiguous one, e.g. t.contiguous()"));
  }
  const c10::Storage& storage = t.storage();
  const std::size_t bytes = t.nbytes();
  if (t.storage_offset() != 0 || storage.nbytes() != bytes) {
    return absl::InvalidArgumentError(
        str_cat(prefix, "the tensor is a view of part of its storage (offset ", t.storage_offset(),
                " elements, ", bytes, " of ", storage.nbytes(),
                " bytes); register a tensor that owns its storage, e.g. t.clone()"));
  }
  const c10::DataPtr* data_ptr = nullptr;
  try {
    data_ptr = &storage.data_ptr();
  } catch (const c10::Error& e) {  // a storage whose data is gone for good (see detach_for_good)
    return absl::FailedPreconditionError(str_cat(prefix, e.what_without_backtrace()));
  }
  if (data_ptr->get_deleter() == &runtime_owned) {
    return absl::AlreadyExistsError(
        str_cat(prefix, "its storage already belongs to a strata runtime (another TorchBinding)"));
  }
  if (data_ptr->get() == nullptr && bytes > 0) {
    return absl::FailedPreconditionError(
        str_cat(prefix, "the tensor has no data (was it unregistered?)"));
  }
  return *dtype;
}

}  // namespace

absl::StatusOr<rt::DType> dtype_from_torch(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return rt::DType::kFloat32;
    case c10::ScalarType::Half:
      return rt::DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return rt::DType::kBFloat16;
    case c10::ScalarType::Double:
      return rt::DType::kFloat64;
    case c10::ScalarType::Long:
      return rt::DType::kInt64;
    case c10::ScalarType::Int:
      return rt::DType::kInt32;
    case c10::ScalarType::Byte:
      return rt::DType::kUInt8;
    default:
      return absl::InvalidArgumentError(
          str_cat("unsupported dtype ", c10::toString(type),
                  "; strata takes float32, float16, bfloat16, float64, int64, int32 and uint8"));
  }
}

c10::ScalarType dtype_to_torch(rt::DType dtype) {
  switch (dtype) {
    case rt::DType::kFloat32:
      return c10::ScalarType::Float;
    case rt::DType::kFloat16:
      return c10::ScalarType::Half;
    case rt::DType::kBFloat16:
      return c10::ScalarType::BFloat16;
    case rt::DType::kFloat64:
      return c10::ScalarType::Double;
    case rt::DType::kInt64:
      return c10::ScalarType::Long;
    case rt::DType::kInt32:
      return c10::ScalarType::Int;
    case rt::DType::kUInt8:
      return c10::ScalarType::Byte;
  }
  check_failed(__FILE__, __LINE__, "known DType",
               str_cat("no torch dtype for DType ", static_cast<int>(dtype)));
}

namespace internal {

const c10::StorageImpl* storage_key(const at::Tensor& t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return nullptr;
  return t.storage().unsafeGetStorageImpl();
}

// Every parameter of m with its default layer (see register_module), in named_parameters() order
// within each layer; aliases are kept (they carry the names).
std::vector<std::pair<std::string, std::pair<torch::Tensor, int>>> default_layers(
    const torch::nn::Module& m) {
  std::vector<std::pair<std::string, std::pair<torch::Tensor, int>>> out;
  int layer = 0;
  for (const auto& child : m.named_children()) {
    for (const auto& p : child.value()->named_parameters(/*recurse=*/true)) {
      out.push_back({str_cat(child.key(), ".", p.key()), {p.value(), layer}});
    }
    ++layer;
  }
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    out.push_back({p.key(), {p.value(), layer}});
  }
  return out;
}

}  // namespace internal

using internal::default_layers;
using internal::storage_key;

bool is_addressable(c10::Device device, rt::Tier tier, bool gpu_is_simulated) {
  if (device.is_cuda()) return tier != rt::Tier::kPageableHost;
  return tier != rt::Tier::kGpu || gpu_is_simulated;
}

rt::StreamHandle current_stream(c10::Device device) {
  if (!device.is_cuda()) return nullptr;
  const c10::impl::VirtualGuardImpl guard(device.type());
  return guard.getStream(device).native_handle();
}

void TorchBinding::State::point_at(Bound& b, rt::Tier tier, void* data, bool gpu_is_simulated) {
  b.accessible = is_addressable(b.device, tier, gpu_is_simulated);
  b.storage.unsafeGetStorageImpl()->set_data_ptr_noswap(
      runtime_data_ptr(b.accessible ? data : nullptr, b.device));
}

TorchBinding::TorchBinding(rt::Runtime& runtime)
    : runtime_(runtime),
      gpu_is_simulated_(runtime.device().is_simulated()),
      state_(std::make_unique<State>()) {
  // Torch computes on its current stream; the runtime's hooks fence copies behind it
  // (See Note [Compute fence] in runtime/migration.cpp), on the runtime's device (See Note [One
  // CUDA device a runtime] in runtime/runtime.h).
  if (!gpu_is_simulated_) {
    const c10::Device cuda(c10::kCUDA, static_cast<c10::DeviceIndex>(runtime_.cuda_device()));
    const c10::impl::VirtualGuardImpl guard(cuda.type());
    // Copies kept for an undo take the blocks backward frees (See Note [The undo in the
    // framework's memory] in runtime/undo_log.cpp). Refused while a step is under way or an undo
    // is kept: they then stay in strata's pool, as before.
    (void)runtime_.set_undo_memory(
        std::make_shared<TorchUndoMemory>(runtime_.device(), guard.getStream(cuda)));
    runtime_.set_compute_stream(current_stream(cuda));
  }
  callback_id_ = runtime_.add_on_moved(
      [this](rt::TensorHandle h, rt::Tier tier, void* data) { on_moved(h, tier, data); });
  before_step_id_ = runtime_.add_before_optimizer_step([this] { return check_gradients(); });
}

TorchBinding::~TorchBinding() {
  runtime_.remove_on_moved(callback_id_);
  runtime_.remove_before_optimizer_step(before_step_id_);
  const std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [handle, b] : state_->bound) {
    detach_for_good(*b.storage.unsafeGetStorageImpl(), b.device,
                    str_cat("strata: the TorchBinding that bound tensor '", b.name,
                            "' is gone; its data stays with the runtime"));
  }
}

void TorchBinding::on_moved(rt::TensorHandle h, rt::Tier tier, void* data) noexcept {
  const std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->bound.find(h);
  if (it == state_->bound.end()) return;  // registered with the runtime directly, not through us
  ++it->second.moves;
  state_->point_at(it->second, tier, data, gpu_is_simulated_);
}

absl::StatusOr<rt::TensorHandle> TorchBinding::register_one(const torch::Tensor& t,
                                                            const std::string& name, int layer,
                                                            rt::Role role,
                                                            std::optional<rt::Tier> home) {
  if (const c10::StorageImpl* key = storage_key(t); key != nullptr) {
    const std::lock_guard<std::mutex> lock(state_->mu);
    if (auto it = state_->by_storage.find(key); it != state_->by_storage.end()) {
      return absl::AlreadyExistsError(str_cat("cannot register '", name,
                                              "': its storage is already registered as '",
                                              state_->bound.at(it->second).name, "'"));
    }
  }
  STRATA_ASSIGN_OR_RETURN(const rt::DType dtype, validate(t, name, runtime_.cuda_device()));
  const c10::Device device = t.device();
  STRATA_RETURN_IF_ERROR(wait_for_torch(device));

  rt::TensorSpec spec{
      .name = name,
      .layer = layer,
      .role = role,
      .dtype = dtype,
      .shape = t.sizes().vec(),
      .home = home.value_or(device.is_cuda() ? rt::Tier::kGpu : rt::Tier::kPinnedHost)};
  c10::Storage storage = t.storage();
  // The runtime has copied the values when this returns, so the original memory may be freed.
  STRATA_ASSIGN_OR_RETURN(const rt::TensorHandle h, runtime_.register_tensor(spec, storage.data()));
  bool taken = false;
  {
    const std::lock_guard<std::mutex> lock(state_->mu);
    taken = !state_->by_storage.try_emplace(storage.unsafeGetStorageImpl(), h).second;
    if (!taken) {
      state_->bound.emplace(h, State::Bound{.storage = storage,
                                            .device = device,
                                            .name = name,
                                            .layer = layer,
                                            .was_resizable = storage.resizable()});
    }
  }
  if (taken) {  // another thread registered the same storage since the check above
    runtime_.unregister(h).IgnoreError();
    return absl::AlreadyExistsError(
        str_cat("cannot register '", name, "': its storage was registered meanwhile"));
  }
  // From here on a reported move rebinds the storage (counted in `moves`). info() read after the
  // entry exists is no older than any move reported before, and a move reported after wins, so
  // the tensor ends at the latest address whatever the interleaving.
  absl::StatusOr<rt::TensorInfo> info = runtime_.info(h);
  if (info.ok()) {
    const std::lock_guard<std::mutex> lock(state_->mu);
    State::Bound& b = state_->bound.at(h);
    if (b.moves == 0) state_->point_at(b, info->tier, info->data, gpu_is_simulated_);
    // A resize would allocate new memory through torch's allocator and leave the runtime's copy.
    storage.unsafeGetStorageImpl()->set_resizable(false);
    return h;
  }
  {
    // The tensor still holds its own memory unless a move was reported; then it holds the
    // runtime's, and unregistering would free it under the tensor.
    const std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->bound.at(h).moves > 0) return info.status();
    state_->by_storage.erase(storage.unsafeGetStorageImpl());
    state_->bound.erase(h);
  }
  runtime_.unregister(h).IgnoreError();
  return info.status();
}

rt::TensorHandle TorchBinding::register_tensor(torch::Tensor& t, const std::string& name, int layer,
                                               rt::Role role, std::optional<rt::Tier> home) {
  return unwrap(register_one(t, name, layer, role, home));
}

std::vector<rt::TensorHandle> TorchBinding::register_all(const std::vector<Planned>& plan) {
  // Refuse bad tensors before anything is registered; what is left to fail is the runtime.
  for (const Planned& p : plan) {
    {
      const std::lock_guard<std::mutex> lock(state_->mu);
      if (auto it = state_->by_storage.find(storage_key(p.tensor));
          it != state_->by_storage.end()) {
        check(absl::AlreadyExistsError(
            str_cat("cannot register '", p.name, "': its storage is already registered as '",
                    state_->bound.at(it->second).name, "' with this TorchBinding")));
      }
    }
    check(validate(p.tensor, p.name, runtime_.cuda_device()).status());
  }
  std::vector<rt::TensorHandle> done;
  done.reserve(plan.size());
  try {
    for (const Planned& p : plan) {
      done.push_back(unwrap(register_one(p.tensor, p.name, p.layer, p.role, p.home)));
    }
  } catch (...) {
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      unregister_handle(*it, /*keep_values=*/true).IgnoreError();
    }
    throw;
  }
  return done;
}

namespace {

std::string list_names(const std::vector<std::string>& names) {
  constexpr std::size_t kMaxListed = 16;
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kMaxListed; ++i) {
    str_append(&out, i > 0 ? ", " : "", names[i]);
  }
  if (names.size() > kMaxListed) str_append(&out, ", ... (", names.size(), " in all)");
  return out;
}

}  // namespace

std::vector<rt::TensorHandle> TorchBinding::register_module(
    torch::nn::Module& m, std::optional<std::vector<std::vector<std::string>>> grouping,
    std::optional<rt::Tier> home) {
  std::vector<Planned> plan;
  if (!grouping.has_value()) {
    for (auto& [name, tensor_layer] : default_layers(m)) {
      plan.push_back({tensor_layer.first, name, tensor_layer.second, rt::Role::kParameter, home});
    }
  } else {
    const auto params = m.named_parameters(/*recurse=*/true);
    absl::flat_hash_map<std::string, int> group_of;
    for (std::size_t i = 0; i < grouping->size(); ++i) {
      const int layer = static_cast<int>(i);
      for (const std::string& name : (*grouping)[i]) {
        const torch::Tensor* p = params.find(name);
        if (p == nullptr) {
          check(absl::InvalidArgumentError(
              str_cat("register_module: no parameter named '", name, "' (group ", layer,
                      "); the module's parameters are ", list_names(params.keys()))));
        }
        if (auto [it, inserted] = group_of.try_emplace(name, layer); !inserted) {
          check(absl::InvalidArgumentError(str_cat("register_module: parameter '", name,
                                                   "' is in group ", it->second, " and in group ",
                                                   layer)));
        }
        plan.push_back({*p, name, layer, rt::Role::kParameter, home});
      }
    }
  }
  // Tied weights: the first name registers the storage, later aliases share it.
  absl::flat_hash_set<const c10::StorageImpl*> seen;
  std::erase_if(plan, [&](const Planned& p) {
    const c10::StorageImpl* key = storage_key(p.tensor);
    return key != nullptr && !seen.insert(key).second;
  });
  return register_all(plan);
}

absl::Status TorchBinding::unregister_handle(rt::TensorHandle h, bool keep_values) {
  c10::Storage storage;
  c10::Device device = c10::kCPU;
  std::string name;
  bool was_resizable = false;
  {
    const std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->bound.find(h);
    if (it == state_->bound.end()) {
      return absl::NotFoundError(str_cat("tensor handle ", h.id, " is not bound"));
    }
    storage = it->second.storage;
    device = it->second.device;
    name = it->second.name;
    was_resizable = it->second.was_resizable;
  }
  // Torch's queued work may still read or write the runtime's copy.
  STRATA_RETURN_IF_ERROR(wait_for_torch(device));
  // Values in torch memory on the tensor's device; read() copies from wherever the data is.
  at::Tensor values;
  if (keep_values) {
    const auto bytes = static_cast<std::int64_t>(storage.nbytes());
    STRATA_RETURN_IF_ERROR(capture_exceptions([&] { values = at::empty({bytes}, at::kByte); }));
    if (bytes > 0) STRATA_RETURN_IF_ERROR(runtime_.read(h, values.data_ptr()));
    if (device.is_cuda()) {
      STRATA_RETURN_IF_ERROR(capture_exceptions([&] { values = values.to(device); }));
    }
  }
  STRATA_RETURN_IF_ERROR(runtime_.unregister(h));

  const std::lock_guard<std::mutex> lock(state_->mu);
  forget_gradient(storage.unsafeGetStorageImpl());
  state_->by_storage.erase(storage.unsafeGetStorageImpl());
  state_->bound.erase(h);
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (keep_values) {
    impl->set_data_ptr_noswap(
        values.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, device)));
    if (was_resizable) impl->set_resizable(true);
  } else {
    detach_for_good(*impl, device,
                    str_cat("strata: tensor '", name,
                            "' was unregistered and its data freed (unregister_keeping_values "
                            "keeps the values)"));
  }
  return absl::OkStatus();
}

absl::Status TorchBinding::unregister_one(const torch::Tensor& t, bool keep_values) {
  rt::TensorHandle h;
  {
    const std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->by_storage.find(storage_key(t));
    if (it == state_->by_storage.end()) {
      return absl::NotFoundError(
          str_cat("cannot unregister ", describe(t), ": not registered with this TorchBinding"));
    }
    h = it->second;
  }
  return unregister_handle(h, keep_values);
}

void TorchBinding::unregister(torch::Tensor& t) { check(unregister_one(t, false)); }

void TorchBinding::unregister_keeping_values(torch::Tensor& t) { check(unregister_one(t, true)); }

rt::TensorHandle TorchBinding::handle(const torch::Tensor& t) const {
  {
    const std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->by_storage.find(storage_key(t));
    if (it != state_->by_storage.end()) return it->second;
  }
  check(absl::NotFoundError(
      str_cat("no handle for ", describe(t), ": not registered with this TorchBinding")));
  return {};
}

std::optional<rt::TensorHandle> TorchBinding::find(const torch::Tensor& t) const {
  if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return std::nullopt;
  const std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->by_storage.find(storage_key(t));
  if (it == state_->by_storage.end()) return std::nullopt;
  return it->second;
}

bool TorchBinding::is_accessible(const torch::Tensor& t) const {
  const std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->by_storage.find(storage_key(t));
  return it != state_->by_storage.end() && state_->bound.at(it->second).accessible;
}

void TorchBinding::check_accessible(const torch::Tensor& t) const {
  rt::TensorHandle h;
  std::string name;
  c10::Device device = c10::kCPU;
  {
    const std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->by_storage.find(storage_key(t));
    if (it == state_->by_storage.end()) return;
    const State::Bound& b = state_->bound.at(it->second);
    if (b.accessible) return;
    h = it->second;
    name = b.name;
    device = b.device;
  }
  const absl::StatusOr<rt::TensorInfo> info = runtime_.info(h);
  const std::string where =
      info.ok() ? std::string(alloc::tier_name(info->tier)) : std::string("another tier");
  check(absl::FailedPreconditionError(str_cat(
      "strata: '", name, "' (", describe(t), ") is away in ", where, " memory, which a ",
      device.str(),
      " tensor cannot address; torch cannot use it until the runtime brings it back "
      "(reload_all() after offload_all(), or room in the pinned tier for what is offloaded)")));
}

std::size_t TorchBinding::size() const {
  const std::lock_guard<std::mutex> lock(state_->mu);
  return state_->bound.size();
}

}  // namespace strata::bridge
