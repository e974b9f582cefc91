// PyTorch glue: the two functions torch.cuda.memory.CUDAPluggableAllocator calls, over
// the core's process-wide pool of each GPU ("GPU:<n>", CUDA upstream). Loaded by
// PyTorch (ctypes) from tf_memguard/libtfmg_torch.so; linked to libtfmg_core.so beside
// it, so it shares the pools that tf_memguard._core configures and reads.
//
// A refusal must not return a null pointer: PyTorch's pluggable allocator does not
// check, so the tensor would get address 0 and the first kernel that touches it
// faults, which leaves the CUDA context unusable (every later cuBLAS call fails with
// CUBLAS_STATUS_EXECUTION_FAILED). A refusal throws c10::OutOfMemoryError instead,
// which PyTorch turns into torch.OutOfMemoryError with this glue's explanation; nothing
// was launched, so the process goes on.
//
// Streams. The pool hands a freed block out again at once. That is safe in stream
// order when every allocation of a device uses one stream, as Keras does. When calls
// switch to another stream, the stream used before is synchronized first, so no block
// freed on it can be reused while its kernels run. A block used on a second stream
// (Tensor.record_stream) is not tracked: the pluggable interface passes no such event.
#include <dlfcn.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include <c10/util/Exception.h>

#include "cc/tfmg/c_api.h"

#define TFMG_TORCH_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxDevices = 64;

struct device_state {
  std::atomic<tfmg_pool*> pool{nullptr};
  std::mutex stream_mutex;
  void* last_stream = nullptr;
  bool seen = false;
};

device_state g_devices[kMaxDevices];
std::once_flag g_sync_once;
int (*g_stream_synchronize)(void*) = nullptr;  // cuStreamSynchronize

std::string device_name(int device) { return "GPU:" + std::to_string(device); }

// The pool of a device: the one install() configured, else a pass-through pool over
// CUDA memory (counted, no budget) so that PyTorch is served on every device.
tfmg_pool* pool_of(int device, std::string* why) {
  if (device < 0 || device >= kMaxDevices) {
    *why = "device " + std::to_string(device) + " is out of range";
    return nullptr;
  }
  tfmg_pool* p = g_devices[device].pool.load(std::memory_order_acquire);
  if (p != nullptr) return p;
  const std::string name = device_name(device);
  if (tfmg_device_pool_find(name.c_str(), &p) != TFMG_OK) {
    tfmg_pool_options o;
    tfmg_pool_options_init(&o);
    o.upstream = TFMG_UPSTREAM_CUDA;
    o.device = device;
    if (tfmg_device_pool_configure(name.c_str(), &o) != TFMG_OK ||
        tfmg_device_pool_find(name.c_str(), &p) != TFMG_OK) {
      *why = tfmg_last_error();
      return nullptr;
    }
  }
  g_devices[device].pool.store(p, std::memory_order_release);
  return p;
}

void note_stream(int device, void* stream) {
  device_state& d = g_devices[device];
  std::lock_guard<std::mutex> lock(d.stream_mutex);
  if (d.seen && d.last_stream == stream) return;
  if (d.seen) {
    std::call_once(g_sync_once, [] {
      void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      if (h != nullptr) {
        g_stream_synchronize = reinterpret_cast<int (*)(void*)>(dlsym(h, "cuStreamSynchronize"));
      }
    });
    if (g_stream_synchronize != nullptr) g_stream_synchronize(d.last_stream);
  }
  d.last_stream = stream;
  d.seen = true;
}

// Allocates, or writes the explanation of why not into *message.
tfmg_status try_allocate(int64_t size, int device, void* stream, void** out, std::string* message) {
  *out = nullptr;
  if (size < 0) {
    *message = "tf_memguard: a negative allocation size (" + std::to_string(size) + ") from PyTorch";
    return TFMG_ERROR_INVALID_ARGUMENT;
  }
  std::string why;
  tfmg_pool* p = pool_of(device, &why);
  if (p == nullptr) {
    *message = "tf_memguard: no pool for CUDA device " + std::to_string(device) + ": " + why;
    return TFMG_ERROR_UPSTREAM;
  }
  note_stream(device, stream);
  const tfmg_status st = tfmg_pool_allocate(p, static_cast<uint64_t>(size), 0, TFMG_ALLOC_DEFAULT, out);
  if (st == TFMG_OK) return st;
  if (st == TFMG_ERROR_OUT_OF_MEMORY) {
    *message = "tf_memguard: CUDA out of memory on " + device_name(device) + " under the budget of "
               "tf_memguard.install(): " + tfmg_last_error();
  } else {
    *message = "tf_memguard: allocating " + std::to_string(size) + " bytes on " + device_name(device) +
               " failed: " + tfmg_last_error();
  }
  return st;
}

}  // namespace

// torch.cuda.memory.CUDAPluggableAllocator's alloc_fn: never returns null for a
// request it cannot serve; it throws torch's out-of-memory error (see the top).
TFMG_TORCH_API void* tfmg_torch_malloc(ssize_t size, int device, void* stream) {
  void* out = nullptr;
  std::string message;
  const tfmg_status st = try_allocate(size, device, stream, &out, &message);
  if (st == TFMG_OK) return out;
  if (st == TFMG_ERROR_OUT_OF_MEMORY) TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  TORCH_CHECK(false, message);
  return nullptr;
}

// free_fn: called from tensor destructors, so it must not throw; a pointer the pool
// does not know is reported once on stderr and otherwise ignored.
TFMG_TORCH_API void tfmg_torch_free(void* ptr, ssize_t /*size*/, int device, void* stream) {
  if (ptr == nullptr) return;
  std::string why;
  tfmg_pool* p = pool_of(device, &why);
  if (p == nullptr) return;
  note_stream(device, stream);
  if (tfmg_pool_deallocate(p, ptr, nullptr) != TFMG_OK) {
    static std::atomic<bool> told{false};
    if (!told.exchange(true)) {
      std::fprintf(stderr, "tf_memguard: PyTorch freed memory its pool does not hold: %s\n", tfmg_last_error());
    }
  }
}

// The same allocation without exceptions, for tests and tools: 0 and *out, or the
// status with the explanation in message (truncated to message_size).
TFMG_TORCH_API int tfmg_torch_try_malloc(int64_t size, int device, void* stream, void** out, char* message,
                                         uint64_t message_size) {
  std::string text;
  const tfmg_status st = try_allocate(size, device, stream, out, &text);
  if (message != nullptr && message_size > 0) {
    std::snprintf(message, message_size, "%s", text.c_str());
  }
  return static_cast<int>(st);
}
