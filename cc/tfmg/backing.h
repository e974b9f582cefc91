// Which granules of an upstream's regions have physical memory under them, for
// upstreams that back regions on demand (upstream::backs_on_demand): CUDA virtual
// memory, and host memory reserved PROT_NONE. The upstream supplies how one granule is
// mapped and unmapped; this keeps the per-region records and walks the ranges.
//
// Moving granules without waiting for the device (retire(), settle()). Unmapping a
// granule is safe only once the device has finished the work queued before it (kernels
// may still use a block already freed): a device synchronization, and the host's lead
// over the device goes with it. A reclaim at the budget does without: retire() takes the
// physical handles of free granules out of the count and leaves their mappings in place
// ("stale"), and back() maps those same handles under the granules the new block needs.
// The new block's work is queued after the old block's, on the same stream, so one
// physical page serves both, in order (the reasoning by which every caching allocator
// reuses a freed block at once). A stale granule the pool backs again gets its handle
// back for free while the handle is still spare (steps that repeat do this over and
// over); otherwise its mapping must go first, and that is where a synchronization is
// needed, unless one came after it was retired. settle() releases the handles retired
// but not used again, so that the bytes backed equal the physical memory held again.
#ifndef TFMG_BACKING_H_
#define TFMG_BACKING_H_

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace tfmg {

class backing_map {
 public:
  using handle = std::uint64_t;  // what mapping a granule returned; 0: not backed

  explicit backing_map(std::size_t granule) : granule_(granule) {}

  std::size_t granule() const { return granule_; }

  void add_region(std::uintptr_t base, std::size_t size) {
    record& r = regions_[base];
    r.h.assign(size / granule_, 0);
    r.bits.assign((size / granule_ + 63) / 64, 0);
  }

  backing_map(const backing_map& o)
      : granule_(o.granule_),
        regions_(o.regions_),
        stale_(o.stale_),
        spare_(o.spare_),
        retired_seq_(o.retired_seq_),
        synced_seq_(o.synced_seq_),
        counts_(o.counts_) {}
  backing_map& operator=(const backing_map& o) {
    granule_ = o.granule_;
    regions_ = o.regions_;
    stale_ = o.stale_;
    spare_ = o.spare_;
    retired_seq_ = o.retired_seq_;
    synced_seq_ = o.synced_seq_;
    counts_ = o.counts_;
    last_ = regions_.end();
    return *this;
  }

  // What back(), retire() and settle() did, for describe().
  struct counts {
    std::uint64_t created = 0;      // granules mapped with a new handle
    std::uint64_t moved = 0;        // granules mapped with a retired handle
    std::uint64_t reactivated = 0;  // stale granules given their own handle back
    std::uint64_t retired = 0;      // granules retire() took
    std::uint64_t syncs = 0;        // synchronizations asked for by back() and settle()
  };
  const counts& stats() const { return counts_; }
  std::string summary() const {
    if (counts_.created == 0) return std::string();
    return "granules mapped " + std::to_string(counts_.created) + " new, " + std::to_string(counts_.moved) +
           " moved, " + std::to_string(counts_.reactivated) + " reactivated; " +
           std::to_string(counts_.retired) + " retired, " + std::to_string(counts_.syncs) + " synchronization(s)";
  }

  // Unmaps what is backed in the region at base and forgets it. The device has
  // finished its work (the caller synchronized): stale mappings go too (drop(addr)
  // unmaps one and keeps its handle).
  template <class Drop, class Unmap>
  void remove_region(std::uintptr_t base, Drop drop, Unmap unmap) {
    auto it = regions_.find(base);
    if (it == regions_.end()) return;
    drop_stale(drop);
    release(it, 0, it->second.h.size(), unmap);
    if (last_ == it) last_ = regions_.end();
    regions_.erase(it);
  }

  bool has_region(std::uintptr_t base) const { return regions_.count(base) != 0; }

  // Backs every granule of [p, p + bytes) that is not. A stale granule whose handle is
  // still spare gets it back (no call). Otherwise a spare handle is mapped there with
  // remap(addr, h) (false on failure), or a new one with map(addr) (a handle; 0 on
  // failure). A stale mapping in the way goes first (drop(addr)), after sync() if it was
  // retired since the last one. open(addr, bytes) runs once per run of granules with a
  // handle newly mapped (false on failure). *added: bytes newly backed, also on failure:
  // runs before the failing one stay backed, the failing run's granules are unbacked
  // again as retire() does (the caller then calls settle()).
  template <class Map, class Remap, class Open, class Sync, class Drop>
  bool back(std::uintptr_t p, std::size_t bytes, Map map, Remap remap, Open open, Sync sync, Drop drop,
            std::size_t* added) {
    *added = 0;
    if (bytes == 0) return true;
    auto it = find(p);
    if (it == regions_.end()) return false;
    std::vector<handle>& h = it->second.h;
    const std::uintptr_t base = it->first;
    const std::size_t last = (p + bytes - 1 - base) / granule_;
    if (it->second.all_backed((p - base) / granule_, last)) return true;  // the common case
    for (std::size_t g = (p - base) / granule_; g <= last;) {
      if (h[g] != 0) {
        ++g;
        continue;
      }
      std::size_t end = g;
      while (end <= last && h[end] == 0) ++end;
      std::size_t run = end;  // the first of the current run of granules newly mapped
      auto open_run = [&](std::size_t to) {
        const bool ok = run >= to || open(base + run * granule_, (to - run) * granule_);
        run = end;
        return ok;
      };
      for (std::size_t k = g; k < end; ++k) {
        const std::uintptr_t at = base + k * granule_;
        handle got = 0;
        auto st = stale_.find(at);
        if (st != stale_.end()) {
          auto sp = std::find(spare_.begin(), spare_.end(), st->second.h);
          if (sp != spare_.end()) {
            got = st->second.h;  // still mapped here, access and all
            spare_.erase(sp);
            ++counts_.reactivated;
          } else {
            // Its handle backs another granule now: the mapping goes, once the work
            // queued before the granule was retired is done. The other stale
            // mappings stay, for the steps that take them back.
            if (st->second.seq > synced_seq_) synchronize(sync);
            drop(at);
          }
          stale_.erase(st);
        }
        if (got != 0) {  // reactivated: access set already
          if (!open_run(k)) {
            unback(it, g, k);
            return false;
          }
        } else {
          if (!spare_.empty() && remap(at, spare_.back())) {
            got = spare_.back();
            spare_.pop_back();
            ++counts_.moved;
          } else if ((got = map(at)) != 0) {
            ++counts_.created;
          } else {
            unback(it, g, k);
            return false;
          }
          if (run == end) run = k;
        }
        h[k] = got;
        it->second.bits[k / 64] |= std::uint64_t{1} << (k % 64);
      }
      if (!open_run(end)) {
        unback(it, g, end);
        return false;
      }
      *added += (end - g) * granule_;
      g = end;
    }
    return true;
  }

  // Bytes that back(p, bytes) would map: the granules of the range with nothing under them.
  std::size_t missing(std::uintptr_t p, std::size_t bytes) const {
    if (bytes == 0) return 0;
    auto it = regions_.upper_bound(p);
    if (it == regions_.begin()) return 0;
    --it;
    const std::uintptr_t base = it->first;
    if (p >= base + it->second.h.size() * granule_) return 0;
    const std::size_t first = (p - base) / granule_;
    const std::size_t end = std::min((p + bytes - 1 - base) / granule_ + 1, it->second.h.size());
    return (end - first - it->second.count(first, end)) * granule_;
  }

  // Bytes discard(p, bytes) would unmap: backed granules wholly inside the range.
  std::size_t inside(std::uintptr_t p, std::size_t bytes) const {
    auto it = regions_.upper_bound(p);
    if (bytes == 0 || it == regions_.begin()) return 0;
    --it;
    const std::uintptr_t base = it->first;
    if (p >= base + it->second.h.size() * granule_) return 0;
    const std::size_t first = (p - base + granule_ - 1) / granule_;
    std::size_t end = (p + bytes - base) / granule_;
    if (end > it->second.h.size()) end = it->second.h.size();
    return first < end ? it->second.count(first, end) * granule_ : 0;
  }

  // Where the top part of [p, p + bytes) holding `want` bytes of backed granules wholly
  // inside the range begins (a granule boundary; the first whole granule if the range
  // holds fewer).
  std::uintptr_t from_top(std::uintptr_t p, std::size_t bytes, std::size_t want) const {
    auto it = regions_.upper_bound(p);
    if (bytes == 0 || it == regions_.begin()) return p;
    --it;
    const std::uintptr_t base = it->first;
    const record& r = it->second;
    if (p >= base + r.h.size() * granule_) return p;
    const std::size_t first = (p - base + granule_ - 1) / granule_;
    const std::size_t end = std::min((p + bytes - base) / granule_, r.h.size());
    std::size_t need = want / granule_ + (want % granule_ != 0);
    if (need == 0 || first >= end) return base + first * granule_;
    for (std::size_t w = (end - 1) / 64 + 1; w-- > first / 64;) {
      std::uint64_t m = r.word(w, first, end);
      const std::size_t c = static_cast<std::size_t>(__builtin_popcountll(m));
      if (c < need) {
        need -= c;
        continue;
      }
      while (--need > 0) m &= ~(std::uint64_t{1} << (63 - __builtin_clzll(m)));  // the top ones
      return base + (w * 64 + 63 - __builtin_clzll(m)) * granule_;
    }
    return base + first * granule_;
  }

  // Unmaps the granules wholly inside [p, p + bytes); returns the bytes unmapped.
  // before() runs once, before the first granule is unmapped (a synchronization), and
  // every stale mapping goes then too (drop(addr)).
  template <class Before, class Drop, class Unmap>
  std::size_t discard(std::uintptr_t p, std::size_t bytes, Before before, Drop drop, Unmap unmap) {
    auto it = find(p);
    if (it == regions_.end() || bytes == 0) return 0;
    const std::uintptr_t base = it->first;
    const std::size_t first = (p - base + granule_ - 1) / granule_;
    std::size_t end = (p + bytes - base) / granule_;
    if (end > it->second.h.size()) end = it->second.h.size();
    if (first >= end || it->second.count(first, end) == 0) return 0;
    before();
    drop_stale(drop);
    return release(it, first, end, unmap);
  }

  // Takes the top backed granules wholly inside [p, p + bytes), `want` bytes of them (or
  // all), out of the backed count, with no call: their mappings stay (stale) and their
  // handles become spare, for back() to map elsewhere (see the top of this file).
  // Returns the bytes taken.
  std::size_t retire(std::uintptr_t p, std::size_t bytes, std::size_t want = SIZE_MAX) {
    const std::uintptr_t lo = from_top(p, bytes, want);
    bytes -= lo - p;
    p = lo;
    auto it = find(p);
    if (it == regions_.end() || bytes == 0) return 0;
    const std::size_t first = (p - it->first + granule_ - 1) / granule_;
    std::size_t end = (p + bytes - it->first) / granule_;
    if (end > it->second.h.size()) end = it->second.h.size();
    const std::size_t gone = unback(it, first, end);
    counts_.retired += gone / granule_;
    return gone;
  }

  // Releases the handles retire() took and back() did not map again: drop(addr) for
  // every stale mapping of them (after sync(), unless they predate the last one), then
  // free(h). Returns the bytes released.
  template <class Sync, class Drop, class Free>
  std::size_t settle(Sync sync, Drop drop, Free free) {
    if (spare_.empty()) return 0;
    std::vector<std::uintptr_t> gone;
    bool recent = false;
    for (const auto& e : stale_) {
      if (std::find(spare_.begin(), spare_.end(), e.second.h) == spare_.end()) continue;
      gone.push_back(e.first);
      recent = recent || e.second.seq > synced_seq_;
    }
    if (recent) synchronize(sync);
    for (std::uintptr_t at : gone) {
      drop(at);
      stale_.erase(at);
    }
    for (handle h : spare_) free(h);
    const std::size_t n = spare_.size() * granule_;
    spare_.clear();
    return n;
  }

 private:
  struct record {
    std::vector<handle> h;            // per granule
    std::vector<std::uint64_t> bits;  // per granule: backed (h != 0), for range checks
    bool all_backed(std::size_t first, std::size_t last) const {
      for (std::size_t w = first / 64; w <= last / 64; ++w) {
        std::uint64_t mask = ~std::uint64_t{0};
        if (w == first / 64) mask &= ~std::uint64_t{0} << (first % 64);
        if (w == last / 64 && last % 64 != 63) mask &= (std::uint64_t{1} << (last % 64 + 1)) - 1;
        if ((bits[w] & mask) != mask) return false;
      }
      return true;
    }
    // The backed bits of word w that lie in [first, end).
    std::uint64_t word(std::size_t w, std::size_t first, std::size_t end) const {
      std::uint64_t m = bits[w];
      if (w == first / 64) m &= ~std::uint64_t{0} << (first % 64);
      if (w == end / 64) m &= (std::uint64_t{1} << (end % 64)) - 1;
      return m;
    }
    // Backed granules in [first, end), a word at a time: a free block of a large
    // address space (the top of a region) is mostly unbacked.
    std::size_t count(std::size_t first, std::size_t end) const {
      std::size_t n = 0;
      for (std::size_t w = first / 64; w * 64 < end; ++w) n += __builtin_popcountll(word(w, first, end));
      return n;
    }
    // f(k) for every backed granule k of [first, end), in order (f may unback k).
    template <class F>
    void each_backed(std::size_t first, std::size_t end, F f) const {
      for (std::size_t w = first / 64; w * 64 < end; ++w) {
        for (std::uint64_t m = word(w, first, end); m != 0; m &= m - 1) f(w * 64 + __builtin_ctzll(m));
      }
    }
  };
  using region_map = std::map<std::uintptr_t, record>;

  region_map::iterator find(std::uintptr_t p) {
    // Most calls land in the region of the call before (the pool has one by default).
    if (last_ != regions_.end() && p >= last_->first && p < last_->first + last_->second.h.size() * granule_) {
      return last_;
    }
    auto it = regions_.upper_bound(p);
    if (it == regions_.begin()) return regions_.end();
    --it;
    if (p >= it->first + it->second.h.size() * granule_) return regions_.end();
    last_ = it;
    return it;
  }

  // Takes granules [from, to) out of the backed ones with no call: their mappings stay
  // (stale) and their handles become spare (retire(), and back()'s way out on failure:
  // settle() then gives them back).
  std::size_t unback(region_map::iterator it, std::size_t from, std::size_t to) {
    std::size_t gone = 0;
    ++retired_seq_;
    record& r = it->second;
    r.each_backed(from, to, [&](std::size_t k) {
      stale_[it->first + k * granule_] = stale{r.h[k], retired_seq_};
      spare_.push_back(r.h[k]);
      r.h[k] = 0;
      r.bits[k / 64] &= ~(std::uint64_t{1} << (k % 64));
      gone += granule_;
    });
    return gone;
  }

  // Unmaps granules [from, to) and releases their handles (after a synchronization and
  // drop_stale(): no other mapping of them is left).
  template <class Unmap>
  std::size_t release(region_map::iterator it, std::size_t from, std::size_t to, Unmap unmap) {
    std::size_t gone = 0;
    record& r = it->second;
    r.each_backed(from, to, [&](std::size_t k) {
      unmap(it->first + k * granule_, r.h[k]);
      r.h[k] = 0;
      r.bits[k / 64] &= ~(std::uint64_t{1} << (k % 64));
      gone += granule_;
    });
    return gone;
  }

  // Every stale mapping goes (the caller synchronized).
  template <class Drop>
  void drop_stale(Drop drop) {
    for (const auto& e : stale_) drop(e.first);
    stale_.clear();
    synced_seq_ = retired_seq_;
  }

  template <class Sync>
  void synchronize(Sync sync) {
    sync();
    ++counts_.syncs;
    synced_seq_ = retired_seq_;  // everything retired so far is safe to unmap now
  }

  std::size_t granule_;
  region_map regions_;
  // Granules retired with their mappings in place: address -> the handle mapped there
  // (spare, or backing another granule since) and when it was retired; a mapping
  // retired before the last synchronization can go without another.
  struct stale {
    handle h;
    std::uint64_t seq;
  };
  std::unordered_map<std::uintptr_t, stale> stale_;
  std::vector<handle> spare_;  // retired handles not mapped elsewhere yet
  std::uint64_t retired_seq_ = 0;  // retire() calls so far
  std::uint64_t synced_seq_ = 0;   // retired_seq_ at the last synchronization
  counts counts_;
  region_map::iterator last_ = regions_.end();  // the region find() returned last
};

}  // namespace tfmg

#endif  // TFMG_BACKING_H_
