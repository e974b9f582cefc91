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

tfmg_status tfmg_replay_step(const tfmg_pool_options* options, const tfmg_step_op* ops, uint64_t count,
                             uint64_t slots, tfmg_step_result* result) {
  if (options == nullptr || result == nullptr || (ops == nullptr && count != 0) || options->max_bytes == 0) {
    return TFMG_ERROR_INVALID_ARGUMENT;
  }
  tfmg_pool* pool = nullptr;
  const tfmg_status made = tfmg_pool_create(options, &pool);
  if (made != TFMG_OK) return made;
  std::memset(result, 0, sizeof *result);
  result->fits = 1;
  result->failed_at = UINT64_MAX;
  std::vector<void*> table(slots, nullptr);
  std::vector<uint64_t> sizes(slots, 0);
  tfmg_pool_layout layout{};
  tfmg_pool_get_layout(pool, &layout);
  int64_t large = 0;  // large blocks live now
  tfmg_stats st;
  for (uint64_t i = 0; i < count; ++i) {
    const tfmg_step_op& op = ops[i];
    if (op.slot >= slots) {
      tfmg_pool_destroy(pool, 1);
      return TFMG_ERROR_INVALID_ARGUMENT;
    }
    auto release = [&](uint32_t slot) {
      if (table[slot] == nullptr) return;
      tfmg_pool_deallocate(pool, table[slot], nullptr);
      if (sizes[slot] >= layout.small_threshold) --large;
      table[slot] = nullptr;
    };
    if (op.flags & TFMG_STEP_FREE) {
      release(op.slot);
      continue;
    }
    void* p = nullptr;
    // A slot still held is freed first (a trace cut at its start can pair them wrongly).
    release(op.slot);
    if (tfmg_pool_allocate(pool, op.size, 0, op.flags & ~TFMG_STEP_FREE, &p) != TFMG_OK) {
      result->fits = 0;
      result->failed_at = i;
      break;
    }
    table[op.slot] = p;
    sizes[op.slot] = op.size;
    if (op.size >= layout.small_threshold) ++large;
    // The peaks move only at allocations.
    tfmg_pool_get_stats(pool, &st);
    const int64_t account = st.bytes_in_use - st.passthrough_bytes_in_use;
    if (st.bytes_reserved > result->peak_bytes_reserved) result->peak_bytes_reserved = st.bytes_reserved;
    if (account > result->peak_account) {
      result->peak_account = account;
      result->blocks_at_peak = st.blocks_in_use;
      result->large_blocks_at_peak = large;
      result->slack_at_peak = st.bytes_reserved - (st.bytes_in_use - st.passthrough_bytes_in_use - st.overshoot_bytes_in_use);
    }
    if (st.overshoot_bytes_in_use > result->peak_overshoot) result->peak_overshoot = st.overshoot_bytes_in_use;
  }
  tfmg_pool_destroy(pool, 1);
  return TFMG_OK;
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
