// Drives tf_memguard's PyTorch glue (libtfmg_torch.so) the way PyTorch's pluggable
// allocator does, over a pool of host memory standing in for GPU:0 (the glue only
// sees the core's pool): a request over the budget must throw c10::OutOfMemoryError
// with the explanation, never return null, and leave the pool serving. Built and run
// by tests/python/test_torch.py against the installed PyTorch's headers and libc10.
#include <sys/types.h>

#include <cstdio>
#include <cstring>

#include <c10/util/Exception.h>

#include "cc/tfmg/c_api.h"

extern "C" void* tfmg_torch_malloc(ssize_t size, int device, void* stream);
extern "C" void tfmg_torch_free(void* ptr, ssize_t size, int device, void* stream);

int main() {
  tfmg_pool_options o;
  tfmg_pool_options_init(&o);  // host upstream
  tfmg_pool* pool = nullptr;
  if (tfmg_device_pool_configure("GPU:0", &o) != TFMG_OK || tfmg_device_pool_find("GPU:0", &pool) != TFMG_OK ||
      tfmg_pool_set_limit(pool, 8 << 20) != TFMG_OK) {
    std::printf("setup failed: %s\n", tfmg_last_error());
    return 2;
  }
  void* a = tfmg_torch_malloc(1 << 20, 0, nullptr);
  if (a == nullptr) return 3;
  std::memset(a, 1, 1 << 20);
  bool thrown = false;
  try {
    void* b = tfmg_torch_malloc(16 << 20, 0, nullptr);
    std::printf("not refused: %p\n", b);
    return 4;
  } catch (const c10::OutOfMemoryError& e) {
    thrown = true;
    std::printf("OutOfMemoryError: %s\n", e.what_without_backtrace());
  }
  void* c = tfmg_torch_malloc(4 << 20, 0, nullptr);  // still serving after the refusal
  if (c == nullptr) return 5;
  tfmg_torch_free(c, 4 << 20, 0, nullptr);
  tfmg_torch_free(a, 1 << 20, 0, nullptr);
  tfmg_stats s;
  tfmg_pool_get_stats(pool, &s);
  std::printf("in use after frees: %lld, refusals: %lld\n", (long long)s.bytes_in_use, (long long)s.num_refusals);
  return thrown && s.bytes_in_use == 0 && s.num_refusals == 1 ? 0 : 6;
}
