// CUDA device memory upstream, through the CUDA driver API loaded at run time
// (dlopen("libcuda.so.1")): the core builds, imports and runs without CUDA, and says
// clearly when there is no driver or GPU. Regions come from cuMemAlloc (or
// cuMemAllocManaged, prefetched to the device, for the managed variant) and go back
// with cuMemFree when released. Blocks are 256-byte aligned (what GPU kernels expect).
#include <dlfcn.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

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
  cuda_upstream(const driver* d, CUdevice dev, CUcontext ctx, int ordinal, bool managed)
      : d_(d), dev_(dev), ctx_(ctx), ordinal_(ordinal), managed_(managed) {
    d_->device_total_mem(&total_, dev_);
  }

  void* allocate(std::size_t bytes, std::size_t /*alignment*/, bool /*region*/) override {
    // cuMemAlloc's pointers are aligned to at least 256 bytes; regions ask for no more.
    d_->ctx_set_current(ctx_);
    CUdeviceptr p = 0;
    if (managed_) {
      if (d_->mem_alloc_managed(&p, bytes == 0 ? 1 : bytes, kAttachGlobal) != 0) return nullptr;
      if (d_->prefetch_v2 != nullptr) d_->prefetch_v2(p, bytes, CUmemLocation{1, ordinal_}, 0, nullptr);
    } else if (d_->mem_alloc(&p, bytes == 0 ? 1 : bytes) != 0) {
      return nullptr;
    }
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
  }

  void deallocate(void* p, std::size_t, std::size_t, bool) override {
    if (p == nullptr) return;
    d_->ctx_set_current(ctx_);
    d_->mem_free(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)));
  }

  std::size_t default_alignment() const override { return 256; }
  std::size_t page_size() const override { return 2u << 20; }  // the driver's granularity
  std::size_t total_memory() const override { return total_; }
  const char* name() const override { return managed_ ? "CUDA managed" : "CUDA device"; }

 private:
  const driver* d_;
  CUdevice dev_;
  CUcontext ctx_;
  int ordinal_;
  bool managed_;
  std::size_t total_ = 0;
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
  return std::make_unique<cuda_upstream>(d, dev, ctx, device, managed);
}

}  // namespace tfmg
