#include "cc/tfmg/free_wait.h"

#include <algorithm>
#include <chrono>

namespace tfmg {

std::int64_t free_waiter::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void free_waiter::give_up_locked(std::int64_t now, std::int64_t fits_at) {
  failed_until_ns_ = now + idle_ns();
  episode_level_.store(fits_at, std::memory_order_relaxed);
  ++failures_;  // the other waits of the episode see it and give up too
}

void free_waiter::end_episode() {
  std::lock_guard<std::mutex> lock(m_);
  failed_until_ns_ = 0;
  episode_level_.store(-1, std::memory_order_relaxed);
}

void free_waiter::leave_locked(std::uint64_t ticket) {
  auto it = std::find(queue_.begin(), queue_.end(), ticket);
  if (it != queue_.end()) queue_.erase(it);
  waiters_.store(static_cast<int>(queue_.size()), std::memory_order_seq_cst);
}

void free_waiter::notify_slow() {
  {
    std::lock_guard<std::mutex> lock(m_);
    ++frees_;
  }
  cv_.notify_all();
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
