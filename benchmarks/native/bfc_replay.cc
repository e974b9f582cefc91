// Replays an allocation trace (benchmarks/traces.py) through TensorFlow's own
// BFCAllocator, from the installed wheel, as TensorFlow builds it for the CPU under
// TF_CPU_ALLOCATOR_USE_BFC=true (process_state.cc: a BFCAllocator over a CPU
// sub-allocator, allow_growth, TF_CPU_BFC_MEM_LIMIT_IN_MB as its total memory).
// Built by benchmarks/alloc_latency.py against tf.sysconfig; not part of the package.
//
// One difference from TensorFlow's: allow_retry_on_failure is off, so that a failed
// request returns at once instead of sleeping in the hope of another thread's free (a
// single-threaded replay has none). Placement is the same code either way.
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/tsl/framework/allocator.h"
#include "xla/tsl/framework/bfc_allocator.h"

namespace {

// posix_memalign, as TensorFlow's CPU sub-allocator takes host memory (port::AlignedMalloc).
class HostSubAllocator : public tsl::SubAllocator {
 public:
  HostSubAllocator() : tsl::SubAllocator({}, {}) {}
  void* Alloc(size_t alignment, size_t num_bytes, size_t* bytes_received) override {
    void* p = nullptr;
    if (alignment < sizeof(void*)) alignment = sizeof(void*);
    if (posix_memalign(&p, alignment, num_bytes) != 0) return nullptr;
    *bytes_received = num_bytes;
    return p;
  }
  void Free(void* ptr, size_t) override { free(ptr); }
  bool SupportsCoalescing() const override { return false; }
};

}  // namespace

extern "C" {

// Returns 0 when every allocation of the trace succeeded, else 1 with *failed_at the
// index of the first that failed. *elapsed_ns is the replay's time (allocator made and
// destroyed outside it).
int tfmg_bfc_replay(const uint64_t* sizes, const uint32_t* slots, const uint32_t* is_free, int64_t n,
                    uint32_t nslots, uint64_t total_memory, int64_t* elapsed_ns, int64_t* failed_at) {
  tsl::BFCAllocator::Options opts;
  opts.allow_growth = true;
  opts.allow_retry_on_failure = false;
  auto bfc = std::make_unique<tsl::BFCAllocator>(std::make_unique<HostSubAllocator>(), total_memory,
                                                 "tfmg_bfc_replay", opts);
  std::vector<void*> live(nslots, nullptr);
  *failed_at = -1;
  tsl::AllocationAttributes attrs;
  attrs.retry_on_failure = false;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    if (is_free[i]) {
      bfc->DeallocateRaw(live[slots[i]]);
      live[slots[i]] = nullptr;
    } else {
      void* p = bfc->AllocateRaw(64, sizes[i], attrs);
      if (p == nullptr) {
        *failed_at = i;
        break;
      }
      live[slots[i]] = p;
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  *elapsed_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  for (void* p : live)
    if (p != nullptr) bfc->DeallocateRaw(p);
  return *failed_at < 0 ? 0 : 1;
}

}  // extern "C"
