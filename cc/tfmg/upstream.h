// The seam between the pool and where its memory comes from.
//
// An upstream hands out large, rarely requested pieces of memory: the pool's regions,
// and the occasional block served outside the budget (pass-through and overshoot).
// The pool serializes all calls to its upstream under its own lock, so an upstream
// need not be thread-safe. Host memory is the only upstream of this file's first
// version; a CUDA upstream implements the same interface.
#ifndef TFMG_UPSTREAM_H_
#define TFMG_UPSTREAM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tfmg {

class upstream {
 public:
  virtual ~upstream() = default;

  // Returns memory of at least `bytes`, aligned to `alignment` (a power of two no
  // larger than page_size() for regions), or nullptr when the upstream has none.
  // `region`: a long-lived piece the pool carves (host: mmap); otherwise a single block
  // served outside the pool, pass-through or overshoot (host: aligned malloc, whose
  // caching keeps pass-through as fast as TensorFlow's own CPU allocator).
  virtual void* allocate(std::size_t bytes, std::size_t alignment, bool region) = 0;
  // Returns memory obtained from allocate() with the same arguments.
  virtual void deallocate(void* p, std::size_t bytes, std::size_t alignment, bool region) = 0;

  // Gives back the physical memory of a page-aligned range inside a region, which
  // stays reserved (host: madvise(MADV_DONTNEED)). Optional. Returns the bytes that
  // stop being backed, for upstreams that back on demand (0 otherwise).
  virtual std::size_t discard(void* p, std::size_t bytes) { (void)p; (void)bytes; return 0; }

  // Backing on demand (CUDA virtual memory): a region is address space only, and
  // physical memory is mapped under a range when the pool hands out a block there.
  // Then the pool reports the bytes backed as bytes_reserved, so that a budget of half
  // a GPU costs the device only what the run has needed.
  virtual bool backs_on_demand() const { return false; }
  // Maps physical memory under every page of [p, p + bytes) that has none (p inside a
  // region); *added receives the bytes newly backed. False when the device has no
  // memory left for it (nothing then changes).
  virtual bool back(void* p, std::size_t bytes, std::size_t* added) {
    (void)p;
    (void)bytes;
    *added = 0;
    return true;
  }

  // As discard(), for a reclaim that back() follows at once, and only the top part of
  // [p, p + bytes) that holds `want` bytes of what discardable() counts (all of it when
  // it holds less): the rest stays backed for the blocks carved there. An upstream may
  // take that memory out of the count without giving it back yet, and map it under the
  // next back() instead (CUDA: moving physical granules needs no device
  // synchronization; see backing.h). Returns the bytes that stop being counted.
  virtual std::size_t retire(void* p, std::size_t bytes, std::size_t want) {
    (void)want;
    return discard(p, bytes);
  }
  // Gives back what retire() took and back() did not use (the pool calls it after every
  // reclaim), so that the bytes counted are the memory held again.
  virtual void settle() {}
  // trim_above_peak where the options leave it to the upstream: worth it only where a
  // reclaim is cheap.
  virtual double default_trim_above_peak() const { return 0.0; }
  // Device synchronizations made so far (CUDA: to unmap granules), for the pool's trim.
  virtual std::uint64_t synchronizations() const { return 0; }
  // A line on how backing went (granules mapped, moved, synchronizations), or "".
  virtual std::string backing_summary() const { return std::string(); }

  // The bytes back(p, bytes) would newly back (0 for upstreams that do not back on
  // demand): the pool checks them against its budget first.
  virtual std::size_t unbacked(const void* p, std::size_t bytes) const {
    (void)p;
    (void)bytes;
    return 0;
  }

  // The bytes discard(p, bytes) would give back (0 where nothing backs on demand).
  virtual std::size_t discardable(const void* p, std::size_t bytes) const {
    (void)p;
    (void)bytes;
    return 0;
  }

  // The alignment every block gets unless the request asks for more.
  virtual std::size_t default_alignment() const = 0;
  // Regions are multiples of this.
  virtual std::size_t page_size() const = 0;
  // The memory the device has (host: physical memory or the cgroup limit if lower).
  virtual std::size_t total_memory() const = 0;
  virtual const char* name() const = 0;
};

// Host memory: mmap for regions, aligned malloc for single blocks.
std::unique_ptr<upstream> make_host_upstream();
// Host memory backed on demand in granules of `granule` bytes (a power of two, at least
// a page; 0: 64 KiB, or TF_MEMGUARD_HOST_GRANULE); `checked`: unbacked granules are
// PROT_NONE (mprotect), so that touching one faults. See host_upstream.cc.
std::unique_ptr<upstream> make_host_on_demand_upstream(bool checked, std::size_t granule = 0);

// CUDA memory of `device` through the driver API, loaded at run time; `managed`:
// cuMemAllocManaged, prefetched to the device. Null with *error when there is no
// driver or no such device.
std::unique_ptr<upstream> make_cuda_upstream(int device, bool managed, std::string* error);

}  // namespace tfmg

#endif  // TFMG_UPSTREAM_H_
