// The pool's lock: a mutex whose uncontended lock and unlock are one atomic instruction
// each, inline (no call into the C library).
//
// Why not std::mutex: on glibc its lock and unlock are calls into pthread_mutex_lock and
// pthread_mutex_unlock, which check the mutex's type, elision and owner before the atomic
// operation: 53 instructions per allocate/free pair on churn_2000 (callgrind), 9% of the
// pool's instructions there, where the lock is nearly never contended (benchmarks/NOTES.md,
// "Fewer instructions and cache lines per call").
//
// The algorithm is the three-state futex mutex of U. Drepper, "Futexes Are Tricky"
// (2011), mutex #3: 0 free, 1 held, 2 held with (possible) waiters. A contended lock
// spins briefly first (the pool's critical sections are some hundred nanoseconds), then
// sleeps in the kernel; unlock wakes one sleeper only when there may be one. Off Linux,
// std::mutex. Satisfies Lockable, so std::lock_guard takes it.
#ifndef TFMG_LOCK_H_
#define TFMG_LOCK_H_

#include <atomic>
#include <mutex>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tfmg {

#if defined(__linux__)

class pool_lock {
 public:
  pool_lock() = default;
  pool_lock(const pool_lock&) = delete;
  pool_lock& operator=(const pool_lock&) = delete;

  void lock() {
    int c = 0;
    if (state_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
    lock_contended(c);
  }

  bool try_lock() {
    int c = 0;
    return state_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }

  void unlock() {
    if (state_.fetch_sub(1, std::memory_order_release) != 1) {
      state_.store(0, std::memory_order_release);
      wake();
    }
  }

 private:
  // Spins before sleeping: 200 pauses are a few microseconds, longer than the pool's
  // critical sections (tens to hundreds of nanoseconds) and about what a sleep and a
  // wake in the kernel cost, so a waiter sleeps only when the holder was descheduled.
  static constexpr int kSpins = 200;

  __attribute__((noinline)) void lock_contended(int c) {
    for (int i = 0; i < kSpins && c != 0; ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      c = state_.load(std::memory_order_relaxed);
      if (c == 0 && state_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed)) {
        return;
      }
    }
    // From here on the lock is marked "with waiters" whenever this thread holds it or
    // waits for it: an unlock then always wakes, so no sleeper is left behind.
    if (c != 2) c = state_.exchange(2, std::memory_order_acquire);
    while (c != 0) {
      syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
      c = state_.exchange(2, std::memory_order_acquire);
    }
  }

  __attribute__((noinline)) void wake() {
    syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }

  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic itself");
  std::atomic<int> state_{0};
};

#else

using pool_lock = std::mutex;

#endif

}  // namespace tfmg

#endif  // TFMG_LOCK_H_
