#include "cc/tfmg/pool.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <unordered_set>

namespace tfmg {
namespace {

constexpr std::size_t kMaxAlignment = std::size_t{1} << 30;
constexpr std::size_t kBlockChunk = 1024;  // blocks are allocated in chunks of this many

bool is_pow2(std::size_t x) { return x != 0 && (x & (x - 1)) == 0; }
std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) & ~(a - 1); }
std::size_t round_down(std::size_t x, std::size_t a) { return x & ~(a - 1); }
unsigned kind_of(unsigned flags) {
  const unsigned k = (flags >> TFMG_ALLOC_KIND_SHIFT) & 15u;
  return k < TFMG_NUM_KINDS ? k : TFMG_KIND_OTHER;
}

}  // namespace

std::string format_bytes(std::uint64_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
  } else if (v >= 100.0) {
    std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f %s", v >= 10.0 ? 1 : 2, v, units[u]);
  }
  return buf;
}

pool::pool(std::unique_ptr<upstream> up, const pool_config& config)
    : upstream_(std::move(up)),
      granule_(config.alignment != 0 ? config.alignment : upstream_->default_alignment()),
      small_threshold_(config.small_threshold),
      // Zones only where the budget bounds the bytes backed: elsewhere a region's every
      // byte counts against it, and a second zone's region would take budget.
      zone_threshold_(upstream_->backs_on_demand() ? config.zone_threshold : 0),
      first_region_bytes_(config.region_bytes),
      granule_shift_(static_cast<unsigned>(__builtin_ctzll(granule_))),
      direct_(16, std::hash<std::uintptr_t>{}, std::equal_to<std::uintptr_t>{},
              node_allocator<std::pair<const std::uintptr_t, direct_block>>(&arena_)),
      next_region_bytes_(config.region_bytes),
      limit_(config.max_bytes),
      backs_(upstream_->backs_on_demand()),
      address_factor_(!backs_ ? 1 : config.address_factor != 0 ? config.address_factor : 2),
      trim_(backs_ ? config.trim_above_peak : 0.0),
      trace_(config.trace_capacity) {
  assert(is_pow2(granule_));
  for (free_index& ix : zones_) {
    ix.lists.assign(kExact, nullptr);
    ix.list_bits.assign(kExactWords, 0);
    ix.bins.reserve(kBins);
    for (unsigned i = 0; i < kBins; ++i) {
      ix.bins.emplace_back(std::less<free_key>{}, node_allocator<free_key>(&arena_));
    }
  }
}

// Eight classes per power of two: [2^k, 2^k * 9/8), [2^k * 9/8, 2^k * 10/8), ...
unsigned pool::bin_of(std::size_t size) {
  const unsigned log2 = 63u - static_cast<unsigned>(__builtin_clzll(size));
  if (log2 < 3) return static_cast<unsigned>(size);
  return log2 * 8 + static_cast<unsigned>((size >> (log2 - 3)) & 7);
}

void pool::insert_free_locked(block* b) {
  if (__builtin_expect(b->zone != 0, 0)) {
    insert_free_in(zones_[1], b);
  } else {
    insert_free_in(zones_[0], b);
  }
}

inline __attribute__((always_inline)) void pool::insert_free_in(free_index& ix, block* b) {
  raise_largest_locked(ix, b->size);
  if (exact(b->size)) {
    const std::size_t n = b->size >> granule_shift_;
    block* head = ix.lists[n];
    if (head != nullptr && b->addr < head->addr) {
      // The head stays the block at the higher address of the two.
      b->at.fprev = head;
      b->fnext = head->fnext;
      if (b->fnext != nullptr) b->fnext->at.fprev = b;
      head->fnext = b;
      ++ix.listed;
      return;
    }
    b->at.fprev = nullptr;
    b->fnext = head;
    if (head != nullptr) head->at.fprev = b;
    ix.lists[n] = b;
    const std::size_t w = n / 64;
    ix.list_bits[w] |= std::uint64_t{1} << (n % 64);
    ix.list_mids[w / 64] |= std::uint64_t{1} << (w % 64);
    ix.list_top |= std::uint64_t{1} << (w / 64);
    ++ix.listed;
    return;
  }
  b->bin = static_cast<std::uint16_t>(bin_of(b->size));
  b->at.where = ix.bins[b->bin].insert(free_key{b->size, b->addr, b}).first;
  ix.bin_bits[b->bin / 64] |= std::uint64_t{1} << (b->bin % 64);
}

void pool::erase_free_locked(block* b) {
  if (__builtin_expect(b->zone != 0, 0)) {
    erase_free_in(zones_[1], b);
  } else {
    erase_free_in(zones_[0], b);
  }
}

inline __attribute__((always_inline)) void pool::erase_free_in(free_index& ix, block* b) {
  if (b->size == ix.largest_size) ix.largest_known = false;  // forget_if_largest_locked
  if (exact(b->size)) {
    const std::size_t n = b->size >> granule_shift_;
    if (b->fnext != nullptr) b->fnext->at.fprev = b->at.fprev;
    if (b->at.fprev != nullptr) {
      b->at.fprev->fnext = b->fnext;
    } else {
      ix.lists[n] = b->fnext;
      if (b->fnext == nullptr) {
        const std::size_t w = n / 64;
        ix.list_bits[w] &= ~(std::uint64_t{1} << (n % 64));
        if (ix.list_bits[w] == 0) {
          ix.list_mids[w / 64] &= ~(std::uint64_t{1} << (w % 64));
          if (ix.list_mids[w / 64] == 0) ix.list_top &= ~(std::uint64_t{1} << (w / 64));
        }
      }
    }
    --ix.listed;
    return;
  }
  free_set& set = ix.bins[b->bin];
  set.erase(b->at.where);
  if (set.empty()) ix.bin_bits[b->bin / 64] &= ~(std::uint64_t{1} << (b->bin % 64));
}

pool::block* pool::exact_fit_locked(const free_index& ix, std::size_t n) const {
  // Level 0: the rest of n's own word; level 1: the rest of its group of 64 words;
  // level 2: the next non-empty group.
  std::size_t w = n / 64;
  std::uint64_t bits = ix.list_bits[w] & (~std::uint64_t{0} << (n % 64));
  if (bits == 0) {
    std::size_t m = w / 64;
    std::uint64_t mids = (w % 64 == 63) ? 0 : ix.list_mids[m] & (~std::uint64_t{0} << (w % 64 + 1));
    if (mids == 0) {
      const std::uint64_t top = (m == 63) ? 0 : ix.list_top & (~std::uint64_t{0} << (m + 1));
      if (top == 0) return nullptr;
      m = static_cast<std::size_t>(__builtin_ctzll(top));
      mids = ix.list_mids[m];
    }
    w = m * 64 + static_cast<std::size_t>(__builtin_ctzll(mids));
    bits = ix.list_bits[w];
  }
  return ix.lists[w * 64 + static_cast<std::size_t>(__builtin_ctzll(bits))];
}

pool::block* pool::largest_free_block_locked(const free_index& ix) const {
  for (unsigned w = kBins / 64; w-- > 0;) {
    if (ix.bin_bits[w] != 0) {
      const unsigned bin = w * 64 + 63u - static_cast<unsigned>(__builtin_clzll(ix.bin_bits[w]));
      return ix.bins[bin].rbegin()->b;
    }
  }
  if (ix.list_top == 0) return nullptr;
  const std::size_t m = 63u - static_cast<std::size_t>(__builtin_clzll(ix.list_top));
  const std::size_t w = m * 64 + 63u - static_cast<std::size_t>(__builtin_clzll(ix.list_mids[m]));
  return ix.lists[w * 64 + 63u - static_cast<std::size_t>(__builtin_clzll(ix.list_bits[w]))];
}

std::size_t pool::free_block_count_locked() const {
  std::size_t n = 0;
  for (const free_index& ix : zones_) {
    n += ix.listed;
    for (const free_set& set : ix.bins) n += set.size();
  }
  return n;
}

pool::~pool() { release_all(); }

// ---------------------------------------------------------------------------------
// Allocation

namespace {
// How long the request being refused on this thread waited for frees (refuse_locked puts
// it in the refusal's record and message).
thread_local std::int64_t t_waited_ns = 0;
}  // namespace

void* pool::allocate_waiting(std::size_t bytes, std::size_t alignment, unsigned flags,
                             pool_error* error) {
  const unsigned quiet = flags | TFMG_ALLOC_QUIET;
  t_waited_ns = 0;
  if (flags & TFMG_ALLOC_MUST_SUCCEED) return allocate_now(bytes, alignment, flags, error);
  // While others wait, a request waits behind them, oldest first (free_wait.h).
  if (!waiter_.has_waiters() || waiter_.idle_ns() <= 0) {
    void* p = allocate_now(bytes, alignment, quiet, error);
    if (p != nullptr || error->status != TFMG_ERROR_OUT_OF_MEMORY) return p;
  }
  // A request larger than the whole budget can never be served, whatever other threads
  // free: refused at once (a GradientTape step's 112 MiB convolution under 64 MiB waited
  // the full second before its refusal).
  const std::size_t limit = budget();
  if (limit != 0 && bytes > limit) return allocate_now(bytes, alignment, flags, error);
  void* p = nullptr;
  std::int64_t waited = 0;
  p = waiter_.wait(
      [&] {
        pool_error e{};
        return allocate_now(bytes, alignment, quiet, &e);
      },
      &waited, limit == 0 ? -1 : static_cast<std::int64_t>(limit - bytes));
  if (p != nullptr) return p;
  // Refused: recorded, with how long it waited. A quiet request is the caller's probe: the
  // wait is kept for the refusal the caller records next on this thread.
  t_waited_ns = waited;
  return allocate_now(bytes, alignment, flags, error);
}

std::size_t pool::budget() {
  std::lock_guard<pool_lock> lock(mutex_);
  return limit_;
}

void* pool::allocate_now(std::size_t bytes, std::size_t alignment, unsigned flags,
                         pool_error* error) {
  if (alignment == 0) alignment = granule_;
  if (!is_pow2(alignment) || alignment > kMaxAlignment) {
    error->status = TFMG_ERROR_INVALID_ARGUMENT;
    error->message = "alignment=" + std::to_string(alignment) +
                     ": must be a power of two no larger than 1 GiB";
    return nullptr;
  }
  alignment = std::max(alignment, granule_);
  std::lock_guard<pool_lock> lock(mutex_);
  // Anything above half the address space cannot be served and would overflow rounding.
  if (bytes > (std::numeric_limits<std::size_t>::max() >> 1)) {
    refuse_locked(bytes, alignment, flags, error);
    return nullptr;
  }
  const std::size_t size = bytes == 0 ? granule_ : round_up(bytes, granule_);
  if (limit_ == 0) return allocate_direct_locked(size, alignment, false, flags, error);

  // Small blocks go to the high end of the best-fitting free block (see pool.h).
  const bool small = size < small_threshold_ && alignment == granule_;
  // Small requests take their zone's blocks, and the other zone's where it has none.
  const int zone = alignment == granule_ ? zone_of(size) : 0;
  block* b = nullptr;
  // Backed on demand, back_block_locked holds the account to the budget; a plain
  // region is the budget, and only overshoot can make its free blocks too many.
  if (backs_ || pooled_in_use_ - draining_in_use_ + size <= budget_left_locked()) {
    for (int z = zone; b == nullptr && z >= 0; --z) {
      b = find_fit_locked(z, size, alignment, small);
      if (b == nullptr && grow_locked(size, alignment, z)) b = find_fit_locked(z, size, alignment, small);
    }
  }
  if (b == nullptr) {
    if (flags & TFMG_ALLOC_MUST_SUCCEED) {
      return allocate_direct_locked(size, alignment, true, flags, error);
    }
    refuse_locked(bytes, alignment, flags, error);
    return nullptr;
  }
  const std::size_t largest = largest_free_locked();  // for the window's tightest fit
  b = carve_locked(b, size, alignment, small);
  bool device_full = false;
  if (backs_ && !back_block_locked(b, &device_full) && !device_full) {
    // At the budget the best-fitting hole can need granules the budget has no room for
    // while another lies in granules already backed, partly used by its neighbours
    // (small blocks packed together leave such holes as they come and go): before
    // refusing, the hole that needs the fewest new granules.
    free_block_locked(b);
    bool low = false;
    block* other = alignment == granule_ ? least_backing_fit_locked(zone, size, &low) : nullptr;
    b = other != nullptr ? carve_locked(other, size, alignment, !low) : nullptr;
    if (b != nullptr && !back_block_locked(b, &device_full)) {
      free_block_locked(b);
      b = nullptr;
    }
  } else if (backs_ && device_full) {
    free_block_locked(b);
    b = nullptr;
  }
  if (b == nullptr) {
    // The request is refused (or, if it must succeed, served over the budget).
    if (flags & TFMG_ALLOC_MUST_SUCCEED) {
      return allocate_direct_locked(size, alignment, true, flags, error);
    }
    refuse_locked(bytes, alignment, flags, error);
    if (device_full) {
      error->message += " (the budget has room, but the device has no free memory to back it: "
                        "another process may be using it)";
    }
    return nullptr;
  }
  if (largest >= size && largest - size < window_tight_slack_) {
    window_tight_slack_ = largest - size;
    window_tight_request_ = size;
    window_tight_largest_ = largest;
    window_tight_in_use_ = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  }
  b->batch = (flags & TFMG_ALLOC_BATCH) != 0;
  b->kind = static_cast<unsigned char>(kind_of(flags));
  live_.insert(b->addr, b);
  pooled_in_use_ += b->size;
  note_alloc_locked(b->size, b->batch, b->kind);
  if (trace_.enabled()) {
    trace_.record(TFMG_TRACE_ALLOC, b->owner->index, b->size, b->addr - b->owner->base, b->addr,
                  flags & ~TFMG_ALLOC_QUIET);
  }
  return reinterpret_cast<void*>(b->addr);
}

bool pool::back_block_slow_locked(block* b, bool* device_full) {
  if (b->backed && backed_ <= budget_left_locked()) {
    // Nothing to back and nothing to take back (what the general path below does in
    // this case, without asking the upstream).
    if (trim_ > 0) note_trim_locked(false, 0);
    return true;
  }
  // Far from the budget (and with no trim line) the block cannot pass it, whatever of
  // its granules lack backing: no need to count them first.
  const std::size_t page = upstream_->page_size();
  const std::size_t budget = budget_left_locked();  // overshoot counts against the budget
  const bool far = trim_ == 0 && backed_ <= budget && b->size + 2 * page <= budget - backed_;
  const std::size_t need = b->backed || far ? 0 : upstream_->unbacked(reinterpret_cast<void*>(b->addr), b->size);
  bool reclaimed = false;
  bool soft_only = false;  // a reclaim for the trim line alone, the budget not reached
  std::chrono::steady_clock::time_point reclaim_start;
  std::uint64_t syncs_before = 0;
  if (need > 0 || backed_ > budget) {  // over it already: overshoot, or a lowered budget
    // Over the budget, free granules must go first (or the request is refused, nothing
    // changed); over the trim line (trim_above_peak), they go if there are any.
    const std::size_t after = backed_ + need;
    const std::size_t hard = after > budget ? after - budget : 0;
    std::size_t soft = hard;
    if (trim_ > 0) {
      const double line = static_cast<double>(pooled_peak_) * (1.0 + trim_);
      const std::size_t cap = std::min(budget, round_up(static_cast<std::size_t>(line), page));
      soft = std::max(hard, after > cap ? after - cap : 0);
    }
    if (soft > 0) {
      reclaim_start = std::chrono::steady_clock::now();
      syncs_before = upstream_->synchronizations();
      const std::size_t can = reclaim_locked(soft, /*dry_run=*/true);
      if (can < hard) return false;
      if (can > 0) {
        bytes_reclaimed_ += static_cast<std::int64_t>(reclaim_locked(std::min(soft, can), false));
        ++num_reclaims_;
        reclaimed = true;
        soft_only = hard == 0;
      }
      if (backed_ + need > budget) {
        upstream_->settle();
        return false;
      }
    }
  }
  std::size_t added = 0;
  const bool ok = b->backed || upstream_->back(reinterpret_cast<void*>(b->addr), b->size, &added);
  b->backed = ok;
  // What the reclaim retired and back() did not map again (or unbacked again on
  // failure) is given back now.
  if (reclaimed || !ok) upstream_->settle();
  if (reclaimed) {
    reclaim_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                          reclaim_start).count();
  }
  if (trim_ > 0) note_trim_locked(reclaimed && soft_only, syncs_before);
  backed_ += added;  // a failure can leave earlier granules of the range backed
  note_held_locked();
  *device_full = !ok;
  return ok;
}

void pool::note_trim_locked(bool trimmed, std::uint64_t syncs_before) {
  // Trimming pays off where steps repeat: the granules retired at one step's trim line
  // are the ones the next step takes back, with no synchronization (backing.h). Where
  // blocks come and go at random, it synchronizes again and again; then it stops.
  ++trim_allocs_;
  if (!trimmed) return;
  trim_syncs_ += upstream_->synchronizations() - syncs_before;
  if (trim_syncs_ > 16 && trim_syncs_ * 1000 > trim_allocs_) {
    trim_ = 0.0;
    trim_given_up_ = true;
  }
}

std::size_t pool::reclaim_locked(std::size_t bytes, bool dry_run) {
  // Largest free blocks first (the tree bins from the top, then the exact lists), and
  // from a block only what is still needed. Granules are retired, not discarded: the
  // back() that follows may map their memory again (upstream::retire), and settle()
  // gives back the rest. One walk of the free blocks at most, and only when the budget
  // (or the trim line) is reached; the upstream counts backed granules a word at a time.
  std::size_t gone = 0;
  auto take = [&](block* f) {
    void* p = reinterpret_cast<void*>(f->addr);
    // Only what is still needed, from the block's high end: the rest stays backed for
    // the blocks that will be carved there.
    const std::size_t n = dry_run ? upstream_->discardable(p, f->size) : upstream_->retire(p, f->size, bytes - gone);
    if (!dry_run) backed_ -= n;
    if (!dry_run && n > 0) f->backed = false;
    gone += n;
    return gone >= bytes;
  };
  // The zones' bins, then their lists, size class by size class from the top.
  for (unsigned bin = kBins; bin-- > 0;) {
    for (const free_index& ix : zones_) {
      for (auto it = ix.bins[bin].rbegin(); it != ix.bins[bin].rend(); ++it) {
        if (take(it->b)) return gone;
      }
    }
  }
  for (std::size_t w = kExactWords; w-- > 0;) {
    for (const free_index& ix : zones_) {
      for (std::uint64_t bits = ix.list_bits[w]; bits != 0;) {
        const unsigned top = 63u - static_cast<unsigned>(__builtin_clzll(bits));
        bits &= ~(std::uint64_t{1} << top);
        for (block* f = ix.lists[w * 64 + top]; f != nullptr; f = f->fnext) {
          if (take(f)) return gone;
        }
      }
    }
  }
  return gone;
}

pool::block* pool::least_backing_fit_locked(int zone, std::size_t size, bool* low) {
  // Free blocks large enough, smallest first (the exact lists, then the trees), each
  // tried at its high end (where small blocks go) and its low end; at most
  // kCandidates of them: this runs only at the budget, before a refusal. The request's
  // zone first, then (a small request) the other.
  constexpr int kCandidates = 256;
  int seen = 0;
  block* best = nullptr;
  std::size_t best_need = SIZE_MAX;
  auto consider = [&](block* f) {
    const std::size_t hi = upstream_->unbacked(reinterpret_cast<void*>(f->addr + f->size - size), size);
    const std::size_t lo = upstream_->unbacked(reinterpret_cast<void*>(f->addr), size);
    if (std::min(hi, lo) < best_need) {
      best_need = std::min(hi, lo);
      best = f;
      *low = lo < hi;
    }
    return best_need == 0 || ++seen >= kCandidates;
  };
  const std::size_t n = size >> granule_shift_;
  for (int z = zone; z >= 0; --z) {
    const free_index& ix = zones_[z];
    if (n < kExact) {
      for (std::size_t w = n / 64; w < kExactWords; ++w) {
        std::uint64_t bits = ix.list_bits[w] & (w == n / 64 ? ~std::uint64_t{0} << (n % 64) : ~std::uint64_t{0});
        while (bits != 0) {
          const unsigned k = static_cast<unsigned>(__builtin_ctzll(bits));
          bits &= bits - 1;
          for (block* f = ix.lists[w * 64 + k]; f != nullptr; f = f->fnext) {
            if (consider(f)) return best;
          }
        }
      }
    }
    for (unsigned bin = bin_of(std::max(size, kExact << granule_shift_)); bin < kBins; ++bin) {
      for (const free_key& k : ix.bins[bin]) {
        if (k.size >= size && consider(k.b)) return best;
      }
    }
  }
  return best;
}

pool::block* pool::find_fit_locked(int zone, std::size_t size, std::size_t alignment, bool small) {
  const free_index& ix = zones_[zone];
  // With an alignment above the granule, a block this much larger always has room
  // for the padding in front.
  free_key key{size + (alignment > granule_ ? alignment - granule_ : 0), 0, nullptr};
  if (exact(key.size)) {
    block* b = exact_fit_locked(ix, key.size >> granule_shift_);
    if (b != nullptr) return b;
    key.size = kExact << granule_shift_;  // the smallest block of the trees
  }
  unsigned bin = bin_of(key.size);
  const free_set* set = &ix.bins[bin];
  auto it = set->lower_bound(key);
  if (it == set->end()) {
    // The smallest block of the next non-empty bin: one bitmap scan.
    ++bin;
    unsigned w = bin / 64;
    if (w >= kBins / 64) return nullptr;
    std::uint64_t bits = ix.bin_bits[w] & (~std::uint64_t{0} << (bin % 64));
    while (bits == 0) {
      if (++w == kBins / 64) return nullptr;
      bits = ix.bin_bits[w];
    }
    set = &ix.bins[w * 64 + static_cast<unsigned>(__builtin_ctzll(bits))];
    it = set->begin();
  }
  if (!small) return it->b;
  // Among the free blocks of the best size, the one at the highest address.
  key.size = it->size;
  key.addr = std::numeric_limits<std::uintptr_t>::max();
  return std::prev(set->upper_bound(key))->b;
}

pool::block* pool::carve_locked(block* b, std::size_t size, std::size_t alignment, bool small) {
  // The chosen free block keeps its tree node where it can: the rest of it stays free
  // and is re-keyed in place, and a new block object describes the part handed out.
  if (alignment > granule_) {
    const std::size_t pad = round_up(b->addr, alignment) - b->addr;
    if (pad != 0) {
      // The padding in front stays free as b; carve from a new free block after it.
      block* nb = new_block_locked();
      nb->addr = b->addr + pad;
      nb->size = b->size - pad;
      nb->free = true;
      nb->backed = b->backed;
      link_after(b, nb);
      forget_if_largest_locked(b);
      rekey_free_locked(b, b->addr, pad);
      insert_free_locked(nb);
      b = nb;
    }
    small = false;
  }
  if (b->size == size) {
    erase_free_locked(b);
    b->free = false;
    return b;
  }
  block* used = new_block_locked();
  used->size = size;
  used->free = false;
  used->backed = b->backed;
  const std::size_t rest = b->size - size;
  forget_if_largest_locked(b);
  if (small) {
    // Handed out from the high end; the low end stays free.
    used->addr = b->addr + rest;
    link_after(b, used);
    rekey_free_locked(b, b->addr, rest);
  } else {
    used->addr = b->addr;
    link_before(b, used);
    rekey_free_locked(b, b->addr + size, rest);
  }
  return used;
}

void pool::link_after(block* at, block* nb) {
  nb->prev = at;
  nb->next = at->next;
  nb->owner = at->owner;
  nb->zone = at->zone;
  if (at->next != nullptr) at->next->prev = nb;
  at->next = nb;
}

void pool::link_before(block* at, block* nb) {
  nb->next = at;
  nb->prev = at->prev;
  nb->owner = at->owner;
  nb->zone = at->zone;
  if (at->prev != nullptr) {
    at->prev->next = nb;
  } else {
    at->owner->first = nb;
  }
  at->prev = nb;
}

void pool::unlink(block* x) {
  if (x->prev != nullptr) {
    x->prev->next = x->next;
  } else {
    x->owner->first = x->next;
  }
  if (x->next != nullptr) x->next->prev = x->prev;
}

void pool::rekey_free_locked(block* b, std::uintptr_t addr, std::size_t size) {
  if (__builtin_expect(b->zone != 0, 0)) {
    rekey_free_in(zones_[1], b, addr, size);
  } else {
    rekey_free_in(zones_[0], b, addr, size);
  }
}

inline __attribute__((always_inline)) void pool::rekey_free_in(free_index& ix, block* b, std::uintptr_t addr,
                                                               std::size_t size) {
  // When the new key stays in the same bin and between the same tree neighbours, the
  // node is updated in place: no erase, no insert, no rebalancing.
  if (exact(b->size) && exact(size)) {
    if (size == b->size) {
      b->addr = addr;  // lists are not ordered by address
      return;
    }
  } else if (!exact(b->size) && !exact(size)) {
    const std::uint16_t bin = static_cast<std::uint16_t>(bin_of(size));
    free_set& set = ix.bins[b->bin];
    if (bin == b->bin) {
      const free_key key{size, addr, b};
      // A bin's lone block (a region's remainder, most often) keeps its place whatever its
      // key: no neighbours to compare with.
      const bool alone = set.size() == 1;
      const bool after_prev = alone || b->at.where == set.begin() || *std::prev(b->at.where) < key;
      const bool before_next = alone || std::next(b->at.where) == set.end() || key < *std::next(b->at.where);
      if (after_prev && before_next) {
        b->at.where->size = size;
        b->at.where->addr = addr;
        b->addr = addr;
        b->size = size;
        return;
      }
    }
    if (bin != b->bin && set.size() == 1 && ix.bins[bin].empty()) {
      // The lone block of its bin moving to an empty bin (a region's remainder crossing
      // a size-class boundary at every carve and free: a budget of exactly a class's
      // bound): the two trees swap, O(1), and the node keeps its place and iterator.
      set.swap(ix.bins[bin]);
      ix.bin_bits[b->bin / 64] &= ~(std::uint64_t{1} << (b->bin % 64));
      ix.bin_bits[bin / 64] |= std::uint64_t{1} << (bin % 64);
      b->at.where->size = size;
      b->at.where->addr = addr;
      b->addr = addr;
      b->size = size;
      b->bin = bin;
      return;
    }
    // To another place or bin: the tree node moves, re-keyed (no node freed and made
    // again).
    auto node = set.extract(b->at.where);
    if (set.empty()) ix.bin_bits[b->bin / 64] &= ~(std::uint64_t{1} << (b->bin % 64));
    node.value().size = size;
    node.value().addr = addr;
    b->addr = addr;
    b->size = size;
    b->bin = bin;
    b->at.where = ix.bins[bin].insert(std::move(node)).position;
    ix.bin_bits[bin / 64] |= std::uint64_t{1} << (bin % 64);
    return;
  }
  erase_free_in(ix, b);
  b->addr = addr;
  b->size = size;
  insert_free_in(ix, b);
}

std::size_t pool::zone_reserved_locked(int zone) const {
  if (zone_threshold_ == 0) return reserved_ - draining_;
  std::size_t n = 0;
  for (const auto& r : regions_) {
    if (r->zone == zone && !r->draining) n += r->size;
  }
  return n;
}

std::size_t pool::zone_space_locked(int zone) const {
  // The small requests' zone: as much address space as the budget, which its blocks in
  // use never pass; the large requests' zone: what regions may take without zones.
  return zone == 0 ? space_limit_locked() : limit_;
}

bool pool::grow_locked(std::size_t size, std::size_t alignment, int zone) {
  // The same slack find_fit_locked asks for, so the new region always serves the
  // request that made it (a region never stays reserved for a request then refused).
  const std::size_t page = upstream_->page_size();
  const std::size_t extra = alignment > granule_ ? alignment - granule_ : 0;
  const std::size_t need = round_up(size + extra, page);
  const std::size_t space = zone_space_locked(zone);
  const std::size_t counted = zone_reserved_locked(zone);
  if (need > space || need < size || counted > space) return false;
  if (need > space - counted) {
    // Returning empty regions helps only if it makes room; otherwise change nothing,
    // so that a refusal leaves every counter as it was.
    std::size_t releasable = 0;
    for (const auto& r : regions_) {
      if (r->first->free && r->first->next == nullptr && !r->draining && r->zone == zone) releasable += r->size;
    }
    if (need > space - counted + releasable) return false;
    release_unused_locked();
  }
  const std::size_t room = round_down(space - zone_reserved_locked(zone), page);
  std::size_t want = std::max(need, std::min(round_up(std::min(next_region_bytes_, room), page), room));
  void* p = upstream_->allocate(want, page, true);
  if (p == nullptr && want > need) {
    want = need;
    p = upstream_->allocate(want, page, true);
  }
  if (p == nullptr) return false;

  auto r = std::make_unique<region>();
  r->base = reinterpret_cast<std::uintptr_t>(p);
  r->size = want;
  r->index = next_region_index_++;
  r->zone = static_cast<unsigned char>(zone);
  block* b = new_block_locked();
  b->addr = r->base;
  b->size = want;
  b->prev = b->next = nullptr;
  b->owner = r.get();
  b->zone = r->zone;
  b->free = true;
  b->backed = !backs_;  // address space only, until blocks carved from it are backed
  r->first = b;
  insert_free_locked(b);
  regions_.push_back(std::move(r));
  reserved_ += want;
  note_held_locked();
  if (next_region_bytes_ <= (std::numeric_limits<std::size_t>::max() >> 1)) next_region_bytes_ *= 2;
  return true;
}

void* pool::allocate_direct_locked(std::size_t size, std::size_t alignment, bool overshoot,
                                   unsigned flags, pool_error* error) {
  const unsigned kind = kind_of(flags);
  const bool batch = (flags & TFMG_ALLOC_BATCH) != 0;
  void* p = upstream_->allocate(size, alignment, false);
  if (p == nullptr) {
    if (overshoot) {
      refuse_locked(size, alignment, flags, error);
    } else {
      error->status = TFMG_ERROR_OUT_OF_MEMORY;
      error->message = "cannot allocate " + format_bytes(size) + " (" + std::to_string(size) +
                       " bytes): the " + upstream_->name() + " upstream has no more memory";
    }
    return nullptr;
  }
  direct_.emplace(reinterpret_cast<std::uintptr_t>(p),
                  direct_block{size, alignment, overshoot, batch, static_cast<unsigned char>(kind)});
  if (overshoot) {
    overshoot_in_use_ += size;
    overshoot_in_use_by_kind_[kind] += size;
    peak_overshoot_ = std::max(peak_overshoot_, overshoot_in_use_);
    ++num_overshoots_;
    ++overshoots_by_kind_[kind];
    overshoot_bytes_by_kind_[kind] += static_cast<std::int64_t>(size);
  } else {
    passthrough_in_use_ += size;
  }
  note_alloc_locked(size, batch, kind);
  if (trace_.enabled()) {
    trace_.record(overshoot ? TFMG_TRACE_OVERSHOOT : TFMG_TRACE_ALLOC, -1, size, 0,
                  reinterpret_cast<std::uintptr_t>(p), flags & ~TFMG_ALLOC_QUIET);
  }
  return p;
}

void pool::note_free_locked(std::size_t size, bool batch, unsigned kind) {
  ++num_frees_;
  if (batch) batch_in_use_ -= size;
  in_use_by_kind_[kind] -= size;
}

void pool::note_alloc_locked(std::size_t size, bool batch, unsigned kind) {
  ++num_allocs_;
  in_use_by_kind_[kind] += size;
  largest_alloc_ = std::max(largest_alloc_, size);
  if (batch) batch_in_use_ += size;
  const std::size_t in_use = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  peak_in_use_ = std::max(peak_in_use_, in_use);
  if (in_use > window_peak_) {
    window_peak_ = in_use;
    window_peak_batch_ = batch_in_use_;  // the split of the peak, as it was then
  }
  if (batch && batch_in_use_ > window_max_batch_) {
    window_max_batch_ = batch_in_use_;
    window_in_use_at_max_batch_ = in_use;
  }
}

void pool::refuse_locked(std::size_t bytes, std::size_t alignment, unsigned flags,
                         pool_error* error) {
  error->status = TFMG_ERROR_OUT_OF_MEMORY;
  if (flags & TFMG_ALLOC_QUIET) {
    // A probe: nothing recorded, and no message built (the caller decides what next).
    error->message = "does not fit the budget";
    return;
  }
  ++num_refusals_;
  has_refusal_ = true;
  last_refusal_.sequence = static_cast<std::uint64_t>(num_refusals_);
  last_refusal_.requested_bytes = static_cast<std::int64_t>(std::min<std::size_t>(
      bytes, static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())));
  last_refusal_.alignment = static_cast<std::int64_t>(alignment);
  last_refusal_.bytes_in_use =
      static_cast<std::int64_t>(pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_);
  last_refusal_.bytes_reserved = static_cast<std::int64_t>(held_locked());
  last_refusal_.largest_free_block_bytes = static_cast<std::int64_t>(largest_free_locked());
  last_refusal_.largest_allocatable_bytes = static_cast<std::int64_t>(largest_allocatable_locked());
  last_refusal_.bytes_limit = static_cast<std::int64_t>(limit_);
  last_refusal_.batch_bytes_in_use = static_cast<std::int64_t>(batch_in_use_);
  last_refusal_.overshoot_bytes_in_use = static_cast<std::int64_t>(overshoot_in_use_);
  last_refusal_.passthrough_bytes_in_use = static_cast<std::int64_t>(passthrough_in_use_);
  last_refusal_.requested_batch = (flags & TFMG_ALLOC_BATCH) != 0 ? 1 : 0;
  last_refusal_.kind = static_cast<std::int32_t>(kind_of(flags));
  last_refusal_.waited_ns = t_waited_ns;
  const std::int64_t waited_ns = t_waited_ns;
  t_waited_ns = 0;
  for (int k = 0; k < TFMG_NUM_KINDS; ++k) {
    last_refusal_.bytes_in_use_by_kind[k] = static_cast<std::int64_t>(in_use_by_kind_[k]);
    last_refusal_.overshoot_in_use_by_kind[k] = static_cast<std::int64_t>(overshoot_in_use_by_kind_[k]);
  }
  if (trace_.enabled()) trace_.record(TFMG_TRACE_REFUSE, -1, bytes, 0, 0, flags);
  error->status = TFMG_ERROR_OUT_OF_MEMORY;
  std::string waited;
  if (waited_ns > 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " (it waited %.2f s for blocks other threads free)", waited_ns / 1e9);
    waited = buf;
  }
  error->message = "cannot allocate " + format_bytes(bytes) + " (" + std::to_string(bytes) +
                   " bytes): " + state_locked(bytes) + waited +
                   ". Free memory, make the request smaller, or raise the budget.";
}

// ---------------------------------------------------------------------------------
// Free

bool pool::deallocate(void* p, std::size_t* size_out, pool_error* error) {
  if (p == nullptr) {
    if (size_out != nullptr) *size_out = 0;
    return true;
  }
  bool freed;
  std::size_t in_use;
  {
    std::lock_guard<pool_lock> lock(mutex_);
    freed = deallocate_locked(p, size_out, error);
    in_use = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  }
  if (freed) {
    waiter_.notify();  // one relaxed load unless a request waits
    waiter_.in_use_now(static_cast<std::int64_t>(in_use));  // one relaxed load outside a failed episode
  }
  return freed;
}

bool pool::deallocate_locked(void* p, std::size_t* size_out, pool_error* error) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (block* b = live_.erase(addr)) {
    pooled_in_use_ -= b->size;
    note_free_locked(b->size, b->batch, b->kind);
    if (size_out != nullptr) *size_out = b->size;
    if (trace_.enabled()) {
      trace_.record(TFMG_TRACE_FREE, b->owner->index, b->size, b->addr - b->owner->base, b->addr);
    }
    free_block_locked(b);
    return true;
  }
  auto d = direct_.find(addr);
  if (d != direct_.end()) {
    const direct_block db = d->second;
    direct_.erase(d);
    upstream_->deallocate(p, db.size, db.alignment, false);
    (db.overshoot ? overshoot_in_use_ : passthrough_in_use_) -= db.size;
    if (db.overshoot) overshoot_in_use_by_kind_[db.kind] -= db.size;
    note_free_locked(db.size, db.batch, db.kind);
    if (size_out != nullptr) *size_out = db.size;
    if (trace_.enabled()) trace_.record(TFMG_TRACE_FREE, -1, db.size, 0, addr);
    return true;
  }
  describe_pointer_error_locked(addr, error);
  return false;
}

void pool::free_block_locked(block* b) {
  if (b->owner->draining) {
    free_in_draining_locked(b);
    return;
  }
  // Coalesce through the address links, O(1) to find the neighbours; a free neighbour
  // absorbs b (its tree node re-keyed in place where order allows).
  block* prev = (b->prev != nullptr && b->prev->free) ? b->prev : nullptr;
  block* next = (b->next != nullptr && b->next->free) ? b->next : nullptr;
  if (prev != nullptr) {
    std::size_t size = prev->size + b->size;
    prev->backed = prev->backed && b->backed && (next == nullptr || next->backed);
    unlink(b);
    recycle_block_locked(b);
    if (next != nullptr) {
      size += next->size;
      erase_free_locked(next);
      unlink(next);
      recycle_block_locked(next);
    }
    raise_largest_locked(prev->zone, size);
    rekey_free_locked(prev, prev->addr, size);
  } else if (next != nullptr) {
    const std::uintptr_t addr = b->addr;
    const std::size_t size = b->size + next->size;
    next->backed = next->backed && b->backed;
    unlink(b);
    recycle_block_locked(b);
    raise_largest_locked(next->zone, size);
    rekey_free_locked(next, addr, size);
  } else {
    b->free = true;
    insert_free_locked(b);
  }
}

void pool::describe_pointer_error_locked(std::uintptr_t p, pool_error* error) const {
  char addr[32];
  std::snprintf(addr, sizeof addr, "0x%" PRIxPTR, p);
  for (const auto& r : regions_) {
    if (p < r->base || p >= r->base + r->size) continue;
    // Error path only: a walk of this region's blocks is fine here.
    for (const block* b = r->first; b != nullptr; b = b->next) {
      if (p < b->addr || p >= b->addr + b->size) continue;
      if (b->free) {
        error->status = TFMG_ERROR_DOUBLE_FREE;
        error->message = std::string("free of ") + addr +
                         ": that memory is not in use (already freed: a double free). "
                         "Nothing was changed.";
      } else {
        error->status = TFMG_ERROR_UNKNOWN_POINTER;
        error->message = std::string("free of ") + addr + ": points " +
                         std::to_string(p - b->addr) + " bytes into a " + format_bytes(b->size) +
                         " block, not at its start. Nothing was changed.";
      }
      return;
    }
  }
  error->status = TFMG_ERROR_UNKNOWN_POINTER;
  error->message = std::string("free of ") + addr +
                   ": not a pointer handed out by this pool (or already returned). "
                   "Nothing was changed.";
}

bool pool::block_size(const void* p, std::size_t* out) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<pool_lock> lock(mutex_);
  if (const block* b = live_.find(addr)) {
    *out = b->size;
    return true;
  }
  auto d = direct_.find(addr);
  if (d != direct_.end()) {
    *out = d->second.size;
    return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------
// Budget, regions, statistics

bool pool::set_limit(std::size_t max_bytes, bool drain, pool_error* error) {
  bool set;
  {
    std::lock_guard<pool_lock> lock(mutex_);
    set = set_limit_locked(max_bytes, drain, error);
  }
  if (set) waiter_.notify();  // a higher budget can serve a waiting request
  return set;
}

bool pool::set_limit_locked(std::size_t max_bytes, bool drain, pool_error* error) {
  if (max_bytes == 0) {
    error->status = TFMG_ERROR_INVALID_ARGUMENT;
    error->message = "max_bytes=0: a budget must be a positive number of bytes";
    return false;
  }
  if (max_bytes > TFMG_MAX_BUDGET) {
    error->status = TFMG_ERROR_INVALID_ARGUMENT;
    error->message = "max_bytes=" + std::to_string(max_bytes) + " (" + format_bytes(max_bytes) +
                     "): above the " + format_bytes(TFMG_MAX_BUDGET) +
                     " a pool can take (a process has 128 TiB of address space, and a pool backed on "
                     "demand reserves twice its budget); pass a smaller max_bytes";
    return false;
  }
  if (backs_) {
    // The budget bounds the bytes backed; the regions are address space and stay. What
    // is backed inside free blocks goes back first, and only what stays under blocks in
    // use has to fit (dry run first, so that a refusal changes nothing).
    if (max_bytes < backed_) {
      release_unused_locked();
      const std::size_t excess = backed_ - std::min(backed_, max_bytes);
      const std::size_t can = excess == 0 ? 0 : reclaim_locked(excess, /*dry_run=*/true);
      if (can < excess && !drain) {
        error->status = TFMG_ERROR_OUT_OF_MEMORY;
        error->message = "cannot lower the budget to " + format_bytes(max_bytes) + ": " +
                         format_bytes(backed_ - can) + " stays backed under blocks in use (" +
                         format_bytes(pooled_in_use_) + " in use). Free them first; the budget stays " +
                         format_bytes(limit_) + ".";
        return false;
      }
      if (can > 0) {
        bytes_reclaimed_ += static_cast<std::int64_t>(reclaim_locked(std::min(excess, can), false));
        upstream_->settle();
      }
    }
    limit_ = max_bytes;
    return true;
  }
  const std::size_t space = max_bytes > SIZE_MAX / address_factor_ ? SIZE_MAX : max_bytes * address_factor_;
  if (space < reserved_ - draining_) release_unused_locked();
  if (drain) {
    // The newest regions drain first (the oldest hold the longest-lived blocks).
    for (auto it = regions_.rbegin(); it != regions_.rend() && space < reserved_ - draining_; ++it) {
      if (!(*it)->draining) drain_region_locked(it->get());
    }
  }
  if (space < reserved_ - draining_) {
    error->status = TFMG_ERROR_OUT_OF_MEMORY;
    error->message = "cannot lower the budget to " + format_bytes(max_bytes) + ": " +
                     format_bytes(reserved_ - draining_) + " is reserved in regions that still hold blocks in use (" +
                     format_bytes(pooled_in_use_) + " in use), and a region cannot shrink. Free them first, "
                     "or lower it with drain=True; the budget stays " + format_bytes(limit_) + ".";
    return false;
  }
  limit_ = max_bytes;
  return true;
}

void pool::drain_region_locked(region* r) {
  for (block* b = r->first; b != nullptr; b = b->next) {
    if (b->free) {
      erase_free_locked(b);
    } else {
      draining_in_use_ += b->size;  // outside the budget's account from now on
    }
  }
  r->draining = true;
  draining_ += r->size;
}

void pool::free_in_draining_locked(block* b) {
  // As free_block_locked, but free blocks of a draining region are not indexed.
  draining_in_use_ -= b->size;
  b->free = true;
  if (b->prev != nullptr && b->prev->free) {
    block* prev = b->prev;
    prev->size += b->size;
    unlink(b);
    recycle_block_locked(b);
    b = prev;
  }
  if (b->next != nullptr && b->next->free) {
    block* next = b->next;
    b->size += next->size;
    unlink(next);
    recycle_block_locked(next);
  }
  if (b->prev == nullptr && b->next == nullptr) release_region_locked(b->owner);
}

void pool::return_region_locked(region* r) {
  // r holds one free block, r->first; the caller removes r from regions_.
  if (!r->draining) erase_free_locked(r->first);
  recycle_block_locked(r->first);
  if (backs_) backed_ -= upstream_->discard(reinterpret_cast<void*>(r->base), r->size);
  upstream_->deallocate(reinterpret_cast<void*>(r->base), r->size, upstream_->page_size(), true);
  reserved_ -= r->size;
  if (r->draining) draining_ -= r->size;
}

void pool::release_region_locked(region* r) {
  return_region_locked(r);
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->get() == r) {
      regions_.erase(it);
      break;
    }
  }
}

std::size_t pool::release_unused() {
  std::lock_guard<pool_lock> lock(mutex_);
  const std::size_t released = release_unused_locked();
  // The pages wholly inside free blocks of the regions that stay go back to the OS.
  const std::size_t page = upstream_->page_size();
  for (const auto& r : regions_) {
    for (block* b = r->first; b != nullptr; b = b->next) {
      if (!b->free) continue;
      const std::uintptr_t lo = round_up(b->addr, page);
      const std::uintptr_t hi = round_down(b->addr + b->size, page);
      if (hi > lo) {
        backed_ -= upstream_->discard(reinterpret_cast<void*>(lo), hi - lo);
        b->backed = false;
      }
    }
  }
  return released;
}

std::size_t pool::release_unused_locked() {
  std::size_t released = 0;
  auto keep = regions_.begin();
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    region* r = it->get();
    if (r->first->free && r->first->next == nullptr) {
      released += r->size;
      return_region_locked(r);
      it->reset();
    } else {
      if (keep != it) *keep = std::move(*it);
      ++keep;
    }
  }
  regions_.erase(keep, regions_.end());
  return released;
}

void pool::release_all() {
  std::lock_guard<pool_lock> lock(mutex_);
  for (auto& r : regions_) {
    upstream_->deallocate(reinterpret_cast<void*>(r->base), r->size, upstream_->page_size(), true);
  }
  for (auto& d : direct_) {
    upstream_->deallocate(reinterpret_cast<void*>(d.first), d.second.size, d.second.alignment, false);
  }
  regions_.clear();
  direct_.clear();
  live_.clear();
  for (free_index& ix : zones_) {
    for (free_set& set : ix.bins) set.clear();
    std::fill(std::begin(ix.bin_bits), std::end(ix.bin_bits), 0);
    std::fill(ix.lists.begin(), ix.lists.end(), nullptr);
    std::fill(ix.list_bits.begin(), ix.list_bits.end(), 0);
    std::fill(std::begin(ix.list_mids), std::end(ix.list_mids), 0);
    ix.list_top = 0;
    ix.listed = 0;
    ix.largest_known = false;
  }
  spare_blocks_.clear();
  block_chunks_.clear();
  reserved_ = draining_ = draining_in_use_ = backed_ = pooled_in_use_ = passthrough_in_use_ = overshoot_in_use_ = batch_in_use_ = 0;
  std::fill(std::begin(in_use_by_kind_), std::end(in_use_by_kind_), 0);
  std::fill(std::begin(overshoot_in_use_by_kind_), std::end(overshoot_in_use_by_kind_), 0);
}

std::size_t pool::in_use_blocks() const {
  std::lock_guard<pool_lock> lock(mutex_);
  return live_.size() + direct_.size();
}

std::size_t pool::largest_free_slow_locked() const {
  std::size_t largest = 0;
  for (const free_index& ix : zones_) {
    if (!ix.largest_known) {
      const block* b = largest_free_block_locked(ix);
      ix.largest_size = b == nullptr ? 0 : b->size;
      ix.largest_known = true;
    }
    largest = std::max(largest, ix.largest_size);
  }
  return largest;
}

std::size_t pool::largest_allocatable_locked() const {
  if (limit_ == 0) return upstream_->total_memory();
  // The large requests' zone: the largest request is one.
  std::size_t releasable = 0;
  for (const auto& r : regions_) {
    if (r->first->free && r->first->next == nullptr && !r->draining && r->zone == 0) releasable += r->size;
  }
  const std::size_t counted = zone_reserved_locked(0);
  const std::size_t space = zone_space_locked(0);
  const std::size_t growable =
      counted > space ? 0 : round_down(space - counted + releasable, upstream_->page_size());
  const std::size_t largest = std::max(largest_free_locked(), growable);
  // The account bounds it: at most the budget not in use, overshoot counted (backed on
  // demand, in whole granules).
  const std::size_t in_budget = pooled_in_use_ - draining_in_use_;
  const std::size_t left = budget_left_locked() - std::min(budget_left_locked(), in_budget);
  return std::min(largest, backs_ ? round_down(left, upstream_->page_size()) : left);
}

void pool::fill_stats_locked(tfmg_stats* s) const {
  const std::size_t in_use = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  s->num_allocs = num_allocs_;
  s->bytes_in_use = static_cast<std::int64_t>(in_use);
  s->peak_bytes_in_use = static_cast<std::int64_t>(peak_in_use_);
  s->largest_alloc_size = static_cast<std::int64_t>(largest_alloc_);
  s->bytes_limit = static_cast<std::int64_t>(limit_);
  s->bytes_reserved = static_cast<std::int64_t>(held_locked());
  s->peak_bytes_reserved = static_cast<std::int64_t>(peak_reserved_);
  s->largest_free_block_bytes = static_cast<std::int64_t>(largest_free_locked());
  s->num_frees = num_frees_;
  s->num_refusals = num_refusals_;
  s->window_peak_bytes_in_use = static_cast<std::int64_t>(window_peak_);
  s->bytes_free = static_cast<std::int64_t>(reserved_ - pooled_in_use_);  // address space where backs_
  s->largest_allocatable_bytes = static_cast<std::int64_t>(largest_allocatable_locked());
  s->num_regions = static_cast<std::int64_t>(regions_.size());
  s->blocks_in_use = static_cast<std::int64_t>(live_.size() + direct_.size());
  s->passthrough_bytes_in_use = static_cast<std::int64_t>(passthrough_in_use_);
  s->overshoot_bytes_in_use = static_cast<std::int64_t>(overshoot_in_use_);
  s->peak_overshoot_bytes = static_cast<std::int64_t>(peak_overshoot_);
  s->num_overshoots = num_overshoots_;
  s->batch_bytes_in_use = static_cast<std::int64_t>(batch_in_use_);
  s->window_peak_batch_bytes = static_cast<std::int64_t>(window_peak_batch_);
  s->window_max_batch_bytes = static_cast<std::int64_t>(window_max_batch_);
  s->window_in_use_at_max_batch = static_cast<std::int64_t>(window_in_use_at_max_batch_);
  s->window_tight_request_bytes = static_cast<std::int64_t>(window_tight_request_);
  s->window_tight_largest_free_bytes = static_cast<std::int64_t>(window_tight_largest_);
  s->window_tight_in_use_bytes = static_cast<std::int64_t>(window_tight_in_use_);
  s->num_reclaims = num_reclaims_;
  s->bytes_reclaimed = bytes_reclaimed_;
  const free_waiter::counters w = waiter_.stats();
  s->num_waits = w.waits;
  s->num_waits_served = w.served;
  s->wait_ns = w.wait_ns;
  s->longest_wait_ns = w.longest_ns;
  for (int k = 0; k < TFMG_NUM_KINDS; ++k) {
    s->overshoots_by_kind[k] = overshoots_by_kind_[k];
    s->overshoot_bytes_by_kind[k] = overshoot_bytes_by_kind_[k];
    s->bytes_in_use_by_kind[k] = static_cast<std::int64_t>(in_use_by_kind_[k]);
    s->overshoot_in_use_by_kind[k] = static_cast<std::int64_t>(overshoot_in_use_by_kind_[k]);
  }
  s->fragmentation =
      s->bytes_free == 0
          ? 0.0
          : 1.0 - static_cast<double>(s->largest_free_block_bytes) / static_cast<double>(s->bytes_free);
}

tfmg_stats pool::stats() const {
  std::lock_guard<pool_lock> lock(mutex_);
  tfmg_stats s{};
  fill_stats_locked(&s);
  return s;
}

void pool::clear_stats() {
  std::lock_guard<pool_lock> lock(mutex_);
  const std::size_t in_use = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  num_allocs_ = 0;
  largest_alloc_ = 0;
  peak_in_use_ = in_use;  // the window peak and peak_bytes_reserved stay, as in TF
  waiter_.clear_stats();
}

void pool::reset_peak() {
  std::lock_guard<pool_lock> lock(mutex_);
  window_peak_ = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  window_peak_batch_ = batch_in_use_;
  window_max_batch_ = batch_in_use_;
  window_in_use_at_max_batch_ = window_peak_;
  window_tight_slack_ = SIZE_MAX;
  window_tight_request_ = window_tight_largest_ = window_tight_in_use_ = 0;
}

bool pool::last_refusal(tfmg_refusal* out) const {
  std::lock_guard<pool_lock> lock(mutex_);
  if (!has_refusal_) return false;
  *out = last_refusal_;
  return true;
}

std::string pool::state_locked(std::size_t request) const {
  std::string s;
  if (limit_ == 0) {
    s = format_bytes(pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_) +
        " in use, no budget set";
  } else {
    s = format_bytes(pooled_in_use_) + " of the " + format_bytes(limit_) + " budget in use, largest free block ";
    const std::size_t largest = largest_free_locked();
    const std::size_t allocatable = largest_allocatable_locked();
    const std::size_t held = held_locked();
    if (backs_ && request != 0 && allocatable >= request && held <= limit_ && limit_ - held < request) {
      // The bound above counts the budget not in use; a request also needs the granules
      // under it backed, and free bytes between blocks in use lie in granules they share.
      // Refused beside such a bound, the block it names would be larger than the request.
      const std::size_t in_use = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
      s += "less than " + format_bytes(request) + " once backed (" +
           format_bytes(limit_ > in_use ? limit_ - in_use : 0) +
           " of the budget is not in use but lies in granules that blocks in use share, and " +
           format_bytes(limit_ - held) + " is left to back new granules)";
    } else if (allocatable < largest) {
      // Backed on demand, free blocks are address space (address_factor times the
      // budget): what of one the budget can back is the figure that decides.
      s += format_bytes(allocatable) + " within the budget";
    } else {
      s += format_bytes(largest);
      if (allocatable > largest) s += " (" + format_bytes(allocatable) + " could be reserved)";
    }
    if (overshoot_in_use_ != 0) s += ", " + format_bytes(overshoot_in_use_) + " granted over budget";
    if (passthrough_in_use_ != 0) {
      s += ", " + format_bytes(passthrough_in_use_) + " allocated before the budget was set";
    }
  }
  return s;
}

std::string pool::describe() const {
  std::lock_guard<pool_lock> lock(mutex_);
  std::string backing = upstream_->backing_summary();
  if (num_reclaims_ > 0) {
    char ms[64];
    std::snprintf(ms, sizeof ms, "; %lld reclaims took %.1f ms", static_cast<long long>(num_reclaims_),
                  reclaim_ns_ / 1e6);
    backing += ms;
  }
  if (trim_given_up_) {
    backing += "; trim_above_peak turned off after " + std::to_string(trim_syncs_) +
               " synchronizations in " + std::to_string(trim_allocs_) + " allocations";
  }
  return state_locked() + "; " + std::to_string(regions_.size()) + " region(s), " +
         format_bytes(held_locked()) + " reserved, " + std::to_string(live_.size() + direct_.size()) +
         " block(s) in use" + (backing.empty() ? "" : "; " + backing);
}

std::vector<tfmg_trace_event> pool::trace(std::uint64_t* dropped) const {
  std::lock_guard<pool_lock> lock(mutex_);
  if (dropped != nullptr) *dropped = trace_.dropped();
  return trace_.events();
}

void pool::trace_clear() {
  std::lock_guard<pool_lock> lock(mutex_);
  trace_.clear();
}

void pool::trace_start(std::size_t capacity) {
  std::lock_guard<pool_lock> lock(mutex_);
  trace_.restart(capacity);
}

std::vector<tfmg_live_block> pool::live_blocks() const {
  std::lock_guard<pool_lock> lock(mutex_);
  std::vector<tfmg_live_block> out;
  out.reserve(live_.size() + direct_.size());
  live_.for_each([&out](std::uintptr_t, const block* b) {
    out.push_back(tfmg_live_block{b->addr, b->size,
                                  TFMG_ALLOC_KIND(b->kind) | (b->batch ? TFMG_ALLOC_BATCH : 0u),
                                  b->owner->index, b->addr - b->owner->base});
  });
  for (const auto& d : direct_) {
    if (!d.second.overshoot) continue;  // pass-through predates the budget
    out.push_back(tfmg_live_block{d.first, d.second.size,
                                  TFMG_ALLOC_KIND(d.second.kind) | TFMG_ALLOC_MUST_SUCCEED |
                                      (d.second.batch ? TFMG_ALLOC_BATCH : 0u),
                                  -1, 0});
  }
  std::sort(out.begin(), out.end(),
            [](const tfmg_live_block& a, const tfmg_live_block& b) { return a.address < b.address; });
  return out;
}

// ---------------------------------------------------------------------------------
// Block objects

void pool::note_held_locked() { peak_reserved_ = std::max(peak_reserved_, held_locked()); }

pool::block* pool::new_block_locked() {
  if (spare_blocks_.empty()) {
    block_chunks_.emplace_back(new block[kBlockChunk]);
    block* chunk = block_chunks_.back().get();
    spare_blocks_.reserve(spare_blocks_.size() + kBlockChunk);
    for (std::size_t i = kBlockChunk; i-- > 0;) spare_blocks_.push_back(&chunk[i]);
  }
  block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void pool::recycle_block_locked(block* b) { spare_blocks_.push_back(b); }

// ---------------------------------------------------------------------------------
// Invariants

bool pool::is_valid(std::string* why) const {
  std::lock_guard<pool_lock> lock(mutex_);
  auto fail = [why](const std::string& what) {
    if (why != nullptr) *why = what;
    return false;
  };
  // The exact lists first: every listed block once, free in a serving region, in the
  // list of its size, linked both ways.
  std::unordered_set<const block*> listed;
  for (int z = 0; z < 2; ++z) {
    for (std::size_t n = 0; n < kExact; ++n) {
      for (const block* x = zones_[z].lists[n], *before = nullptr; x != nullptr; before = x, x = x->fnext) {
        if (!x->free || x->owner->draining || (x->size >> granule_shift_) != n || x->at.fprev != before ||
            x->zone != z || !listed.insert(x).second) {
          return fail("list " + std::to_string(n) + " of zone " + std::to_string(z) +
                      " holds a block that is not free there, or a broken link");
        }
      }
    }
  }
  std::size_t reserved = 0, used = 0, free_blocks = 0, used_blocks = 0;
  for (const auto& r : regions_) {
    reserved += r->size;
    if (r->first == nullptr || r->first->addr != r->base || r->first->prev != nullptr) {
      return fail("region " + std::to_string(r->index) + " does not start with its first block");
    }
    std::uintptr_t expect = r->base;
    const block* prev = nullptr;
    for (const block* b = r->first; b != nullptr; prev = b, b = b->next) {
      const std::string where = "block at offset " + std::to_string(b->addr - r->base) +
                                " of region " + std::to_string(r->index);
      if (b->addr != expect) return fail(where + ": blocks do not tile the region");
      if (b->prev != prev) return fail(where + ": broken prev link");
      if (b->owner != r.get()) return fail(where + ": wrong owner");
      if (b->zone != r->zone) return fail(where + ": not of its region's zone");
      if (r->zone != 0 && zone_threshold_ == 0) return fail(where + ": in a second zone of a pool without zones");
      if (b->size == 0 || b->size % granule_ != 0 || b->addr % granule_ != 0) {
        return fail(where + ": size or address not a multiple of the granule");
      }
      if (backs_ && !r->draining) {
        if (!b->free && !b->backed) return fail(where + ": in use but not marked backed");
        if (b->backed && upstream_->unbacked(reinterpret_cast<void*>(b->addr), b->size) != 0) {
          return fail(where + ": marked backed, but granules under it are not");
        }
      }
      if (b->free && r->draining) {
        if (prev != nullptr && prev->free) return fail(where + ": two free neighbours not coalesced");
      } else if (b->free) {
        ++free_blocks;
        if (prev != nullptr && prev->free) return fail(where + ": two free neighbours not coalesced");
        if (exact(b->size)) {
          // Checked from the lists' side below: every listed block is free, in the list
          // of its size, linked both ways; here that it is listed at all.
          if (listed.count(b) == 0) return fail(where + ": free but not in the list of its size");
        } else if (b->bin != bin_of(b->size) || b->at.where->b != b || b->at.where->size != b->size ||
                   b->at.where->addr != b->addr ||
                   zones_[b->zone].bins[b->bin].find(*b->at.where) != b->at.where) {
          return fail(where + ": free but not indexed in its bin");
        }
      } else {
        ++used_blocks;
        used += b->size;
        if (live_.find(b->addr) != b) return fail(where + ": in use but not in the live map");
      }
      expect = b->addr + b->size;
    }
    if (expect != r->base + r->size) {
      return fail("region " + std::to_string(r->index) + ": blocks do not cover it to the end");
    }
  }
  std::size_t listed_count = 0;
  for (const free_index& ix : zones_) {
    for (unsigned i = 0; i < kBins; ++i) {
      const bool bit = (ix.bin_bits[i / 64] >> (i % 64)) & 1;
      if (bit == ix.bins[i].empty()) return fail("bin bitmap disagrees with bin " + std::to_string(i));
      for (const free_key& k : ix.bins[i]) {
        if (exact(k.size)) return fail("a tree bin holds a block of an exact size");
        if (&zones_[k.b->zone] != &ix) return fail("a tree bin holds a block of the other zone");
      }
    }
    for (std::size_t n = 0; n < kExact; ++n) {
      const bool bit = (ix.list_bits[n / 64] >> (n % 64)) & 1;
      if (bit != (ix.lists[n] != nullptr)) return fail("list bitmap disagrees with list " + std::to_string(n));
    }
    for (std::size_t w = 0; w < kExactWords; ++w) {
      const bool mid = (ix.list_mids[w / 64] >> (w % 64)) & 1;
      if (mid != (ix.list_bits[w] != 0)) return fail("list bitmap level 1 disagrees at word " + std::to_string(w));
    }
    for (std::size_t m = 0; m < kExactMids; ++m) {
      if (((ix.list_top >> m) & 1) != (ix.list_mids[m] != 0)) return fail("list bitmap level 2 disagrees");
    }
    listed_count += ix.listed;
    if (ix.largest_known) {
      const block* top = largest_free_block_locked(ix);
      if (ix.largest_size != (top == nullptr ? 0 : top->size)) {
        return fail("the kept size of the largest free block is " + std::to_string(ix.largest_size) + ", not " +
                    std::to_string(top == nullptr ? 0 : top->size));
      }
    }
  }
  if (listed.size() != listed_count) return fail("the count of listed free blocks is wrong");
  if (free_blocks != free_block_count_locked()) return fail("free index holds blocks that are not free");
  if (used_blocks != live_.size()) return fail("live map holds blocks that are not in use");
  if (used != pooled_in_use_) return fail("bytes in use do not match the blocks in use");
  if (reserved != reserved_) return fail("bytes reserved do not match the regions");
  std::size_t draining = 0, draining_used = 0;
  for (const auto& r : regions_) {
    if (!r->draining) continue;
    draining += r->size;
    for (const block* b = r->first; b != nullptr; b = b->next) draining_used += b->free ? 0 : b->size;
  }
  if (draining != draining_) return fail("draining bytes do not match the draining regions");
  if (draining_used != draining_in_use_) return fail("bytes in use in draining regions do not match their counter");
  // Backed on demand, a region is address space and may outlast a lowered budget; the
  // budget bounds the bytes backed, checked below.
  if (limit_ != 0 && !backs_ && reserved_ - draining_ > space_limit_locked()) {
    return fail("reserved bytes exceed the budget");
  }
  std::size_t pass = 0, over = 0, batch = 0;
  for (const auto& d : direct_) {
    (d.second.overshoot ? over : pass) += d.second.size;
    if (d.second.batch) batch += d.second.size;
  }
  live_.for_each([&batch](std::uintptr_t, const block* b) {
    if (b->batch) batch += b->size;
  });
  if (batch != batch_in_use_) return fail("batch-tagged bytes do not match their counter");
  if (pass != passthrough_in_use_ || over != overshoot_in_use_) {
    return fail("direct blocks do not match their counters");
  }
  std::size_t by_kind[TFMG_NUM_KINDS] = {}, over_by_kind[TFMG_NUM_KINDS] = {};
  for (const auto& d : direct_) {
    by_kind[d.second.kind] += d.second.size;
    if (d.second.overshoot) over_by_kind[d.second.kind] += d.second.size;
  }
  live_.for_each([&by_kind](std::uintptr_t, const block* b) { by_kind[b->kind] += b->size; });
  for (int k = 0; k < TFMG_NUM_KINDS; ++k) {
    if (by_kind[k] != in_use_by_kind_[k] || over_by_kind[k] != overshoot_in_use_by_kind_[k]) {
      return fail("bytes in use of kind " + std::to_string(k) + " do not match their counter");
    }
  }
  const std::size_t in_use = pooled_in_use_ + passthrough_in_use_ + overshoot_in_use_;
  if (peak_in_use_ < in_use || window_peak_ < in_use) return fail("a peak is below the current use");
  if (peak_reserved_ < held_locked()) return fail("peak reserved is below the current reservation");
  if (backs_ && (backed_ < used || backed_ > reserved_ || backed_ % upstream_->page_size() != 0)) {
    return fail("bytes backed do not cover the blocks in use, or exceed the regions");
  }
  return true;
}

}  // namespace tfmg
