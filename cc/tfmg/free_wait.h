// Waiting for memory other threads free, before a request is refused.
//
// TensorFlow's CPU executor runs a training step's kernels on several threads, in an
// order its threads draw anew in every process. Near the budget a kernel's request can
// find the budget taken by tensors that a kernel running on another thread is about to
// release: refused at once, the step fails in one process and trains in the next
// (benchmarks/NOTES.md, "Waiting for frees"). TensorFlow's own BFC allocator waits for
// frees before it reports an out-of-memory error (AllocatorRetry, woken at every free, up
// to kMaxMillisToWait = 10 s). The pool waits the same way, but gives up as soon as no
// block was freed for `idle`: when every thread that could free is itself waiting, or
// idle, nothing will change, and an out-of-memory error should come at once.
//
// Episodes. A step that does not fit makes many requests that do not fit, one after the
// other (a recurrent model's loop went on making them: 33 refusals in one failed step).
// Once a wait has given up, requests that do not fit are refused without waiting until
// none has been refused for `idle` (the failed step has unwound), and the waits going on
// then give up with it.
//
// The cost when nobody waits: deallocate reads one atomic (waiters_), relaxed.
#ifndef TFMG_FREE_WAIT_H_
#define TFMG_FREE_WAIT_H_

#include <atomic>
#include <cstdint>

namespace tfmg {

class free_waiter {
 public:
  // Nanoseconds without a free after which a wait gives up; 0: requests never wait.
  void set_idle_ns(std::int64_t ns) { idle_ns_.store(ns < 0 ? 0 : ns, std::memory_order_relaxed); }
  std::int64_t idle_ns() const { return idle_ns_.load(std::memory_order_relaxed); }

  // After a block was freed (or the budget raised), outside the pool's lock.
  void notify() {
    if (waiters_.load(std::memory_order_seq_cst) != 0) notify_slow();
  }

  // One wait of one request. `try_allocate()` is the pool's quiet attempt (nullptr when
  // it still does not fit); it is called once before sleeping and after each wake-up.
  // Returns the block, or nullptr once the wait gave up (the caller then refuses the
  // request, recorded). *waited_ns gets how long it waited.
  template <class TryAllocate>
  void* wait(TryAllocate&& try_allocate, std::int64_t* waited_ns);

  struct counters {
    std::int64_t waits = 0;         // requests that waited
    std::int64_t served = 0;        // of them, served after waiting
    std::int64_t wait_ns = 0;       // the time the served ones waited, in all
    std::int64_t longest_ns = 0;    // the longest a served request waited
  };
  counters stats() const;
  void clear_stats();

  static std::int64_t now_ns();

 private:
  // Returns false when the wait should give up now (no free for idle, or the episode
  // failed). `last_free_ns` is when the last free was seen (the wait's start at first).
  bool sleep(std::uint32_t seen, std::int64_t* last_free_ns, std::uint32_t failures);
  void give_up(std::int64_t now);
  void notify_slow();
  void note_served(std::int64_t waited);

  std::atomic<std::int64_t> idle_ns_{0};
  std::atomic<int> waiters_{0};
  // Bumped at every free while someone waits: the futex word waiters sleep on.
  std::atomic<std::uint32_t> frees_{0};
  // Bumped when a wait gives up: the waits going on give up too.
  std::atomic<std::uint32_t> failures_{0};
  // Until then (steady clock, ns) requests that do not fit are refused without waiting.
  std::atomic<std::int64_t> failed_until_ns_{0};
  std::atomic<std::int64_t> waits_{0}, served_{0}, wait_ns_{0}, longest_ns_{0};
};

template <class TryAllocate>
void* free_waiter::wait(TryAllocate&& try_allocate, std::int64_t* waited_ns) {
  *waited_ns = 0;
  const std::int64_t idle = idle_ns();
  if (idle <= 0) return nullptr;
  const std::int64_t start = now_ns();
  if (start < failed_until_ns_.load(std::memory_order_relaxed)) {
    // A step that is failing: refused at once, and the episode goes on.
    failed_until_ns_.store(start + idle, std::memory_order_relaxed);
    return nullptr;
  }
  waits_.fetch_add(1, std::memory_order_relaxed);
  // Registered before the attempt: a free after it (under the pool's lock) then sees a
  // waiter and bumps frees_, so the sleep below cannot miss it.
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  const std::uint32_t failures = failures_.load(std::memory_order_acquire);
  std::int64_t last_free = start;
  void* p = nullptr;
  for (;;) {
    const std::uint32_t seen = frees_.load(std::memory_order_acquire);
    p = try_allocate();
    if (p != nullptr || !sleep(seen, &last_free, failures)) break;
  }
  waiters_.fetch_sub(1, std::memory_order_seq_cst);
  *waited_ns = now_ns() - start;
  if (p != nullptr) note_served(*waited_ns);
  return p;
}

}  // namespace tfmg

#endif  // TFMG_FREE_WAIT_H_
