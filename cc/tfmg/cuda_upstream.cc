// CUDA device memory upstream, through the CUDA driver API loaded at run time
// (dlopen("libcuda.so.1")): the core builds, imports and runs without CUDA, and says
// clearly when there is no driver or GPU. Regions come from cuMemAlloc (or
// cuMemAllocManaged, prefetched to the device, for the managed variant) and go back
// with cuMemFree when released. Blocks are 256-byte aligned (what GPU kernels expect).
//
// Where the device supports virtual memory management (every GPU since Pascal with a
// recent driver), a region is only address space (cuMemAddressReserve) and physical
// memory is mapped under it in granules (2 MiB on Hopper: cuMemCreate + cuMemMap +
// cuMemSetAccess) as the pool hands out blocks there: a budget costs the device what
// the run has needed, not the whole budget at once (PyTorch's "expandable segments"
// rest on the same calls). At the budget a reclaim moves the physical memory of free
// granules under the block that needs it (retire/settle, backing.h); granules are
// unmapped only after a device synchronization, since kernels still queued may use
// freed blocks (cuMemUnmap does not wait for them).
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cc/tfmg/backing.h"
#include "cc/tfmg/upstream.h"

namespace tfmg {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
using CUstream = void*;
struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;
};
constexpr unsigned kAttachGlobal = 1;  // CU_MEM_ATTACH_GLOBAL
using CUmemGenericAllocationHandle = unsigned long long;
// The layouts of cuda.h (CUDA 11.2 and later), so that no CUDA header is needed to build.
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = 1
  int requestedHandleTypes;  // CU_MEM_HANDLE_TYPE_NONE = 0
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
};
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
constexpr int kAttrVirtualMemory = 102;  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED

struct driver {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*device_count)(int*);
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*mem_alloc)(CUdeviceptr*, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*mem_alloc_managed)(CUdeviceptr*, size_t, unsigned);
  CUresult (*prefetch_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream);
  CUresult (*device_total_mem)(size_t*, CUdevice);
  CUresult (*error_string)(CUresult, const char**);
  // Virtual memory management (optional: null when the driver lacks it).
  CUresult (*device_attribute)(int*, int, CUdevice);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*mem_unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, int);
  CUresult (*ctx_synchronize)();
  bool vmm() const {
    return device_attribute && address_reserve && address_free && mem_create && mem_release &&
           mem_map && mem_unmap && set_access && granularity && ctx_synchronize;
  }
};

template <class F>
bool bind(void* h, const char* name, F* slot) {
  *slot = reinterpret_cast<F>(dlsym(h, name));
  return *slot != nullptr;
}

// Loaded once per process; null (with *why) when there is no usable driver.
const driver* load_driver(std::string* why) {
  static std::once_flag once;
  static driver d;
  static bool ok = false;
  static std::string error;
  std::call_once(once, [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) {
      error = "no CUDA driver: libcuda.so.1 could not be loaded (is this a machine with an NVIDIA GPU "
              "and its driver?)";
      return;
    }
    ok = bind(h, "cuInit", &d.init) && bind(h, "cuDeviceGet", &d.device_get) &&
         bind(h, "cuDeviceGetCount", &d.device_count) &&
         bind(h, "cuDevicePrimaryCtxRetain", &d.primary_ctx_retain) &&
         bind(h, "cuCtxSetCurrent", &d.ctx_set_current) && bind(h, "cuMemAlloc_v2", &d.mem_alloc) &&
         bind(h, "cuMemFree_v2", &d.mem_free) && bind(h, "cuMemAllocManaged", &d.mem_alloc_managed) &&
         bind(h, "cuDeviceTotalMem_v2", &d.device_total_mem) && bind(h, "cuGetErrorString", &d.error_string);
    if (!ok) {
      error = "the CUDA driver lacks a function tf_memguard needs (driver too old?)";
      return;
    }
    bind(h, "cuMemPrefetchAsync_v2", &d.prefetch_v2);  // optional: managed memory only
    bind(h, "cuDeviceGetAttribute", &d.device_attribute);
    bind(h, "cuMemAddressReserve", &d.address_reserve);
    bind(h, "cuMemAddressFree", &d.address_free);
    bind(h, "cuMemCreate", &d.mem_create);
    bind(h, "cuMemRelease", &d.mem_release);
    bind(h, "cuMemMap", &d.mem_map);
    bind(h, "cuMemUnmap", &d.mem_unmap);
    bind(h, "cuMemSetAccess", &d.set_access);
    bind(h, "cuMemGetAllocationGranularity", &d.granularity);
    bind(h, "cuCtxSynchronize", &d.ctx_synchronize);
    const CUresult r = d.init(0);
    if (r != 0) {
      const char* s = nullptr;
      d.error_string(r, &s);
      error = std::string("cuInit failed: ") + (s ? s : "unknown error") + " (no GPU visible?)";
      ok = false;
    }
  });
  if (!ok && why != nullptr) *why = error;
  return ok ? &d : nullptr;
}

class cuda_upstream final : public upstream {
 public:
  cuda_upstream(const driver* d, CUdevice dev, CUcontext ctx, int ordinal, bool managed, bool vmm)
      : d_(d), dev_(dev), ctx_(ctx), ordinal_(ordinal), managed_(managed), backing_(0) {
    d_->device_total_mem(&total_, dev_);
    prop_ = CUmemAllocationProp{};
    prop_.type = 1;
    prop_.location = CUmemLocation{1, ordinal_};
    const char* move = std::getenv("TF_MEMGUARD_CUDA_MOVE");
    move_granules_ = move == nullptr || move[0] != '0';
    std::size_t g = 0;
    if (vmm && !managed_ && d_->granularity(&g, &prop_, 0) == 0 && g != 0 && (g & (g - 1)) == 0) {
      backing_ = backing_map(g);
    }
  }

  void* allocate(std::size_t bytes, std::size_t /*alignment*/, bool region) override {
    // cuMemAlloc's pointers are aligned to at least 256 bytes; regions ask for no more.
    d_->ctx_set_current(ctx_);
    CUdeviceptr p = 0;
    if (region && vmm()) {
      const std::size_t g = backing_.granule();
      const std::size_t size = ((bytes == 0 ? 1 : bytes) + g - 1) / g * g;
      if (d_->address_reserve(&p, size, g, 0, 0) != 0) return nullptr;
      backing_.add_region(p, size);
      sizes_[p] = size;
    } else if (managed_) {
      if (d_->mem_alloc_managed(&p, bytes == 0 ? 1 : bytes, kAttachGlobal) != 0) return nullptr;
      if (d_->prefetch_v2 != nullptr) d_->prefetch_v2(p, bytes, CUmemLocation{1, ordinal_}, 0, nullptr);
    } else if (d_->mem_alloc(&p, bytes == 0 ? 1 : bytes) != 0) {
      return nullptr;
    }
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
  }

  void deallocate(void* p, std::size_t, std::size_t, bool region) override {
    if (p == nullptr) return;
    d_->ctx_set_current(ctx_);
    const CUdeviceptr dp = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
    if (region && backing_.has_region(dp)) {
      sync();  // kernels still queued may use the region's blocks
      backing_.remove_region(dp, [&](std::uintptr_t at) { drop(at); },
                             [&](std::uintptr_t at, backing_map::handle h) { unmap(at, h); });
      d_->address_free(dp, sizes_[dp]);
      sizes_.erase(dp);
      return;
    }
    d_->mem_free(dp);
  }

  bool backs_on_demand() const override { return vmm(); }

  bool back(void* p, std::size_t bytes, std::size_t* added) override {
    *added = 0;
    if (!vmm()) return true;
    // No driver call unless a granule needs mapping: most blocks land where the pool
    // has been before.
    const std::size_t g = backing_.granule();
    return backing_.back(
        reinterpret_cast<std::uintptr_t>(p), bytes,
        [&](std::uintptr_t at) -> backing_map::handle {
          d_->ctx_set_current(ctx_);
          CUmemGenericAllocationHandle h = 0;
          if (d_->mem_create(&h, g, &prop_, 0) != 0) return 0;
          if (d_->mem_map(at, g, 0, h, 0) != 0) {
            d_->mem_release(h);
            return 0;
          }
          return h;
        },
        [&](std::uintptr_t at, backing_map::handle h) {
          d_->ctx_set_current(ctx_);
          return d_->mem_map(at, g, 0, h, 0) == 0;
        },
        [&](std::uintptr_t at, std::size_t n) {
          const CUmemAccessDesc access{CUmemLocation{1, ordinal_}, 3};
          return d_->set_access(at, n, &access, 1) == 0;
        },
        [&] { sync(); }, [&](std::uintptr_t at) { drop(at); }, added);
  }

  std::size_t discard(void* p, std::size_t bytes) override {
    if (!vmm()) return 0;
    // Kernels still queued may use blocks already freed: the device finishes first.
    return backing_.discard(
        reinterpret_cast<std::uintptr_t>(p), bytes, [&] { sync(); }, [&](std::uintptr_t at) { drop(at); },
        [&](std::uintptr_t at, backing_map::handle h) { unmap(at, h); });
  }

  // A reclaim moves physical granules instead of unmapping them: no synchronization
  // (backing.h says why that is safe).
  std::size_t retire(void* p, std::size_t bytes, std::size_t want) override {
    if (!vmm()) return 0;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    if (move_granules_) return backing_.retire(a, bytes, want);
    const std::uintptr_t lo = backing_.from_top(a, bytes, want);
    return discard(reinterpret_cast<void*>(lo), bytes - (lo - a));
  }
  void settle() override {
    if (!vmm()) return;
    backing_.settle([&] { sync(); }, [&](std::uintptr_t at) { drop(at); },
                    [&](backing_map::handle h) { d_->mem_release(h); });
  }
  // Moving granules costs no synchronization, so the pool keeps the bytes backed within
  // 4% of the peak in use (benchmarks/NOTES.md: Keras on PyTorch).
  double default_trim_above_peak() const override { return vmm() && move_granules_ ? 0.04 : 0.0; }
  std::uint64_t synchronizations() const override { return syncs_; }
  std::string backing_summary() const override { return vmm() ? backing_.summary() : std::string(); }

  std::size_t unbacked(const void* p, std::size_t bytes) const override {
    return vmm() ? backing_.missing(reinterpret_cast<std::uintptr_t>(p), bytes) : 0;
  }
  std::size_t discardable(const void* p, std::size_t bytes) const override {
    return vmm() ? backing_.inside(reinterpret_cast<std::uintptr_t>(p), bytes) : 0;
  }

  std::size_t default_alignment() const override { return 256; }
  // The driver's granularity (2 MiB): regions and backing come in multiples of it.
  std::size_t page_size() const override { return vmm() ? backing_.granule() : 2u << 20; }
  std::size_t total_memory() const override { return total_; }
  const char* name() const override {
    return managed_ ? "CUDA managed" : vmm() ? "CUDA device (virtual memory)" : "CUDA device";
  }

 private:
  bool vmm() const { return backing_.granule() != 0; }

  void sync() {
    d_->ctx_set_current(ctx_);
    d_->ctx_synchronize();
    ++syncs_;
  }
  // Unmaps a granule and releases its handle (after sync()).
  void unmap(std::uintptr_t at, backing_map::handle h) {
    d_->mem_unmap(at, backing_.granule());
    d_->mem_release(h);
  }
  // Unmaps a stale granule; its handle lives on elsewhere (after sync()).
  void drop(std::uintptr_t at) { d_->mem_unmap(at, backing_.granule()); }

  const driver* d_;
  CUdevice dev_;
  CUcontext ctx_;
  int ordinal_;
  bool managed_;
  // TF_MEMGUARD_CUDA_MOVE=0: a reclaim unmaps (after a synchronization) instead of moving.
  bool move_granules_ = true;
  std::uint64_t syncs_ = 0;  // device synchronizations, all causes
  std::size_t total_ = 0;
  CUmemAllocationProp prop_;
  backing_map backing_;  // granule 0: no virtual memory management (cuMemAlloc regions)
  std::map<CUdeviceptr, std::size_t> sizes_;
};

}  // namespace

std::unique_ptr<upstream> make_cuda_upstream(int device, bool managed, std::string* error) {
  const driver* d = load_driver(error);
  if (d == nullptr) return nullptr;
  int count = 0;
  d->device_count(&count);
  if (device < 0 || device >= count) {
    *error = "device=" + std::to_string(device) + ": " + std::to_string(count) + " CUDA device(s) visible";
    return nullptr;
  }
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (d->device_get(&dev, device) != 0 || d->primary_ctx_retain(&ctx, dev) != 0) {
    *error = "could not open CUDA device " + std::to_string(device);
    return nullptr;
  }
  if (managed && d->prefetch_v2 == nullptr) {
    // Works without the prefetch, but pages then move on first touch.
  }
  int vmm = 0;
  if (d->vmm() && d->device_attribute(&vmm, kAttrVirtualMemory, dev) != 0) vmm = 0;
  // TF_MEMGUARD_CUDA_VMM=0 turns it off (regions then come whole from cuMemAlloc).
  const char* env = std::getenv("TF_MEMGUARD_CUDA_VMM");
  if (env != nullptr && env[0] == '0') vmm = 0;
  return std::make_unique<cuda_upstream>(d, dev, ctx, device, managed, vmm != 0);
}

}  // namespace tfmg
