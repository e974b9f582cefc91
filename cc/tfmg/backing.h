// Which granules of an upstream's regions have physical memory under them, for
// upstreams that back regions on demand (upstream::backs_on_demand): CUDA virtual
// memory, and host memory reserved PROT_NONE. The upstream supplies how one granule is
// mapped and unmapped; this keeps the per-region records and walks the ranges.
#ifndef TFMG_BACKING_H_
#define TFMG_BACKING_H_

#include <cstddef>
#include <cstdint>
#include <map>
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

  backing_map(const backing_map& o) : granule_(o.granule_), regions_(o.regions_) {}
  backing_map& operator=(const backing_map& o) {
    granule_ = o.granule_;
    regions_ = o.regions_;
    last_ = regions_.end();
    return *this;
  }

  // Unmaps what is backed in the region at base and forgets it.
  template <class Unmap>
  void remove_region(std::uintptr_t base, Unmap unmap) {
    auto it = regions_.find(base);
    if (it == regions_.end()) return;
    release(it, 0, it->second.h.size(), unmap);
    if (last_ == it) last_ = regions_.end();
    regions_.erase(it);
  }

  bool has_region(std::uintptr_t base) const { return regions_.count(base) != 0; }

  // Backs every granule of [p, p + bytes) that is not. map(addr) returns a handle (0 on
  // failure); open(addr, bytes) runs once per run of newly mapped granules (false on
  // failure, and the run is unmapped again). *added: bytes newly backed, also on failure
  // (runs before the failing one stay backed).
  template <class Map, class Open, class Unmap>
  bool back(std::uintptr_t p, std::size_t bytes, Map map, Open open, Unmap unmap, std::size_t* added) {
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
      for (std::size_t k = g; k < end; ++k) {
        h[k] = map(base + k * granule_);
        if (h[k] == 0) {
          release(it, g, k, unmap);
          return false;
        }
        it->second.bits[k / 64] |= std::uint64_t{1} << (k % 64);
      }
      if (!open(base + g * granule_, (end - g) * granule_)) {
        release(it, g, end, unmap);
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
    std::size_t n = 0;
    const std::size_t last = (p + bytes - 1 - base) / granule_;
    for (std::size_t g = (p - base) / granule_; g <= last && g < it->second.h.size(); ++g) {
      n += it->second.h[g] == 0;
    }
    return n * granule_;
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
    std::size_t n = 0;
    for (std::size_t k = first; k < end; ++k) n += it->second.h[k] != 0;
    return n * granule_;
  }

  // Unmaps the granules wholly inside [p, p + bytes); returns the bytes unmapped.
  // before() runs once, before the first granule is unmapped.
  template <class Before, class Unmap>
  std::size_t discard(std::uintptr_t p, std::size_t bytes, Before before, Unmap unmap) {
    auto it = find(p);
    if (it == regions_.end() || bytes == 0) return 0;
    const std::uintptr_t base = it->first;
    const std::size_t first = (p - base + granule_ - 1) / granule_;
    std::size_t end = (p + bytes - base) / granule_;
    if (end > it->second.h.size()) end = it->second.h.size();
    bool any = false;
    for (std::size_t k = first; k < end && !any; ++k) any = it->second.h[k] != 0;
    if (!any) return 0;
    before();
    return release(it, first, end, unmap);
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

  template <class Unmap>
  std::size_t release(region_map::iterator it, std::size_t from, std::size_t to, Unmap unmap) {
    std::size_t gone = 0;
    for (std::size_t k = from; k < to; ++k) {
      handle& h = it->second.h[k];
      if (h == 0) continue;
      unmap(it->first + k * granule_, h);
      h = 0;
      it->second.bits[k / 64] &= ~(std::uint64_t{1} << (k % 64));
      gone += granule_;
    }
    return gone;
  }

  std::size_t granule_;
  region_map regions_;
  region_map::iterator last_ = regions_.end();  // the region find() returned last
};

}  // namespace tfmg

#endif  // TFMG_BACKING_H_
