// An open-addressing hash map from block addresses to block records.
//
// Why not std::unordered_map: every lookup there chases a bucket pointer and a node
// pointer (two cache misses) and every insert allocates. Here a lookup is usually one
// probe into one flat array. Linear probing, load kept at or under 1/4, deletion by
// backward shift (no tombstones, so probe chains never grow with churn). Address 0 marks
// an empty slot; the pool never stores it. Not thread-safe: the pool's lock guards it.
//
// Why a load of 1/4 and not 1/2: where a probe chain ends is a branch the processor
// cannot predict; at 1/4 most lookups end at the first slot. On churn_2000 that took
// the pool from 81 to 71 ns per operation (same process, interleaved; benchmarks/NOTES.md,
// "Fewer instructions and cache lines per call"), for 32 bytes of table per block in use.
// 1/8 gained 2 ns more there and lost 6 on churn_10000 (the table outgrows the cache).
#ifndef TFMG_ADDR_MAP_H_
#define TFMG_ADDR_MAP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tfmg {

template <class V>
class addr_map {
 public:
  addr_map() { rehash(64); }

  std::size_t size() const { return size_; }

  // Returns the value for key, or V{} if absent.
  V find(std::uintptr_t key) const {
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      const entry& e = table_[i];
      if (e.key == key) return e.value;
      if (e.key == 0) return V{};
    }
  }

  // Key must be absent and non-zero.
  void insert(std::uintptr_t key, V value) {
    if (__builtin_expect(4 * (size_ + 1) > mask_ + 1, 0)) grow();
    std::size_t i = slot(key);
    while (table_[i].key != 0) i = (i + 1) & mask_;
    table_[i] = entry{key, value};
    ++size_;
  }

  // Removes key and returns its value, or V{} if absent.
  V erase(std::uintptr_t key) {
    std::size_t i = slot(key);
    for (;; i = (i + 1) & mask_) {
      if (table_[i].key == key) break;
      if (table_[i].key == 0) return V{};
    }
    const V value = table_[i].value;
    // Backward shift: pull later entries of the probe chain into the hole when their
    // home slot does not lie (cyclically) between the hole and where they sit.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask_; table_[j].key != 0; j = (j + 1) & mask_) {
      const std::size_t home = slot(table_[j].key);
      const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        table_[hole] = table_[j];
        hole = j;
      }
    }
    table_[hole] = entry{};
    --size_;
    return value;
  }

  template <class F>
  void for_each(F&& f) const {
    for (const entry& e : table_) {
      if (e.key != 0) f(e.key, e.value);
    }
  }

  void clear() {
    table_.assign(table_.size(), entry{});
    size_ = 0;
  }

 private:
  struct entry {
    std::uintptr_t key = 0;
    V value{};
  };

  std::size_t slot(std::uintptr_t key) const {
    // Fibonacci hashing; the low bits of block addresses are all zero (alignment).
    return static_cast<std::size_t>((static_cast<std::uint64_t>(key) * 0x9E3779B97F4A7C15ull) >>
                                    shift_);
  }

  // Out of line, so that insert() stays small enough to inline into the pool's
  // allocate (with the rehash inlined into it, it was a call of its own: 12 instructions
  // of entry and exit per allocation).
  __attribute__((noinline)) void grow() { rehash(table_.size() * 2); }

  void rehash(std::size_t capacity) {
    std::vector<entry> old;
    old.swap(table_);
    table_.assign(capacity, entry{});
    mask_ = capacity - 1;
    shift_ = 64;
    for (std::size_t c = capacity; c > 1; c >>= 1) --shift_;
    size_ = 0;
    for (const entry& e : old) {
      if (e.key != 0) insert(e.key, e.value);
    }
  }

  std::vector<entry> table_;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace tfmg

#endif  // TFMG_ADDR_MAP_H_
