// Replays an allocation trace against a pool or the system allocator, timing only the
// allocator calls' loop (no Python, no I/O per operation). Used by the benchmarks and
// by tests that replay recorded traces.
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "cc/tfmg/c_api.h"

namespace {

template <class Alloc, class Free>
tfmg_status replay(const tfmg_replay_op* ops, uint64_t count, uint64_t slots,
                   tfmg_replay_result* result, Alloc&& alloc, Free&& free_fn) {
  std::vector<void*> table(slots, nullptr);
  std::memset(result, 0, sizeof *result);
  result->failed_at = UINT64_MAX;
  const auto start = std::chrono::steady_clock::now();
  uint64_t i = 0;
  for (; i < count; ++i) {
    const tfmg_replay_op& op = ops[i];
    if (op.slot >= slots) break;
    if (op.is_free) {
      free_fn(table[op.slot]);
      table[op.slot] = nullptr;
    } else {
      void* p = alloc(op.size);
      if (p == nullptr) break;
      table[op.slot] = p;
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  result->elapsed_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(stop - start).count());
  result->completed = i;
  if (i < count) result->failed_at = i;
  // Leave nothing behind, whether the trace completed or not (not timed).
  for (void* p : table) {
    if (p != nullptr) free_fn(p);
  }
  return TFMG_OK;
}

}  // namespace

extern "C" {

tfmg_status tfmg_replay_pool(tfmg_pool* pool, const tfmg_replay_op* ops, uint64_t count,
                             uint64_t slots, tfmg_replay_result* result) {
  if (pool == nullptr || result == nullptr || (ops == nullptr && count != 0)) {
    return TFMG_ERROR_INVALID_ARGUMENT;
  }
  return replay(
      ops, count, slots, result,
      [pool](uint64_t n) {
        void* p = nullptr;
        tfmg_pool_allocate(pool, n, 0, TFMG_ALLOC_DEFAULT, &p);
        return p;
      },
      [pool](void* p) { tfmg_pool_deallocate(pool, p, nullptr); });
}

tfmg_status tfmg_replay_system(const tfmg_replay_op* ops, uint64_t count, uint64_t slots,
                               uint64_t alignment, tfmg_replay_result* result) {
  if (result == nullptr || (ops == nullptr && count != 0)) return TFMG_ERROR_INVALID_ARGUMENT;
  if (alignment < sizeof(void*)) alignment = sizeof(void*);
  return replay(
      ops, count, slots, result,
      [alignment](uint64_t n) {
        void* p = nullptr;
        return posix_memalign(&p, alignment, n == 0 ? 1 : n) == 0 ? p : nullptr;
      },
      [](void* p) { free(p); });
}

}  // extern "C"
