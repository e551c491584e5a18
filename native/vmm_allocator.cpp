// redline's pausable GPU allocator (CUDA driver API virtual memory management).
//
// Every allocation is a reserved virtual address range with physical memory mapped into it
// (cuMemAddressReserve + cuMemCreate + cuMemMap + cuMemSetAccess). Pausing unmaps and releases the physical
// memory of every live allocation while keeping the address range reserved, optionally copying the contents
// to pinned host memory first; resuming creates new physical memory, maps it at the same addresses and
// restores the contents. Pointers held by PyTorch tensors (and CUDA graphs) therefore stay valid across a
// pause/resume cycle.
//
// Host staging: an allocation's pinned host buffer is made at its first pause with contents and kept across
// pauses (pinning tens of GB costs seconds, far more than copying it: pinned copies run at PCIe speed), until
// the allocation is freed or redline_vmm_release_host() gives kept buffers back. The copies of one pause or
// resume are queued on one stream per device, back to back, with one synchronisation at the end.
//
// PyTorch plugs it in through torch.cuda.memory.CUDAPluggableAllocator(path, "redline_vmm_malloc",
// "redline_vmm_free") and torch.cuda.MemPool; the Python side is redline/sync/memory.py. The driver API is
// looked up at run time in libcuda.so.1 (already loaded by PyTorch), so the library builds with the CUDA
// headers alone, on machines whose toolkit ships no driver stub. redline_vmm_use_fake_driver() swaps in a
// host-memory imitation of the same calls so the bookkeeping (contents kept, host buffers reused) is tested
// on machines without a GPU (tests/sync/test_native.py).
//
// Memory made here cannot be exported over CUDA IPC (cudaIpcGetMemHandle rejects VMM allocations); weight-sync
// staging buffers must be allocated outside the pool.

#include <cuda.h>
#include <dlfcn.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

struct Allocation {
  size_t size;       // bytes requested
  size_t mapped;     // bytes reserved and mapped (size rounded up to the granularity)
  int device;
  bool is_mapped;    // false while paused
  bool saved;        // host_backup holds the contents (paused with keep_contents)
  CUmemGenericAllocationHandle handle;
  void* host_backup; // pinned host buffer, kept across pauses; null until the first pause with contents
};

// cuda.h maps API names to versioned symbols (cuMemcpyDtoH -> cuMemcpyDtoH_v2); XSTR names the symbol that
// the header's declaration refers to, and decltype gives its exact signature.
#define STR(x) #x
#define XSTR(x) STR(x)
#define DRIVER_FUNCTIONS(X)                                                                                \
  X(cuGetErrorString) X(cuDeviceGet) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease)             \
  X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxSynchronize) X(cuMemGetAllocationGranularity)              \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap)      \
  X(cuMemSetAccess) X(cuMemAllocHost) X(cuMemFreeHost) X(cuMemcpyDtoHAsync) X(cuMemcpyHtoDAsync)           \
  X(cuStreamCreate) X(cuStreamSynchronize)

struct Driver {
#define DECLARE(name) decltype(&::name) name = nullptr;
  DRIVER_FUNCTIONS(DECLARE)
#undef DECLARE
  bool loaded = false;
};

Driver driver;
std::mutex mutex;
std::unordered_map<CUdeviceptr, Allocation> allocations;
std::map<int, CUstream> copy_streams;  // one per device, made at its first pause/resume, never destroyed
std::string last_error;
size_t host_allocations = 0;  // pinned host buffers made so far (the tests check that pauses reuse them)

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

// The copy stream of `device` (its context must be current).
bool copy_stream(int device, CUstream* stream) {
  auto it = copy_streams.find(device);
  if (it != copy_streams.end()) {
    *stream = it->second;
    return true;
  }
  if (!check(driver.cuStreamCreate(stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate")) return false;
  copy_streams[device] = *stream;
  return true;
}

// The allocations of each device, in address order (deterministic work order).
std::map<int, std::vector<std::pair<CUdeviceptr, Allocation*>>> by_device() {
  std::map<int, std::vector<std::pair<CUdeviceptr, Allocation*>>> out;
  std::map<CUdeviceptr, Allocation*> ordered;
  for (auto& [ptr, a] : allocations) ordered[ptr] = &a;
  for (auto& [ptr, a] : ordered) out[a->device].emplace_back(ptr, a);
  return out;
}

// Sum of bytes(allocation) over every allocation, taking the mutex (the byte counts reported to Python).
template <typename Bytes>
size_t total_bytes(Bytes bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  size_t total = 0;
  for (auto& [ptr, a] : allocations) total += bytes(a);
  return total;
}

// Releases the physical memory of the selected allocations of each device, copying those whose flag is set
// to their pinned host buffers first (made at their first such pause, then reused; the copies queued back to
// back on the device's copy stream, one synchronisation). Allocations already paused are skipped.
using Selection = std::map<int, std::vector<std::tuple<CUdeviceptr, Allocation*, bool>>>;

int pause_selected(const Selection& selection) {
  for (auto& [device, list] : selection) {
    bool ok = with_device_context(device, [&] {
      // Device work on any stream may still read or write this memory: finish it before copying/unmapping.
      if (!check(driver.cuCtxSynchronize(), "cuCtxSynchronize")) return false;
      CUstream stream = nullptr;
      bool copies = false;
      for (auto& [ptr, a, keep] : list) {
        if (!keep || !a->is_mapped) continue;
        if (!stream && !copy_stream(device, &stream)) return false;
        if (!a->host_backup) {
          if (!check(driver.cuMemAllocHost(&a->host_backup, a->size), "cuMemAllocHost")) return false;
          ++host_allocations;
        }
        if (!check(driver.cuMemcpyDtoHAsync(a->host_backup, ptr, a->size, stream), "cuMemcpyDtoHAsync"))
          return false;
        copies = true;
      }
      if (copies && !check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")) return false;
      for (auto& [ptr, a, keep] : list) {
        if (!a->is_mapped) continue;
        a->saved = keep;
        if (!unmap_physical(ptr, *a)) return false;
      }
      return true;
    });
    if (!ok) return -1;
  }
  return 0;
}

// ----- a host-memory imitation of the driver calls above, for tests on machines without a GPU -----------
// Address ranges are reserved with mmap(PROT_NONE); mapping makes them read-write with fresh, scribbled
// contents (physical memory comes back undefined); unmapping drops the contents; copies are memcpy.
namespace fake {
CUresult error_string(CUresult, const char** s) { *s = "fake driver error"; return CUDA_SUCCESS; }
CUresult device_get(CUdevice* d, int ordinal) { *d = ordinal; return CUDA_SUCCESS; }
CUresult ctx_retain(CUcontext* c, CUdevice) { *c = reinterpret_cast<CUcontext>(1); return CUDA_SUCCESS; }
CUresult ctx_release(CUdevice) { return CUDA_SUCCESS; }
CUresult ctx_push(CUcontext) { return CUDA_SUCCESS; }
CUresult ctx_pop(CUcontext* c) { *c = nullptr; return CUDA_SUCCESS; }
CUresult ctx_sync() { return CUDA_SUCCESS; }
CUresult granularity(size_t* g, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) {
  *g = 4096;
  return CUDA_SUCCESS;
}
CUresult reserve(CUdeviceptr* p, size_t size, size_t, CUdeviceptr, unsigned long long) {
  void* m = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = reinterpret_cast<CUdeviceptr>(m);
  return CUDA_SUCCESS;
}
CUresult address_free(CUdeviceptr p, size_t size) {
  munmap(reinterpret_cast<void*>(p), size);
  return CUDA_SUCCESS;
}
CUresult create(CUmemGenericAllocationHandle* h, size_t, const CUmemAllocationProp*, unsigned long long) {
  *h = 1;
  return CUDA_SUCCESS;
}
CUresult release(CUmemGenericAllocationHandle) { return CUDA_SUCCESS; }
CUresult map(CUdeviceptr p, size_t size, size_t, CUmemGenericAllocationHandle, unsigned long long) {
  void* m = mmap(reinterpret_cast<void*>(p), size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::memset(m, 0xA5, size);
  return CUDA_SUCCESS;
}
CUresult unmap(CUdeviceptr p, size_t size) {
  void* m = mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  return m == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult set_access(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) { return CUDA_SUCCESS; }
CUresult alloc_host(void** p, size_t size) {
  *p = std::malloc(size);
  return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult free_host(void* p) {
  std::free(p);
  return CUDA_SUCCESS;
}
CUresult dtoh(void* dst, CUdeviceptr src, size_t n, CUstream) {
  std::memcpy(dst, reinterpret_cast<void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult htod(CUdeviceptr dst, const void* src, size_t n, CUstream) {
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult stream_create(CUstream* s, unsigned int) { *s = reinterpret_cast<CUstream>(1); return CUDA_SUCCESS; }
CUresult stream_sync(CUstream) { return CUDA_SUCCESS; }
}  // namespace fake

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
  Allocation a{size, (size + granularity - 1) / granularity * granularity, device, false, false, 0, nullptr};
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

// Releases the physical memory of every mapped allocation; with keep_contents, copies each to its pinned host
// buffer first (made at the first such pause, then reused). Returns 0, or -1 with redline_vmm_last_error()
// set (allocations already paused stay paused).
int redline_vmm_pause(int keep_contents) {
  std::lock_guard<std::mutex> lock(mutex);
  Selection selection;
  for (auto& [device, list] : by_device())
    for (auto& [ptr, a] : list) selection[device].emplace_back(ptr, a, keep_contents != 0);
  return pause_selected(selection);
}

// Like redline_vmm_pause, for the `count` allocations starting at `ptrs[i]` only, each with its own
// keep_contents[i] (the trainer's state pauses group by group: what is rebuilt is dropped, the rest kept).
// Returns 0, or -1 with redline_vmm_last_error() set; a pointer that starts no allocation fails before any
// is paused.
int redline_vmm_pause_some(void* const* ptrs, const int* keep_contents, size_t count) {
  std::lock_guard<std::mutex> lock(mutex);
  Selection selection;
  std::map<CUdeviceptr, size_t> order;  // address order, as redline_vmm_pause works
  for (size_t i = 0; i < count; ++i) order[reinterpret_cast<CUdeviceptr>(ptrs[i])] = i;
  for (auto& [ptr, i] : order) {
    auto it = allocations.find(ptr);
    if (it == allocations.end()) {
      last_error = "redline_vmm_pause_some: " + std::to_string(ptr) + " is not the start of an allocation";
      return -1;
    }
    selection[it->second.device].emplace_back(ptr, &it->second, keep_contents[i] != 0);
  }
  return pause_selected(selection);
}

// Bytes mapped for the allocation starting at `p` while it is not paused (its size rounded up to the
// granularity); 0 when `p` starts no allocation.
size_t redline_vmm_allocation_bytes(void* p) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = allocations.find(reinterpret_cast<CUdeviceptr>(p));
  return it == allocations.end() ? 0 : it->second.mapped;
}

// Maps new physical memory at the same addresses for every paused allocation and restores the contents saved
// by pause(keep_contents=1). The pinned host buffers are kept for the next pause. Returns 0, or -1 with
// redline_vmm_last_error() set.
int redline_vmm_resume() {
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& [device, list] : by_device()) {
    bool ok = with_device_context(device, [&] {
      CUstream stream = nullptr;
      bool copies = false;
      for (auto& [ptr, a] : list) {
        if (a->is_mapped) continue;
        if (!map_physical(ptr, *a)) return false;
        if (!a->saved) continue;
        if (!stream && !copy_stream(device, &stream)) return false;
        if (!check(driver.cuMemcpyHtoDAsync(ptr, a->host_backup, a->size, stream), "cuMemcpyHtoDAsync"))
          return false;
        a->saved = false;
        copies = true;
      }
      return !copies || check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize");
    });
    if (!ok) return -1;
  }
  return 0;
}

// Frees the kept pinned host buffers that hold no paused contents; returns the bytes freed.
size_t redline_vmm_release_host() {
  std::lock_guard<std::mutex> lock(mutex);
  size_t freed = 0;
  for (auto& [ptr, a] : allocations) {
    if (!a.host_backup || a.saved) continue;
    driver.cuMemFreeHost(a.host_backup);
    a.host_backup = nullptr;
    freed += a.size;
  }
  return freed;
}

// Bytes of device memory currently mapped (physically backed) by this allocator.
size_t redline_vmm_mapped_bytes() {
  return total_bytes([](const Allocation& a) { return a.is_mapped ? a.mapped : size_t{0}; });
}

// Bytes of virtual address space reserved by live allocations (mapped or paused).
size_t redline_vmm_reserved_bytes() {
  return total_bytes([](const Allocation& a) { return a.mapped; });
}

// Bytes of pinned host memory held: buffers holding paused contents and buffers kept for the next pause.
size_t redline_vmm_host_backup_bytes() {
  return total_bytes([](const Allocation& a) { return a.host_backup ? a.size : size_t{0}; });
}

// Pinned host buffers made since the library was loaded (a pause that reuses kept buffers makes none).
size_t redline_vmm_host_allocations() {
  std::lock_guard<std::mutex> lock(mutex);
  return host_allocations;
}

size_t redline_vmm_allocation_count() {
  std::lock_guard<std::mutex> lock(mutex);
  return allocations.size();
}

const char* redline_vmm_last_error() { return last_error.c_str(); }

// Tests only: use the host-memory imitation of the driver (see namespace fake); call before any allocation.
// Returns -1 when allocations already exist (they belong to the real driver).
int redline_vmm_use_fake_driver() {
  std::lock_guard<std::mutex> lock(mutex);
  if (!allocations.empty()) return -1;
  driver.cuGetErrorString = fake::error_string;
  driver.cuDeviceGet = fake::device_get;
  driver.cuDevicePrimaryCtxRetain = fake::ctx_retain;
  driver.cuDevicePrimaryCtxRelease = fake::ctx_release;
  driver.cuCtxPushCurrent = fake::ctx_push;
  driver.cuCtxPopCurrent = fake::ctx_pop;
  driver.cuCtxSynchronize = fake::ctx_sync;
  driver.cuMemGetAllocationGranularity = fake::granularity;
  driver.cuMemAddressReserve = fake::reserve;
  driver.cuMemAddressFree = fake::address_free;
  driver.cuMemCreate = fake::create;
  driver.cuMemRelease = fake::release;
  driver.cuMemMap = fake::map;
  driver.cuMemUnmap = fake::unmap;
  driver.cuMemSetAccess = fake::set_access;
  driver.cuMemAllocHost = fake::alloc_host;
  driver.cuMemFreeHost = fake::free_host;
  driver.cuMemcpyDtoHAsync = fake::dtoh;
  driver.cuMemcpyHtoDAsync = fake::htod;
  driver.cuStreamCreate = fake::stream_create;
  driver.cuStreamSynchronize = fake::stream_sync;
  driver.loaded = true;
  copy_streams.clear();
  return 0;
}

}  // extern "C"
