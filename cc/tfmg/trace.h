// A bounded recorder of allocation events, for replay by benchmarks and reports.
//
// A ring buffer: when full, the oldest event is overwritten and counted as dropped, so
// a long run keeps its most recent `capacity` events and memory stays bounded. Not
// thread-safe on its own; the pool calls it under its lock.
#ifndef TFMG_TRACE_H_
#define TFMG_TRACE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cc/tfmg/c_api.h"

namespace tfmg {

// A small number per thread, 0, 1, ... in the order threads first ask: which thread made
// an event, for replays that let each thread's requests wait on their own.
inline std::uint32_t thread_index() {
  static std::atomic<std::uint32_t> next{0};
  thread_local const std::uint32_t index = next.fetch_add(1, std::memory_order_relaxed);
  return index;
}

class trace_recorder {
 public:
  explicit trace_recorder(std::size_t capacity) : capacity_(capacity) {}

  bool enabled() const { return capacity_ != 0; }

  void record(tfmg_trace_op op, int region, std::uint64_t size, std::uint64_t offset,
              std::uint64_t address, std::uint32_t flags = 0) {
    if (capacity_ == 0) return;
    tfmg_trace_event e{sequence_++, static_cast<std::uint32_t>(op), region, size, offset,
                       address, flags & ~(TFMG_ALLOC_QUIET | TFMG_ALLOC_WAIT), thread_index()};
    if (events_.size() < capacity_) {
      events_.push_back(e);
    } else {
      events_[head_] = e;
      head_ = (head_ + 1) % capacity_;
      ++dropped_;
    }
  }

  // Oldest first.
  std::vector<tfmg_trace_event> events() const {
    std::vector<tfmg_trace_event> out;
    out.reserve(events_.size());
    for (std::size_t i = 0; i < events_.size(); ++i) {
      out.push_back(events_[(head_ + i) % events_.size()]);
    }
    return out;
  }

  std::uint64_t dropped() const { return dropped_; }

  void clear() {
    events_.clear();
    head_ = 0;
    dropped_ = 0;
  }

  // Cleared, and keeping up to `capacity` events from now on (0: off; the events
  // recorded stay readable). Memory reserved once is kept: a recorder restarted at every
  // training step allocates nothing after the first.
  void restart(std::size_t capacity) {
    if (capacity == 0) {
      capacity_ = 0;
      return;
    }
    clear();
    capacity_ = capacity;
    events_.reserve(capacity < 65536 ? capacity : 65536);
  }

 private:
  std::size_t capacity_;
  std::vector<tfmg_trace_event> events_;
  std::size_t head_ = 0;  // index of the oldest event once the buffer is full
  std::uint64_t sequence_ = 0;
  std::uint64_t dropped_ = 0;
};

}  // namespace tfmg

#endif  // TFMG_TRACE_H_
