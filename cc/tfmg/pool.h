// The budget pool: best fit, split, coalesce, hard budget.
//
// Glossary
//   upstream   where memory comes from (host pages; later CUDA device memory).
//   region     one contiguous piece obtained from the upstream and carved into blocks.
//   block      a contiguous part of a region, either in use (handed out) or free.
//              Blocks of a region tile it exactly, in address order.
//   direct     a block served by the upstream outside any region: pass-through (no
//              budget set yet) and overshoot (MUST_SUCCEED requests over the budget).
//   granule    the minimum alignment; every block size is a multiple of it.
//   budget     max_bytes. bytes_reserved (sum of region sizes) never exceeds it.
//   in use     bytes of blocks handed out, rounded to the granule.
//   account    pooled bytes in use plus overshoot: what the budget answers for.
//              Overshoot counts against the budget, so a request that can be refused
//              is refused when it would take the account over the budget; only
//              unrefusable (MUST_SUCCEED) requests take it further.
//   kind       what asked for a block (TFMG_KIND_*: a kernel, tf.data, a constant...);
//              bytes in use are kept by kind, so a refusal can say what holds memory.
//   refusal    a request the budget could not serve; recorded with the state then.
//
// Placement. A request takes the smallest free block that fits (best fit; ties among
// blocks of one exact size go to the head of its list, which a newly freed block joins
// only at a higher address than the head's; among larger blocks, by address). "Large"
// requests (>= small_threshold) are carved from the low end of that block, small ones
// from the high end, so small blocks gather at the top of the free space and large
// ones at the bottom: a long-lived small block then rarely sits between two large free
// blocks and keeps them from merging.
//
// Growth policy. By default the whole budget is one region, reserved at the first
// allocation: no region boundary can split free space (with lazily grown regions, a
// 20 MB request failed under an 80 MB budget with 40 MB in use, the free space cut
// into regions of 2 to 32 MB). On host the region is address space (mmap, NORESERVE)
// until pages are touched, so physical memory still follows use. With region_bytes
// set, regions are reserved lazily: the first of region_bytes or the request, each
// next twice the last, clipped to the budget left; when a request does not fit and the
// budget is spent, empty regions go back first so one larger region can replace them.
// release_unused() returns empty regions, and the pages of free blocks, on demand.
//
// Backing on demand. Where the upstream maps physical memory lazily (CUDA virtual
// memory: see upstream::backs_on_demand), the region is address space, and the pages
// under a block are mapped when the block is handed out; they stay mapped until
// release_unused(). bytes_reserved then counts the bytes backed (what the device
// gives up), never more than the budget. The budget bounds the bytes backed, not the
// address space: regions reserve address_factor times the budget (2 by default), so
// that a request rarely lacks a hole, and when backing a block would cross the budget
// the pool first takes back the granules that lie wholly inside free blocks, largest
// free blocks first (on CUDA that waits for the device). A request is refused only when
// what is in use, rounded to granules, leaves no room. Fragmentation then costs address
// space, which is free, instead of memory.
//
// Zones. Where the upstream backs on demand in granules much larger than many requests
// (CUDA's 2 MiB), a small block that lands in a hole between large blocks keeps its
// granule backed after they go, and the budget then counts a granule for a few KiB.
// With a zone threshold, requests below it take blocks only from regions of their own
// (address space beside the large requests' regions, as much as the budget), and large
// requests never take those: the budget is shared, the address space and the free
// index are not. A small request that its zone cannot serve falls back to the other.
// On random churn traces of 2 MiB granules a threshold of 64 KiB cut the smallest budget
// that completes (over peak live bytes, eight seeds, benchmarks/NOTES.md "Small blocks
// in a zone of their own") from 1.087 to 1.065 (2,000 blocks live) and from 1.054 to
// 1.040 (10,000); on a real training trace it raised what is backed. Off by default.
//
// Cost. Best fit is three bit scans over the exact-size free lists, or one lookup in a
// size-ordered tree for blocks of 2^15 granules and more; a free is one hash lookup
// plus O(1) neighbour checks through the blocks' address links: at most O(log n) per
// call in the number of free blocks, with no scan of a block list. Reclaiming free
// granules (backed on demand, at the budget only) walks the free blocks once.
#ifndef TFMG_POOL_H_
#define TFMG_POOL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/tfmg/c_api.h"
#include "cc/tfmg/addr_map.h"
#include "cc/tfmg/free_wait.h"
#include "cc/tfmg/lock.h"
#include "cc/tfmg/node_allocator.h"
#include "cc/tfmg/trace.h"
#include "cc/tfmg/upstream.h"

namespace tfmg {

struct pool_config {
  std::size_t max_bytes = 0;  // 0: pass-through until set_limit()
  std::size_t alignment = 0;  // 0: upstream default
  std::size_t region_bytes = SIZE_MAX;  // the whole budget, up front
  std::size_t small_threshold = 1u << 20;
  std::size_t trace_capacity = 0;
  // Where the upstream backs on demand: address space reserved per byte of budget.
  // 0: 2 (1 where it does not back on demand, where it has no effect).
  std::size_t address_factor = 0;
  // Where the upstream backs on demand: when backing a block would take the bytes
  // backed above (1 + trim_above_peak) times the largest bytes in use so far, free
  // granules are taken back first (fewer bytes held, more remapping). 0: off, the
  // budget alone bounds what is backed. The pool turns it off by itself when trimming
  // costs the upstream synchronizations (more than 16, and more than one per 1,000
  // allocations): steps that repeat (training) trim for free, random churn does not.
  double trim_above_peak = 0.0;
  // Requests below this many bytes are served from a zone of their own (regions of
  // address space only they use); 0: one zone for all. See "Zones" above.
  std::size_t zone_threshold = 0;
};

// Thrown by the pool (and turned into statuses by the C API). Carries a message with
// numbers, as the user should see it.
struct pool_error {
  tfmg_status status;
  std::string message;
};

class pool {
 public:
  pool(std::unique_ptr<upstream> up, const pool_config& config);
  ~pool();
  pool(const pool&) = delete;
  pool& operator=(const pool&) = delete;

  // Returns nullptr with *error set on failure (never throws on the hot path). With
  // TFMG_ALLOC_WAIT, a request that does not fit waits for frees first (free_wait.h).
  void* allocate(std::size_t bytes, std::size_t alignment, unsigned flags, pool_error* error) {
    if (flags & TFMG_ALLOC_WAIT) return allocate_waiting(bytes, alignment, flags & ~TFMG_ALLOC_WAIT, error);
    return allocate_now(bytes, alignment, flags, error);
  }
  // How long a waiting request waits without a free before it is refused (0: never waits).
  void set_wait_ns(std::int64_t idle_ns) { waiter_.set_idle_ns(idle_ns); }
  std::int64_t wait_ns() const { return waiter_.idle_ns(); }
  // The step that failed has unwound: requests wait again at once (free_wait.h, episodes).
  void end_failed_wait() { waiter_.end_episode(); }
  // Returns false with *error set for unknown pointers and double frees.
  bool deallocate(void* p, std::size_t* size_out, pool_error* error);
  bool block_size(const void* p, std::size_t* out) const;

  // With `drain`, lowering works whatever is held: regions that cannot be released
  // (they hold blocks in use) stop serving and go back with their last block.
  bool set_limit(std::size_t max_bytes, bool drain, pool_error* error);
  tfmg_stats stats() const;
  void clear_stats();
  void reset_peak();
  bool last_refusal(tfmg_refusal* out) const;
  std::size_t release_unused();
  std::size_t in_use_blocks() const;
  // Releases everything to the upstream, in use or not. Used by destroy(force).
  void release_all();

  std::vector<tfmg_trace_event> trace(std::uint64_t* dropped) const;
  void trace_clear();
  void trace_start(std::size_t capacity);  // cleared; recording up to capacity events (0: stop)
  std::vector<tfmg_live_block> live_blocks() const;  // in use under the budget, by address

  // Walks every invariant; returns false with *why naming the first broken one.
  bool is_valid(std::string* why) const;
  std::string describe() const;

  const upstream& source() const { return *upstream_; }
  std::size_t small_threshold() const { return small_threshold_; }
  std::size_t address_factor() const { return address_factor_; }
  std::size_t zone_threshold() const { return zone_threshold_; }
  std::size_t granule() const { return granule_; }

 private:
  struct region;
  struct block;
  void* allocate_now(std::size_t bytes, std::size_t alignment, unsigned flags, pool_error* error);
  void* allocate_waiting(std::size_t bytes, std::size_t alignment, unsigned flags, pool_error* error);
  // The budget (0: none), read under the lock.
  std::size_t budget();
  bool deallocate_locked(void* p, std::size_t* size_out, pool_error* error);
  bool set_limit_locked(std::size_t max_bytes, bool drain, pool_error* error);
  // The tree key holds size and address itself, so a search touches only tree nodes,
  // never the blocks (half the cache misses of a tree of block pointers).
  struct free_key {
    // Mutable so that rekey_free_locked can update a node in place when the new key
    // keeps its position; never changed otherwise.
    mutable std::size_t size;
    mutable std::uintptr_t addr;
    block* b;
    bool operator<(const free_key& o) const { return size != o.size ? size < o.size : addr < o.addr; }
  };
  using free_set = std::set<free_key, std::less<free_key>, node_allocator<free_key>>;
  // One cache line each (64 bytes, aligned): a block is touched at every call that
  // carves, frees or coalesces it, and 80 bytes straddled two lines for three blocks in
  // four (benchmarks/NOTES.md, "Fewer instructions and cache lines per call").
  struct alignas(64) block {
    std::uintptr_t addr;
    std::size_t size;
    block* prev;  // address neighbours in the same region; null at the ends
    block* next;
    region* owner;
    bool free;
    // Where the upstream backs on demand: every granule under the block is backed. False
    // means "not known": back_block_locked asks the upstream. A block in use is backed;
    // a free block keeps the flag of what it was carved from or made of (all of them
    // backed), and loses it when granules inside it go back (reclaim, release_unused).
    // Saves the upstream's lookup on nearly every allocation far from the budget.
    bool backed;
    bool batch;                // in use and tagged TFMG_ALLOC_BATCH
    unsigned char kind;        // in use: TFMG_KIND_* of its request
    std::uint16_t bin;         // while free in a tree bin: its bin, and its place there
    unsigned char zone;        // the zone of its region (index of zones_)
    // A free block is in a tree bin (where: its node) or in an exact list (fprev and
    // fnext: its list neighbours), never both; the two share a word.
    union free_place {
      free_set::iterator where;
      block* fprev;
      free_place() : fprev(nullptr) {}
    } at;
    block* fnext;
  };
  static_assert(sizeof(block) == 64, "a block is one cache line");
  struct region {
    std::uintptr_t base;
    std::size_t size;
    int index;
    unsigned char zone = 0;  // 1: the small requests' zone (see "Zones")
    block* first;
    bool draining = false;  // serves no request; released when its last block is freed
  };
  struct direct_block {
    std::size_t size;
    std::size_t alignment;
    bool overshoot;  // false: pass-through (predates the budget)
    bool batch;
    unsigned char kind;
  };
  using direct_map =
      std::unordered_map<std::uintptr_t, direct_block, std::hash<std::uintptr_t>,
                         std::equal_to<std::uintptr_t>,
                         node_allocator<std::pair<const std::uintptr_t, direct_block>>>;

  // The free index. Blocks of fewer than kExact granules (2 MiB on host, 8 MiB on a
  // GPU) sit in one list per exact size, under a three-level bitmap of the non-empty
  // lists: best fit is the head of the first non-empty list at or above the request,
  // found with three bit scans, and every insert or erase is O(1). Larger free blocks
  // are kept in bins by size class (eight per power of two), each bin a tree ordered by
  // (size, address), and a bitmap of the non-empty bins. Every block of a bin is larger
  // than every block of the bins below it, so best fit there is: the lower bound in the
  // request's own bin, else the smallest block of the next non-empty bin.
  static constexpr unsigned kBins = 512;
  static constexpr std::size_t kExact = std::size_t{1} << 15;
  static constexpr std::size_t kExactWords = kExact / 64;   // level 0: one bit per list
  static constexpr std::size_t kExactMids = kExactWords / 64;  // level 1: one bit per word
  bool exact(std::size_t size) const { return (size >> granule_shift_) < kExact; }
  // The free index of one zone: exact lists under their bitmap, tree bins under theirs,
  // and the kept size of its largest free block.
  struct free_index {
    std::vector<block*> lists;                 // kExact heads; index: size in granules
    std::vector<std::uint64_t> list_bits;      // kExactWords
    std::uint64_t list_mids[kExactMids] = {};  // bit w: list_bits[w] != 0
    std::uint64_t list_top = 0;                // bit m: list_mids[m] != 0
    std::size_t listed = 0;                    // free blocks in the exact lists
    std::vector<free_set> bins;
    std::uint64_t bin_bits[kBins / 64] = {};
    // The size of the largest free block, while largest_known (see below, at zones_).
    mutable std::size_t largest_size = 0;
    mutable bool largest_known = false;
  };
  // The zone a request takes its block from (see "Zones").
  int zone_of(std::size_t size) const { return size < zone_threshold_ ? 1 : 0; }
  // The first listed block of at least n granules.
  block* exact_fit_locked(const free_index& ix, std::size_t n) const;
  static unsigned bin_of(std::size_t size);
  // Each of these picks the block's zone by a branch, into a copy of the body made for that
  // zone (the index at a fixed offset): an index computed from the block's zone byte put
  // a load and a multiply before every list access, 5-7% of the time of a call on the
  // latency traces (benchmarks/NOTES.md, "Small blocks in a zone of their own").
  void insert_free_locked(block* b);
  void insert_free_in(free_index& ix, block* b);
  // Changes a free block's place or size in the index. The kept largest size is the
  // caller's (raise_largest_locked, forget_if_largest_locked): in here it cost the
  // compiler's partial inlining of the in-place path, 20 instructions a call.
  void rekey_free_locked(block* b, std::uintptr_t addr, std::size_t size);
  void rekey_free_in(free_index& ix, block* b, std::uintptr_t addr, std::size_t size);
  // A free block of `size` is indexed: the largest free size is at least that (a stale
  // value, while unknown, is harmless: the next read scans).
  void raise_largest_locked(int zone, std::size_t size) { raise_largest_locked(zones_[zone], size); }
  static void raise_largest_locked(free_index& ix, std::size_t size) {
    if (size > ix.largest_size) ix.largest_size = size;
  }
  // Free block `b` leaves the index or shrinks: if it was of the largest size, that size
  // is no longer known.
  void forget_if_largest_locked(const block* b) {
    free_index& ix = zones_[b->zone];
    if (b->size == ix.largest_size) ix.largest_known = false;
  }
  static void link_after(block* at, block* nb);
  static void link_before(block* at, block* nb);
  static void unlink(block* x);
  void erase_free_locked(block* b);
  void erase_free_in(free_index& ix, block* b);
  block* largest_free_block_locked(const free_index& ix) const;  // a scan of the bitmaps from the top
  std::size_t free_block_count_locked() const;

  // All _locked members require mutex_ held.
  block* find_fit_locked(int zone, std::size_t size, std::size_t alignment, bool small);
  // Backed on demand, at the budget: the free block (of at least `size`) where a block of
  // `size` needs the fewest granules newly backed, and whether at its low end.
  block* least_backing_fit_locked(int zone, std::size_t size, bool* low);
  block* carve_locked(block* b, std::size_t size, std::size_t alignment, bool small);
  bool grow_locked(std::size_t size, std::size_t alignment, int zone);
  // Address space of the regions of `zone` that serve, and the most they may take.
  std::size_t zone_reserved_locked(int zone) const;
  std::size_t zone_space_locked(int zone) const;
  std::size_t release_unused_locked();
  void drain_region_locked(region* r);
  void free_in_draining_locked(block* b);
  void return_region_locked(region* r);   // to the upstream, counters updated
  void release_region_locked(region* r);  // the same, and out of regions_
  void* allocate_direct_locked(std::size_t size, std::size_t alignment, bool overshoot,
                               unsigned flags, pool_error* error);
  void free_block_locked(block* b);
  void refuse_locked(std::size_t bytes, std::size_t alignment, unsigned flags, pool_error* error);
  void note_alloc_locked(std::size_t size, bool batch, unsigned kind);
  void note_free_locked(std::size_t size, bool batch, unsigned kind);
  // The part of the budget that pooled blocks may take: the budget less the overshoot
  // in use (which counts against it).
  std::size_t budget_left_locked() const { return limit_ - std::min(limit_, overshoot_in_use_); }
  // The largest free block's size, of either zone: every allocation reads it, so the case
  // of kept sizes is inline (a loop over the zones out of line cost 7 instructions an
  // allocation on churn_2000).
  std::size_t largest_free_locked() const {
    const free_index& a = zones_[0];
    if (zone_threshold_ == 0) {
      if (a.largest_known) return a.largest_size;
    } else if (a.largest_known && zones_[1].largest_known) {
      return std::max(a.largest_size, zones_[1].largest_size);
    }
    return largest_free_slow_locked();
  }
  std::size_t largest_free_slow_locked() const;
  std::size_t largest_allocatable_locked() const;
  void fill_stats_locked(tfmg_stats* s) const;
  std::string state_locked(std::size_t request = 0) const;
  block* new_block_locked();
  void recycle_block_locked(block* b);
  // bytes_reserved as reported: bytes backed where the upstream backs on demand.
  std::size_t held_locked() const { return backs_ ? backed_ : reserved_; }
  // The most address space regions may take: the budget, times address_factor_ where
  // the upstream backs on demand.
  std::size_t space_limit_locked() const {
    return limit_ > SIZE_MAX / address_factor_ ? SIZE_MAX : limit_ * address_factor_;
  }
  // Backs [b->addr, +b->size) within the budget, taking back free granules first if
  // needed. False (nothing backed beyond what was) when the budget or the device has
  // no room; *device_full tells which. Inline, the case of nearly every allocation away
  // from the budget: the block is backed already and nothing is to be taken back (a call
  // cost 34 instructions of the pool's ~320 per operation on churn_2000, benchmarks/NOTES.md,
  // "Two calls inlined").
  bool back_block_locked(block* b, bool* device_full) {
    pooled_peak_ = std::max(pooled_peak_, pooled_in_use_ + b->size);
    if (b->backed && trim_ == 0 && backed_ <= budget_left_locked()) return true;
    return back_block_slow_locked(b, device_full);
  }
  bool back_block_slow_locked(block* b, bool* device_full);
  // Counts what trimming cost the upstream (synchronizations since syncs_before) and
  // turns it off when that is too much.
  void note_trim_locked(bool trimmed, std::uint64_t syncs_before);
  // Takes back (retires) granules wholly inside free blocks until `bytes` are gone (or
  // all are); returns the bytes taken, or with dry_run those it would take, changing
  // nothing.
  std::size_t reclaim_locked(std::size_t bytes, bool dry_run);
  void note_held_locked();
  void describe_pointer_error_locked(std::uintptr_t p, pool_error* error) const;

  std::unique_ptr<upstream> upstream_;
  const std::size_t granule_;
  const std::size_t small_threshold_;
  const std::size_t zone_threshold_;
  const std::size_t first_region_bytes_;
  const unsigned granule_shift_;
  // The size of the largest free block is kept per zone while known
  // (free_index::largest_size): every allocation reads it (the window's tightest fit),
  // and a scan from the top of the bitmaps and the tree's last node cost 52 instructions
  // per allocation on churn_2000, an eighth of the call (benchmarks/NOTES.md, "The
  // largest free block, kept"). A larger block indexed raises it; the block of that size
  // leaving the index or shrinking forgets it (the next read scans again). In a steady
  // churn the largest block is the region's untouched rest, which best fit seldom cuts.

  mutable pool_lock mutex_;
  node_arena arena_;  // declared before the containers that use it
  free_index zones_[2];  // 0: large requests (all, without zones); 1: small ones
  addr_map<block*> live_;  // block address -> block, for blocks in use
  direct_map direct_;
  std::vector<std::unique_ptr<region>> regions_;
  std::vector<block*> spare_blocks_;
  std::vector<std::unique_ptr<block[]>> block_chunks_;
  std::size_t next_region_bytes_;
  int next_region_index_ = 0;

  std::size_t limit_;  // 0: pass-through
  std::size_t pooled_in_use_ = 0;
  std::size_t passthrough_in_use_ = 0;
  std::size_t overshoot_in_use_ = 0;
  std::size_t reserved_ = 0;  // bytes of regions (address space where backs_)
  std::size_t draining_ = 0;  // of which in draining regions (outside the budget's count)
  std::size_t draining_in_use_ = 0;  // of pooled_in_use_, blocks in draining regions
  const bool backs_;          // the upstream backs regions on demand
  const std::size_t address_factor_;
  double trim_;                  // 0 once trimming turned out to cost synchronizations
  std::uint64_t reclaim_ns_ = 0;   // time in reclaims (walks, unmapping, backing after)
  std::uint64_t trim_syncs_ = 0;   // synchronizations that trimming caused
  std::uint64_t trim_allocs_ = 0;  // allocations while trimming was on
  bool trim_given_up_ = false;
  std::size_t pooled_peak_ = 0;  // the most pooled bytes in use at once (for trim_)
  std::size_t backed_ = 0;    // bytes backed by physical memory, where backs_

  std::int64_t num_allocs_ = 0;
  std::int64_t num_frees_ = 0;
  std::int64_t num_refusals_ = 0;
  std::int64_t num_overshoots_ = 0;
  std::int64_t num_reclaims_ = 0;
  std::int64_t bytes_reclaimed_ = 0;
  std::int64_t overshoots_by_kind_[TFMG_NUM_KINDS] = {};
  std::int64_t overshoot_bytes_by_kind_[TFMG_NUM_KINDS] = {};
  std::size_t in_use_by_kind_[TFMG_NUM_KINDS] = {};
  std::size_t overshoot_in_use_by_kind_[TFMG_NUM_KINDS] = {};
  std::size_t peak_in_use_ = 0;
  std::size_t window_peak_ = 0;
  std::size_t batch_in_use_ = 0;
  std::size_t window_peak_batch_ = 0;
  std::size_t window_max_batch_ = 0;      // most batch-tagged bytes live at once
  std::size_t window_in_use_at_max_batch_ = 0;
  std::size_t window_tight_slack_ = SIZE_MAX;  // largest free block minus request, least
  std::size_t window_tight_request_ = 0;
  std::size_t window_tight_largest_ = 0;
  std::size_t window_tight_in_use_ = 0;
  std::size_t peak_reserved_ = 0;
  std::size_t peak_overshoot_ = 0;
  std::size_t largest_alloc_ = 0;
  bool has_refusal_ = false;
  tfmg_refusal last_refusal_{};

  trace_recorder trace_;
  free_waiter waiter_;  // its own atomics: used outside mutex_
};

// "1.25 GiB", "512 B": sizes as the user should read them.
std::string format_bytes(std::uint64_t bytes);

}  // namespace tfmg

#endif  // TFMG_POOL_H_
