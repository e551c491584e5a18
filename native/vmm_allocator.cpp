// redline's pausable GPU allocator (CUDA driver API virtual memory management).
//
// Every allocation is a reserved virtual address range with physical memory mapped into it
// (cuMemAddressReserve + cuMemCreate + cuMemMap + cuMemSetAccess). Pausing unmaps and releases the physical
// memory of every live allocation while keeping the address range reserved, optionally copying the contents
// to pinned host memory first; resuming creates new physical memory, maps it at the same addresses and
// restores the contents. Pointers held by PyTorch tensors (and CUDA graphs) therefore stay valid across a
// pause/resume cycle.
//
// PyTorch plugs it in through torch.cuda.memory.CUDAPluggableAllocator(path, "redline_vmm_malloc",
// "redline_vmm_free") and torch.cuda.MemPool; the Python side is redline/sync/memory.py. The driver API is
// looked up at run time in libcuda.so.1 (already loaded by PyTorch), so the library builds with the CUDA
// headers alone, on machines whose toolkit ships no driver stub.
//
// Memory made here cannot be exported over CUDA IPC (cudaIpcGetMemHandle rejects VMM allocations); weight-sync
// staging buffers must be allocated outside the pool.

#include <cuda.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

struct Allocation {
  size_t size;       // bytes requested
  size_t mapped;     // bytes reserved and mapped (size rounded up to the granularity)
  int device;
  bool is_mapped;    // false while paused
  CUmemGenericAllocationHandle handle;
  void* host_backup; // pinned host copy made by pause(keep_contents=1); null otherwise
};

// cuda.h maps API names to versioned symbols (cuMemcpyDtoH -> cuMemcpyDtoH_v2); XSTR names the symbol that
// the header's declaration refers to, and decltype gives its exact signature.
#define STR(x) #x
#define XSTR(x) STR(x)
#define DRIVER_FUNCTIONS(X)                                                                                \
  X(cuGetErrorString) X(cuDeviceGet) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)             \
  X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxSynchronize) X(cuMemGetAllocationGranularity)              \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap)      \
  X(cuMemSetAccess) X(cuMemAllocHost) X(cuMemFreeHost) X(cuMemcpyDtoH) X(cuMemcpyHtoD)

struct Driver {
#define DECLARE(name) decltype(&::name) name = nullptr;
  DRIVER_FUNCTIONS(DECLARE)
#undef DECLARE
  bool loaded = false;
};

Driver driver;
std::mutex mutex;
std::unordered_map<CUdeviceptr, Allocation> allocations;
std::string last_error;

// Resolves every driver function once; false (with last_error set) when libcuda is absent.
bool load_driver() {
  if (driver.loaded) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    last_error = std::string("cannot load the CUDA driver library libcuda.so.1: ") + dlerror();
    return false;
  }
#define RESOLVE(name)                                                                      \
  driver.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, XSTR(name)));               \
  if (!driver.name) {                                                                      \
    last_error = std::string("the CUDA driver lacks ") + XSTR(name) + " (driver too old?)"; \
    return false;                                                                          \
  }
  DRIVER_FUNCTIONS(RESOLVE)
#undef RESOLVE
  driver.loaded = true;
  return true;
}

bool check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return true;
  const char* message = nullptr;
  driver.cuGetErrorString(result, &message);
  last_error = std::string(what) + " failed: " + (message ? message : "unknown CUDA error") + " (CUresult " +
               std::to_string(static_cast<int>(result)) + ")";
  return false;
}

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// Physical memory for `a`, mapped read-write at `ptr` (the range is already reserved).
bool map_physical(CUdeviceptr ptr, Allocation& a) {
  CUmemAllocationProp prop = properties(a.device);
  if (!check(driver.cuMemCreate(&a.handle, a.mapped, &prop, 0), "cuMemCreate")) return false;
  if (!check(driver.cuMemMap(ptr, a.mapped, 0, a.handle, 0), "cuMemMap")) {
    driver.cuMemRelease(a.handle);
    return false;
  }
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = a.device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!check(driver.cuMemSetAccess(ptr, a.mapped, &access, 1), "cuMemSetAccess")) {
    driver.cuMemUnmap(ptr, a.mapped);
    driver.cuMemRelease(a.handle);
    return false;
  }
  a.is_mapped = true;
  return true;
}

bool unmap_physical(CUdeviceptr ptr, Allocation& a) {
  if (!check(driver.cuMemUnmap(ptr, a.mapped), "cuMemUnmap")) return false;
  if (!check(driver.cuMemRelease(a.handle), "cuMemRelease")) return false;
  a.is_mapped = false;
  return true;
}

// Runs `body` with device `device`'s primary context current (pause/resume may be called from any thread).
template <typename Body>
bool with_device_context(int device, Body body) {
  CUdevice dev;
  CUcontext ctx;
  if (!check(driver.cuDeviceGet(&dev, device), "cuDeviceGet")) return false;
  if (!check(driver.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain")) return false;
  if (!check(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")) {
    driver.cuDevicePrimaryCtxRelease(dev);
    return false;
  }
  bool ok = body();
  CUcontext popped;
  driver.cuCtxPopCurrent(&popped);
  driver.cuDevicePrimaryCtxRelease(dev);
  return ok;
}

}  // namespace

extern "C" {

// CUDAPluggableAllocator alloc hook: `stream` is unused (physical memory is not stream-ordered).
void* redline_vmm_malloc(size_t size, int device, void* /*stream*/) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!load_driver()) return nullptr;
  CUmemAllocationProp prop = properties(device);
  size_t granularity = 0;
  if (!check(driver.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity"))
    return nullptr;
  Allocation a{size, (size + granularity - 1) / granularity * granularity, device, false, 0, nullptr};
  if (a.mapped == 0) a.mapped = granularity;
  CUdeviceptr ptr = 0;
  if (!check(driver.cuMemAddressReserve(&ptr, a.mapped, granularity, 0, 0), "cuMemAddressReserve")) return nullptr;
  if (!map_physical(ptr, a)) {
    driver.cuMemAddressFree(ptr, a.mapped);
    return nullptr;
  }
  allocations[ptr] = a;
  return reinterpret_cast<void*>(ptr);
}

// CUDAPluggableAllocator free hook; also frees allocations that are paused.
void redline_vmm_free(void* p, size_t /*size*/, int /*device*/, void* /*stream*/) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = allocations.find(reinterpret_cast<CUdeviceptr>(p));
  if (it == allocations.end()) return;
  Allocation& a = it->second;
  if (a.is_mapped) unmap_physical(it->first, a);
  driver.cuMemAddressFree(it->first, a.mapped);
  if (a.host_backup) driver.cuMemFreeHost(a.host_backup);
  allocations.erase(it);
}

// Releases the physical memory of every mapped allocation; with keep_contents, copies each to pinned host
// memory first. Returns 0, or -1 with redline_vmm_last_error() set (allocations already paused stay paused).
int redline_vmm_pause(int keep_contents) {
  std::lock_guard<std::mutex> lock(mutex);
  if (allocations.empty()) return 0;
  for (auto& [ptr, a] : allocations) {
    if (!a.is_mapped) continue;
    bool ok = with_device_context(a.device, [&] {
      // Device work on any stream may still read or write this memory: finish it before unmapping.
      if (!check(driver.cuCtxSynchronize(), "cuCtxSynchronize")) return false;
      if (keep_contents) {
        if (!a.host_backup && !check(driver.cuMemAllocHost(&a.host_backup, a.size), "cuMemAllocHost")) return false;
        if (!check(driver.cuMemcpyDtoH(a.host_backup, ptr, a.size), "cuMemcpyDtoH")) return false;
      } else if (a.host_backup) {
        driver.cuMemFreeHost(a.host_backup);
        a.host_backup = nullptr;
      }
      return unmap_physical(ptr, a);
    });
    if (!ok) return -1;
  }
  return 0;
}

// Maps new physical memory at the same addresses for every paused allocation and restores the contents saved
// by pause(keep_contents=1). Returns 0, or -1 with redline_vmm_last_error() set.
int redline_vmm_resume() {
  std::lock_guard<std::mutex> lock(mutex);
  if (allocations.empty()) return 0;
  for (auto& [ptr, a] : allocations) {
    if (a.is_mapped) continue;
    bool ok = with_device_context(a.device, [&] {
      if (!map_physical(ptr, a)) return false;
      if (!a.host_backup) return true;
      if (!check(driver.cuMemcpyHtoD(ptr, a.host_backup, a.size), "cuMemcpyHtoD")) return false;
      // Pinned host memory is scarce (the trainer's whole state can be tens of GB): give it back now rather
      // than hold it for the next pause, at the price of re-pinning then.
      driver.cuMemFreeHost(a.host_backup);
      a.host_backup = nullptr;
      return true;
    });
    if (!ok) return -1;
  }
  return 0;
}

// Bytes of device memory currently mapped (physically backed) by this allocator.
size_t redline_vmm_mapped_bytes() {
  std::lock_guard<std::mutex> lock(mutex);
  size_t total = 0;
  for (auto& [ptr, a] : allocations)
    if (a.is_mapped) total += a.mapped;
  return total;
}

// Bytes of virtual address space reserved by live allocations (mapped or paused).
size_t redline_vmm_reserved_bytes() {
  std::lock_guard<std::mutex> lock(mutex);
  size_t total = 0;
  for (auto& [ptr, a] : allocations) total += a.mapped;
  return total;
}

// Bytes of pinned host memory holding paused contents.
size_t redline_vmm_host_backup_bytes() {
  std::lock_guard<std::mutex> lock(mutex);
  size_t total = 0;
  for (auto& [ptr, a] : allocations)
    if (a.host_backup) total += a.size;
  return total;
}

size_t redline_vmm_allocation_count() {
  std::lock_guard<std::mutex> lock(mutex);
  return allocations.size();
}

const char* redline_vmm_last_error() { return last_error.c_str(); }

}  // extern "C"
