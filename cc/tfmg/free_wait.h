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
// Oldest first. While a request waits, a later request waits behind it even where it
// would fit, and the waiting requests are served in the order they came: the thread that
// asks next does not take what the waiting kernel needs, and a large request is not
// starved by smaller ones that keep fitting (keras.io's MNIST convnet at 194 under 96
// MiB ran out when later requests went first, and trains oldest first).
//
// Episodes. A step that does not fit makes many requests that do not fit, one after the
// other (a recurrent model's loop went on making them: 33 refusals in one failed step).
// Once a wait has given up, every request waiting then gives up with it, and requests
// that would wait are refused at once until none has been refused for `idle` (the failed
// step has unwound). The episode also ends once the bytes in use fall to what would have
// let the refused request fit (the failed step's memory is gone: in_use_now()), or when
// the caller says the failed step is over (end_episode()). Without those, a retry started
// within `idle` of the last refusal (a user's try/except loop, the advice's own runs) ran
// its steps without waits, and each refusal it then met extended the episode in turn:
// keras.io's timeseries autoencoder, tried at 160, 128, 100 and 80 under 48 MiB in one
// loop, ran out at every size within 0.2 s with no request waiting, where 100 trains
// (benchmarks/NOTES.md, "A retry right after an OOM ran without waits").
//
// The cost when nobody waits: one relaxed atomic load per allocation that may wait and
// per free (waiters_).
#ifndef TFMG_FREE_WAIT_H_
#define TFMG_FREE_WAIT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>

namespace tfmg {

class free_waiter {
 public:
  // Nanoseconds without a free after which a wait gives up; 0: requests never wait.
  void set_idle_ns(std::int64_t ns) { idle_ns_.store(ns < 0 ? 0 : ns, std::memory_order_relaxed); }
  std::int64_t idle_ns() const { return idle_ns_.load(std::memory_order_relaxed); }

  // True while a request waits: a new request then waits behind it (oldest first).
  bool has_waiters() const { return waiters_.load(std::memory_order_seq_cst) != 0; }

  // After a block was freed (or the budget raised), outside the pool's lock.
  void notify() {
    if (waiters_.load(std::memory_order_seq_cst) != 0) notify_slow();
  }
  // After a free, with the bytes then in use: ends a failed episode once they are at or
  // under the level its refused request would have fitted at. One relaxed load otherwise.
  void in_use_now(std::int64_t in_use) {
    const std::int64_t level = episode_level_.load(std::memory_order_relaxed);
    if (level >= 0 && in_use <= level) end_episode();
  }

  // One wait of one request. `try_allocate()` is the pool's quiet attempt (nullptr when
  // it still does not fit); it is called when the request is the oldest waiting, and
  // again after each free. Returns the block, or nullptr once the wait gave up (or the
  // episode failed, or no wait is set): the caller then refuses the request, recorded.
  // *waited_ns gets how long it waited.
  // `fits_at`: the bytes in use at or under which the request would fit (the budget less
  // its size; -1: unknown), the level that ends the episode should this wait give up.
  template <class TryAllocate>
  void* wait(TryAllocate&& try_allocate, std::int64_t* waited_ns, std::int64_t fits_at = -1);

  // The failing step has unwound (its call returned): requests that do not fit wait again.
  void end_episode();

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
  // All under m_.
  void give_up_locked(std::int64_t now, std::int64_t fits_at);
  void leave_locked(std::uint64_t ticket);
  void notify_slow();
  void note_served(std::int64_t waited);

  std::atomic<std::int64_t> idle_ns_{0};
  std::atomic<int> waiters_{0};  // requests in queue_ (read without m_)
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::uint64_t> queue_;  // the waiting requests' tickets, oldest first
  std::uint64_t next_ticket_ = 0;
  std::uint64_t frees_ = 0;     // frees seen while someone waited
  std::uint64_t failures_ = 0;  // waits that gave up
  std::int64_t failed_until_ns_ = 0;  // until then, requests that would wait are refused
  // The bytes in use at or under which the episode ends (in_use_now); -1: none to end.
  std::atomic<std::int64_t> episode_level_{-1};
  std::atomic<std::int64_t> waits_{0}, served_{0}, wait_ns_{0}, longest_ns_{0};
};

template <class TryAllocate>
void* free_waiter::wait(TryAllocate&& try_allocate, std::int64_t* waited_ns, std::int64_t fits_at) {
  *waited_ns = 0;
  const std::int64_t idle = idle_ns();
  if (idle <= 0) return nullptr;
  const std::int64_t start = now_ns();
  std::unique_lock<std::mutex> lock(m_);
  if (start < failed_until_ns_) {
    // A step that is failing: refused at once, and the episode goes on.
    failed_until_ns_ = start + idle;
    return nullptr;
  }
  waits_.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t ticket = next_ticket_++;
  queue_.push_back(ticket);
  waiters_.store(static_cast<int>(queue_.size()), std::memory_order_seq_cst);
  const std::uint64_t failures = failures_;
  std::uint64_t seen = frees_;
  std::int64_t last_free = start;
  void* p = nullptr;
  for (;;) {
    if (failures_ != failures) break;  // the episode failed
    if (frees_ != seen) {
      seen = frees_;
      last_free = now_ns();  // something was freed since the last look: its clock restarts
    }
    if (queue_.front() == ticket) {
      // The oldest: try, without m_ (the pool takes its own lock; frees go on meanwhile
      // and are seen through frees_).
      lock.unlock();
      p = try_allocate();
      lock.lock();
      if (p != nullptr) break;
      if (frees_ != seen) continue;  // freed while it tried: try again
    }
    const std::int64_t now = now_ns();
    if (now - last_free >= idle) {
      give_up_locked(now, fits_at);
      break;
    }
    cv_.wait_for(lock, std::chrono::nanoseconds(last_free + idle - now));
  }
  leave_locked(ticket);
  lock.unlock();
  cv_.notify_all();  // the next oldest may go now
  *waited_ns = now_ns() - start;
  if (p != nullptr) note_served(*waited_ns);
  return p;
}

}  // namespace tfmg

#endif  // TFMG_FREE_WAIT_H_
