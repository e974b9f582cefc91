// Replays an allocation trace against a pool or the system allocator, timing only the
// allocator calls' loop (no Python, no I/O per operation). Used by the benchmarks and
// by tests that replay recorded traces.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <deque>
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

// A step's ops applied to a fresh pool, with its peaks noted (tfmg_replay_step).
class step_replayer {
 public:
  step_replayer(tfmg_pool* pool, uint64_t slots, tfmg_step_result* result)
      : pool_(pool), table_(slots, nullptr), sizes_(slots, 0), result_(result) {
    tfmg_pool_get_layout(pool, &layout_);
  }

  void run_in_order(const tfmg_step_op* ops, uint64_t count) {
    for (uint64_t i = 0; i < count; ++i) {
      if (ops[i].flags & TFMG_STEP_FREE) {
        release(ops[i].slot);
      } else if (!allocate(ops[i], TFMG_ALLOC_DEFAULT)) {
        result_->fits = 0;
        result_->failed_at = i;
        return;
      }
    }
  }

  // Each thread's ops in their order, interleaved as given; see tfmg_replay_step's
  // "waiting 1". Every thread has a backlog (its ops not applied yet, oldest first); a
  // thread whose backlog starts with a request that waits is in queue_, oldest first.
  void run_waiting(const tfmg_step_op* ops, uint64_t count) {
    ops_ = ops;
    uint32_t threads = 0;
    for (uint64_t i = 0; i < count; ++i) threads = std::max(threads, ops[i].thread + 1);
    backlog_.assign(threads, {});
    queued_.assign(threads, false);
    pending_.assign(table_.size(), false);
    for (uint64_t i = 0; i < count && !failed_; ++i) {
      const tfmg_step_op& op = ops[i];
      if (!(op.flags & TFMG_STEP_FREE)) pending_[op.slot] = true;
      backlog_[op.thread].push_back(i);
      advance(op.thread);
      if (freed_) settle();
    }
    if (!failed_) settle();
    if (failed_) result_->fits = 0;
    for (const auto& q : backlog_) {
      if (!q.empty()) {
        result_->fits = 0;
        result_->failed_at = std::min(result_->failed_at, q.front());
      }
    }
  }

  ~step_replayer() {
    for (void* p : table_) {
      if (p != nullptr) tfmg_pool_deallocate(pool_, p, nullptr);
    }
  }

 private:
  // Applies thread t's backlog as far as it goes: frees (but of a block whose allocation
  // still waits), and requests while none waits and they fit; a request that does not,
  // or that comes while others wait, joins the queue.
  void advance(uint32_t t) {
    auto& q = backlog_[t];
    while (!q.empty() && !queued_[t]) {
      const tfmg_step_op& op = ops_[q.front()];
      if (op.flags & TFMG_STEP_FREE) {
        if (pending_[op.slot]) return;  // it needs a block not allocated yet
        if (table_[op.slot] != nullptr) freed_ = true;
        release(op.slot);
      } else if (!waits(op)) {
        // As the pool serves it: at once, beside any queue (granted as overshoot where it
        // must succeed); one that is refused fails the step.
        if (!allocate(op, TFMG_ALLOC_QUIET)) {
          failed_ = true;
          result_->failed_at = std::min(result_->failed_at, q.front());
          return;
        }
        pending_[op.slot] = false;
      } else if (!queue_.empty() || !allocate(op, TFMG_ALLOC_QUIET)) {
        queue_.push_back(t);
        queued_[t] = true;
        ++result_->waits;
        return;
      } else {
        pending_[op.slot] = false;
      }
      q.pop_front();
    }
  }

  // Which requests wait as the TensorFlow glue asks for them (TFMG_ALLOC_WAIT): kernels'
  // and tf.data's that can be refused. The rest (overshoot, constants, runtime buffers)
  // are served or refused at once.
  static bool waits(const tfmg_step_op& op) {
    if (op.flags & TFMG_ALLOC_MUST_SUCCEED) return false;
    const unsigned kind = (op.flags >> TFMG_ALLOC_KIND_SHIFT) & 15u;
    return kind == TFMG_KIND_KERNEL || kind == TFMG_KIND_DATA;
  }

  // After frees: the queue's oldest requests while they fit, and the threads as far as
  // they go, until nothing moves.
  void settle() {
    while (freed_ && !failed_) {
      freed_ = false;
      while (!queue_.empty()) {
        const uint32_t t = queue_.front();
        const tfmg_step_op& op = ops_[backlog_[t].front()];
        if (!allocate(op, TFMG_ALLOC_QUIET)) break;
        pending_[op.slot] = false;
        backlog_[t].pop_front();
        queue_.pop_front();
        queued_[t] = false;
        freed_ = true;  // a thread goes on: look again
      }
      for (uint32_t t = 0; t < backlog_.size(); ++t) {
        if (!queued_[t] && !backlog_[t].empty()) {
          const std::size_t before = backlog_[t].size();
          advance(t);
          if (backlog_[t].size() != before) freed_ = true;
        }
      }
    }
  }

  void release(uint32_t slot) {
    if (table_[slot] == nullptr) return;
    tfmg_pool_deallocate(pool_, table_[slot], nullptr);
    if (sizes_[slot] >= layout_.small_threshold) --large_;
    table_[slot] = nullptr;
  }

  bool allocate(const tfmg_step_op& op, uint32_t quiet) {
    // A slot still held is freed first (a trace cut at its start can pair them wrongly).
    release(op.slot);
    void* p = nullptr;
    if (tfmg_pool_allocate(pool_, op.size, 0, (op.flags & ~TFMG_STEP_FREE) | quiet, &p) != TFMG_OK) return false;
    table_[op.slot] = p;
    sizes_[op.slot] = op.size;
    if (op.size >= layout_.small_threshold) ++large_;
    note_peaks();
    return true;
  }

  // The peaks move only at allocations.
  void note_peaks() {
    tfmg_stats st;
    tfmg_pool_get_stats(pool_, &st);
    const int64_t account = st.bytes_in_use - st.passthrough_bytes_in_use;
    tfmg_step_result* r = result_;
    if (st.bytes_reserved > r->peak_bytes_reserved) r->peak_bytes_reserved = st.bytes_reserved;
    if (account > r->peak_account) {
      r->peak_account = account;
      r->blocks_at_peak = st.blocks_in_use;
      r->large_blocks_at_peak = large_;
      r->slack_at_peak =
          st.bytes_reserved - (st.bytes_in_use - st.passthrough_bytes_in_use - st.overshoot_bytes_in_use);
    }
    if (st.overshoot_bytes_in_use > r->peak_overshoot) r->peak_overshoot = st.overshoot_bytes_in_use;
  }

  tfmg_pool* pool_;
  std::vector<void*> table_;
  std::vector<uint64_t> sizes_;
  tfmg_step_result* result_;
  tfmg_pool_layout layout_{};
  int64_t large_ = 0;  // large blocks live now
  const tfmg_step_op* ops_ = nullptr;
  std::vector<std::deque<uint64_t>> backlog_;  // per thread: its ops not applied yet, in order
  std::vector<bool> queued_;                   // per thread: its first op is a waiting request
  std::deque<uint32_t> queue_;                 // the threads whose requests wait, oldest first
  std::vector<bool> pending_;                  // per slot: its allocation is not applied yet
  bool freed_ = false;                         // a free (or a served request) since settle()
  bool failed_ = false;                        // a request that does not wait was refused
};

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
                             uint64_t slots, int waiting, tfmg_step_result* result) {
  if (options == nullptr || result == nullptr || (ops == nullptr && count != 0) || options->max_bytes == 0) {
    return TFMG_ERROR_INVALID_ARGUMENT;
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (ops[i].slot >= slots) return TFMG_ERROR_INVALID_ARGUMENT;
  }
  tfmg_pool* pool = nullptr;
  const tfmg_status made = tfmg_pool_create(options, &pool);
  if (made != TFMG_OK) return made;
  std::memset(result, 0, sizeof *result);
  result->fits = 1;
  result->failed_at = UINT64_MAX;
  {
    step_replayer r(pool, slots, result);  // frees what it holds before the pool goes
    if (waiting) {
      r.run_waiting(ops, count);
    } else {
      r.run_in_order(ops, count);
    }
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
