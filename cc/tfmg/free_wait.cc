#include "cc/tfmg/free_wait.h"

#include <algorithm>
#include <chrono>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace tfmg {

std::int64_t free_waiter::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool free_waiter::sleep(std::uint32_t seen, std::int64_t* last_free_ns, std::uint32_t failures) {
  const std::int64_t idle = idle_ns();
  for (;;) {
    if (failures_.load(std::memory_order_acquire) != failures) return false;  // the episode failed
    const std::int64_t now = now_ns();
    if (frees_.load(std::memory_order_acquire) != seen) {
      *last_free_ns = now;
      return true;  // something was freed: try again
    }
    const std::int64_t left = *last_free_ns + idle - now;
    if (left <= 0) {
      give_up(now);
      return false;
    }
#if defined(__linux__)
    timespec ts;
    ts.tv_sec = static_cast<time_t>(left / 1000000000);
    ts.tv_nsec = static_cast<long>(left % 1000000000);
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&frees_), FUTEX_WAIT_PRIVATE, seen, &ts, nullptr, 0);
#else
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::min<std::int64_t>(left, 1000000)));
#endif
  }
}

void free_waiter::give_up(std::int64_t now) {
  failed_until_ns_.store(now + idle_ns(), std::memory_order_relaxed);
  failures_.fetch_add(1, std::memory_order_acq_rel);
  // The other waits of the episode wake and see failures_ changed.
  frees_.fetch_add(1, std::memory_order_acq_rel);
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&frees_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

void free_waiter::notify_slow() {
  frees_.fetch_add(1, std::memory_order_acq_rel);
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&frees_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

void free_waiter::note_served(std::int64_t waited) {
  served_.fetch_add(1, std::memory_order_relaxed);
  wait_ns_.fetch_add(waited, std::memory_order_relaxed);
  std::int64_t longest = longest_ns_.load(std::memory_order_relaxed);
  while (waited > longest && !longest_ns_.compare_exchange_weak(longest, waited, std::memory_order_relaxed)) {
  }
}

free_waiter::counters free_waiter::stats() const {
  counters c;
  c.waits = waits_.load(std::memory_order_relaxed);
  c.served = served_.load(std::memory_order_relaxed);
  c.wait_ns = wait_ns_.load(std::memory_order_relaxed);
  c.longest_ns = longest_ns_.load(std::memory_order_relaxed);
  return c;
}

void free_waiter::clear_stats() {
  waits_.store(0, std::memory_order_relaxed);
  served_.store(0, std::memory_order_relaxed);
  wait_ns_.store(0, std::memory_order_relaxed);
  longest_ns_.store(0, std::memory_order_relaxed);
}

}  // namespace tfmg
