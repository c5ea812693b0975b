// allocator/cuda_device_upstream.cpp: GPU memory for the GPU tier's pool, by CUDA virtual memory
// management or by cudaMalloc (See Note [Device memory method]), each segment an NVTX heap so that
// memory checkers see the pool's blocks. Built with the CUDA runtime when STRATA_HAS_CUDA is
// defined; otherwise the factory reports kUnavailable, so the library links without a CUDA toolkit.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Upstream> gpu,
//                           make_cuda_device_upstream(0, DeviceMethod::kAuto));
#include <cstdlib>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "allocator/cuda_status.h"
#include "allocator/upstream.h"
#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"

#ifdef STRATA_HAS_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExtMem.h>

#include "absl/container/flat_hash_map.h"
#endif

namespace strata::alloc {

#ifdef STRATA_HAS_CUDA
namespace {

// Each segment is an NVTX sub-allocator heap, so memcheck treats it as inaccessible except for the
// regions registered as live blocks (See Note [Pool visibility for memory checkers] in upstream.h).
// NVTX calls are no-ops unless a tool is attached.
nvtxDomainHandle_t nvtx_domain() {
  static nvtxDomainHandle_t domain = nvtxDomainCreateA("strata");
  return domain;
}

void nvtx_register_heap(void* base, std::size_t bytes) {
  nvtxMemVirtualRangeDesc_t range{};
  range.size = bytes;
  range.ptr = base;
  nvtxMemHeapDesc_t heap{};
  heap.extCompatID = NVTX_EXT_COMPATID_MEM;
  heap.structSize = sizeof(heap);
  heap.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
  heap.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  heap.typeSpecificDescSize = sizeof(range);
  heap.typeSpecificDesc = &range;
  nvtxMemHeapRegister(nvtx_domain(), &heap);
}

class CudaDeviceUpstream : public Upstream {
 public:
  explicit CudaDeviceUpstream(int device) : device_(device) {}
  std::string_view name() const override { return "cuda_device"; }
  bool is_device_memory() const override { return true; }

  void on_block_live(const void* segment, const void* ptr, std::size_t bytes) override {
    nvtxMemVirtualRangeDesc_t range{};
    range.size = bytes;
    range.ptr = ptr;
    nvtxMemRegionsRegisterBatch_t batch{};
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof(batch);
    batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    // A virtual-address heap's handle is its base address.
    batch.heap = reinterpret_cast<nvtxMemHeapHandle_t>(const_cast<void*>(segment));
    batch.regionCount = 1;
    batch.regionDescElementSize = sizeof(range);
    batch.regionDescElements = &range;
    nvtxMemRegionsRegister(nvtx_domain(), &batch);
  }

  void on_block_dead(const void* /*segment*/, const void* ptr) override {
    nvtxMemRegionRef_t ref{};
    ref.pointer = ptr;
    nvtxMemRegionsUnregisterBatch_t batch{};
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof(batch);
    batch.refType = NVTX_MEM_REGION_REF_TYPE_POINTER;
    batch.refCount = 1;
    batch.refElementSize = sizeof(ref);
    batch.refElements = &ref;
    nvtxMemRegionsUnregister(nvtx_domain(), &batch);
  }

  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory is not sticky; clear it for the next call
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(
          str_cat("cudaMalloc of ", format_bytes(bytes), " on device ", device_, " failed (",
                  cuda_error_text(err), "); device free ", format_bytes(free_bytes), " of ",
                  format_bytes(total_bytes)));
    }
    nvtx_register_heap(p, bytes);
    return p;
  }

  absl::Status deallocate(void* ptr, std::size_t /*bytes*/) override {
    DeviceGuard guard(device_);
    nvtxMemHeapUnregister(nvtx_domain(), reinterpret_cast<nvtxMemHeapHandle_t>(ptr));
    const cudaError_t err = cudaFree(ptr);
    // See Note [Stream ordering], rule 5: at exit the runtime may already be unloading.
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      return absl::InternalError(str_cat("cudaFree(", ptr, ") failed: ", cuda_error_text(err)));
    }
    return absl::OkStatus();
  }

 protected:
  int device() const { return device_; }

 private:
  const int device_;
};

// Note [Device memory method]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cudaFree waits until the whole device is idle, copies of other memory included, while cuMemUnmap
// and cuMemRelease of CUDA's virtual memory management do not: a cudaFree beside a streaming copy
// waits for the whole copy, an unmap does not and the copy keeps its speed
// (tools/gpu/probes/free_overlap.cu; the figures are in bench/results). A phase switch
// (runtime/phase.cpp) frees each segment as soon as its copies have landed; on virtual memory those
// frees overlap the copies still streaming. Each segment is an address range of its own with one
// physical allocation mapped into it, so the pool above sees the same segments as with cudaMalloc.
// The driver's entry points are looked up through the runtime, so strata links no libcuda and loads
// on machines without a driver.
struct VmmApi {
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 attribute = nullptr;
  absl::Status loaded;

  // Never destroyed: a segment may go back during static destruction.
  static const VmmApi& get() {
    static const VmmApi* api = new VmmApi(load());
    return *api;
  }

 private:
  template <typename Fn>
  static absl::Status entry(const char* symbol, Fn* fn) {
    return cuda_driver_entry(symbol, 12000, fn);
  }
  static VmmApi load() {
    VmmApi a;
    for (absl::Status s :
         {entry("cuMemGetAllocationGranularity", &a.granularity),
          entry("cuMemAddressReserve", &a.reserve), entry("cuMemAddressFree", &a.address_free),
          entry("cuMemCreate", &a.create), entry("cuMemRelease", &a.release),
          entry("cuMemMap", &a.map), entry("cuMemUnmap", &a.unmap),
          entry("cuMemSetAccess", &a.set_access), entry("cuGetErrorName", &a.error_name),
          entry("cuDeviceGet", &a.device_get), entry("cuDeviceGetAttribute", &a.attribute)}) {
      a.loaded.Update(s);
    }
    return a;
  }
};

// Device memory of `device`, pinned (not migratable): what every virtual-memory segment is made of.
CUmemAllocationProp vmm_properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

bool device_supports_vmm(int device) {
  const VmmApi& api = VmmApi::get();
  if (!api.loaded.ok()) return false;
  DeviceGuard guard(device);
  (void)cudaFree(nullptr);  // the runtime makes the device's primary context current
  CUdevice dev = 0;
  int supported = 0;
  return api.device_get(&dev, device) == CUDA_SUCCESS &&
         api.attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
             CUDA_SUCCESS &&
         supported != 0;
}

class CudaVmmDeviceUpstream final : public CudaDeviceUpstream {
 public:
  CudaVmmDeviceUpstream(int device, std::size_t granularity)
      : CudaDeviceUpstream(device), granularity_(granularity) {}
  std::string_view name() const override { return "cuda_device(virtual memory)"; }
  // compute-sanitizer refuses NVTX heaps on mapped address ranges ("one or more of the parameters
  // is invalid", one warning per call, each counted as an error), so these segments are not
  // registered: a checker sees each whole segment, not its blocks
  // (See Note [Pool visibility for memory checkers] in upstream.h). STRATA_GPU_MEMORY=cudamalloc
  // gives block bounds back.
  void on_block_live(const void*, const void*, std::size_t) override {}
  void on_block_dead(const void*, const void*) override {}

  // A fixed segment is a range of its own with one mapping filling it.
  absl::StatusOr<void*> allocate(std::size_t bytes) override {
    const std::size_t size = (bytes + granularity_ - 1) / granularity_ * granularity_;
    STRATA_ASSIGN_OR_RETURN(const Range range, reserve_range(size, size));
    if (absl::Status mapped = map_range(range.base, size); !mapped.ok()) {
      (void)release_range(range.base, size);
      return mapped;
    }
    return range.base;
  }

  absl::Status deallocate(void* ptr, std::size_t bytes) override {
    const std::size_t size = (bytes + granularity_ - 1) / granularity_ * granularity_;
    // Still mapped and usable when this fails: the pool keeps the segment, so it stays ours.
    STRATA_RETURN_IF_ERROR(unmap_range(ptr, size));
    // Unmapped, the range is unusable whatever follows: a failure to free the address space is
    // reported, not returned, so the pool does not keep a segment that is gone.
    if (absl::Status s = release_range(ptr, size); !s.ok()) {
      std::fprintf(stderr, "strata: %s\n", std::string(s.message()).c_str());
    }
    return absl::OkStatus();
  }

  // A range is reserved address space; each map_range call is one physical allocation mapped into
  // it, taken back whole by unmap_range (See Note [Expandable segments] in block_pool_expand.cpp).
  std::size_t expansion_granularity() const override { return granularity_; }
  std::size_t max_range_bytes() const override {
    DeviceGuard guard(device());
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return (total_bytes + granularity_ - 1) / granularity_ * granularity_;
  }

  absl::StatusOr<Range> reserve_range(std::size_t max_bytes, std::size_t min_bytes) override {
    const VmmApi& api = VmmApi::get();
    DeviceGuard guard(device());
    CUdeviceptr va = 0;
    std::size_t size = max_bytes;
    CUresult r = api.reserve(&va, size, granularity_, 0, 0);
    if (r != CUDA_SUCCESS && min_bytes < max_bytes) {
      size = min_bytes;
      r = api.reserve(&va, size, granularity_, 0, 0);
    }
    if (r != CUDA_SUCCESS) return fail("cuMemAddressReserve", r, min_bytes);
    return Range{reinterpret_cast<void*>(va), size};
  }

  absl::Status release_range(void* base, std::size_t bytes) override {
    const CUresult r = VmmApi::get().address_free(reinterpret_cast<CUdeviceptr>(base), bytes);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
      return fail("cuMemAddressFree", r, bytes);
    }
    return absl::OkStatus();
  }

  absl::Status map_range(void* ptr, std::size_t bytes) override {
    const VmmApi& api = VmmApi::get();
    DeviceGuard guard(device());
    CUmemAllocationProp prop = vmm_properties(device());
    CUmemGenericAllocationHandle handle = 0;
    if (CUresult r = api.create(&handle, bytes, &prop, 0); r != CUDA_SUCCESS) {
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      (void)cudaGetLastError();
      const absl::Status failed = fail("cuMemCreate", r, bytes);
      return absl::Status(failed.code(),
                          str_cat(failed.message(), "; device free ", format_bytes(free_bytes),
                                  " of ", format_bytes(total_bytes)));
    }
    const auto va = reinterpret_cast<CUdeviceptr>(ptr);
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult r = api.map(va, bytes, 0, handle, 0);
    const char* what = "cuMemMap";
    if (r == CUDA_SUCCESS) {
      r = api.set_access(va, bytes, &access, 1);
      what = "cuMemSetAccess";
      if (r != CUDA_SUCCESS) (void)api.unmap(va, bytes);
    }
    if (r != CUDA_SUCCESS) {
      (void)api.release(handle);
      return fail(what, r, bytes);
    }
    std::lock_guard<std::mutex> lock(mu_);
    mapped_[ptr] = {handle, bytes};
    return absl::OkStatus();
  }

  absl::Status unmap_range(void* ptr, std::size_t bytes) override {
    Mapping m;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = mapped_.find(ptr);
      if (it == mapped_.end() || it->second.size != bytes) {
        return absl::InvalidArgumentError(str_cat("cuda_device(virtual memory): unmap_range(", ptr,
                                                  ", ", bytes, ") is not one mapping"));
      }
      m = it->second;
      mapped_.erase(it);
    }
    const VmmApi& api = VmmApi::get();
    DeviceGuard guard(device());
    const CUresult unmapped = api.unmap(reinterpret_cast<CUdeviceptr>(ptr), bytes);
    if (unmapped == CUDA_ERROR_DEINITIALIZED) return absl::OkStatus();
    if (unmapped != CUDA_SUCCESS) {
      std::lock_guard<std::mutex> lock(mu_);
      mapped_[ptr] = m;
      return fail("cuMemUnmap", unmapped, bytes);
    }
    if (CUresult r = api.release(m.handle); r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
      std::fprintf(stderr, "strata: %s\n",
                   std::string(fail("cuMemRelease", r, bytes).message()).c_str());
    }
    return absl::OkStatus();
  }

 private:
  struct Mapping {
    CUmemGenericAllocationHandle handle = 0;
    std::size_t size = 0;
  };

  // A failure to create or reserve is reported as out of memory, as a failed cudaMalloc is, so the
  // pool trims its cache and retries; mapping failures are the driver's (kInternal).
  absl::Status fail(const char* what, CUresult r, std::size_t bytes) const {
    const char* name = nullptr;
    if (VmmApi::get().error_name == nullptr || VmmApi::get().error_name(r, &name) != CUDA_SUCCESS) {
      name = "unknown error";
    }
    const std::string text =
        str_cat(what, " of ", format_bytes(bytes), " on device ", device(), " failed (", name, ")");
    const bool exhausted = r == CUDA_ERROR_OUT_OF_MEMORY ||
                           std::string_view(what) == "cuMemCreate" ||
                           std::string_view(what) == "cuMemAddressReserve";
    return exhausted ? absl::ResourceExhaustedError(text) : absl::InternalError(text);
  }

  const std::size_t granularity_;
  std::mutex mu_;
  absl::flat_hash_map<void*, Mapping> mapped_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Upstream>> make_cuda_device_upstream(int device,
                                                                    DeviceMethod method) {
  if (absl::Status s = require_cuda_device(device); !s.ok()) return s;
  if (method == DeviceMethod::kAuto) {
    if (const char* env = std::getenv("STRATA_GPU_MEMORY"); env != nullptr && *env != '\0') {
      absl::StatusOr<DeviceMethod> chosen = parse_device_method(env);
      if (!chosen.ok())
        return absl::InvalidArgumentError(
            str_cat("STRATA_GPU_MEMORY: ", chosen.status().message()));
      method = *chosen;
    }
  }
  const bool vmm = method != DeviceMethod::kCudaMalloc && device_supports_vmm(device);
  if (!vmm && method != DeviceMethod::kVirtualMemory) {
    return std::unique_ptr<Upstream>(new CudaDeviceUpstream(device));
  }
  if (!vmm) {
    const absl::Status why = VmmApi::get().loaded;
    return absl::UnavailableError(str_cat(
        "CUDA device ", device, " does not support virtual memory management",
        why.ok() ? "" : str_cat(" (", why.message(), ")"), "; use DeviceMethod::kCudaMalloc"));
  }
  DeviceGuard guard(device);
  const CUmemAllocationProp prop = vmm_properties(device);
  std::size_t granularity = 0;
  if (VmmApi::get().granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
          CUDA_SUCCESS ||
      granularity == 0) {
    return absl::UnavailableError(
        str_cat("CUDA device ", device, ": no allocation granularity for virtual memory"));
  }
  return std::unique_ptr<Upstream>(new CudaVmmDeviceUpstream(device, granularity));
}

#else  // !STRATA_HAS_CUDA

absl::StatusOr<std::unique_ptr<Upstream>> make_cuda_device_upstream(int /*device*/,
                                                                    DeviceMethod /*method*/) {
  return no_cuda();
}

#endif  // STRATA_HAS_CUDA

}  // namespace strata::alloc
