// Host memory upstream: regions come from mmap (page-aligned, returned to the OS on
// munmap); single blocks (pass-through and overshoot) from posix_memalign, as
// TensorFlow's own CPU allocator does.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "cc/tfmg/backing.h"
#include "cc/tfmg/upstream.h"

namespace tfmg {
namespace {

std::size_t read_cgroup_limit() {
  // cgroup v2, then v1. "max" or a huge number means no limit.
  const char* paths[] = {"/sys/fs/cgroup/memory.max",
                         "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
  for (const char* path : paths) {
    std::ifstream in(path);
    std::string text;
    if (in >> text && !text.empty() && text != "max") {
      char* end = nullptr;
      unsigned long long v = std::strtoull(text.c_str(), &end, 10);
      if (end != text.c_str() && v > 0 && v < (1ull << 60)) return static_cast<std::size_t>(v);
    }
  }
  return 0;
}

class host_upstream final : public upstream {
 public:
  host_upstream() : page_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))) {}

  void* allocate(std::size_t bytes, std::size_t alignment, bool region) override {
    if (bytes == 0) bytes = 1;
    if (region && alignment <= page_) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    }
    void* p = nullptr;
    if (alignment < sizeof(void*)) alignment = sizeof(void*);
    return posix_memalign(&p, alignment, bytes) == 0 ? p : nullptr;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t alignment, bool region) override {
    if (p == nullptr) return;
    if (bytes == 0) bytes = 1;
    if (region && alignment <= page_) {
      munmap(p, bytes);
    } else {
      std::free(p);
    }
  }

  std::size_t discard(void* p, std::size_t bytes) override {
    madvise(p, bytes, MADV_DONTNEED);
    return 0;  // the region stays reserved; only its pages go
  }

  std::size_t default_alignment() const override { return 64; }  // EIGEN_MAX_ALIGN_BYTES
  std::size_t page_size() const override { return page_; }

  std::size_t total_memory() const override {
    std::size_t physical = static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * page_;
    std::size_t cgroup = read_cgroup_limit();
    return (cgroup != 0 && cgroup < physical) ? cgroup : physical;
  }

  const char* name() const override { return "host"; }

 private:
  std::size_t page_;
};

// Host memory backed on demand, in granules (64 KiB by default). The pool counts a
// granule as backed from when it hands out a block there until it gives the granule
// back (madvise(MADV_DONTNEED): its pages leave the process), so bytes_reserved bounds
// the pool's resident memory: the same bookkeeping as CUDA virtual memory.
//   checked ("host_on_demand"): the region is PROT_NONE and granules are made readable
//     and writable (mprotect) when backed, so a block handed out without backing faults
//     at once. For tests: each protection change can split the mapping, and Linux
//     allows a process 65,530 mappings.
//   lazy ("host_lazy", the default for TensorFlow's CPU tensors): the region is
//     readable and writable from the start, backing is bookkeeping only (no system
//     call), giving back is madvise alone.
class host_on_demand_upstream final : public upstream {
 public:
  host_on_demand_upstream(std::size_t granule, bool checked) : checked_(checked), backing_(granule) {
    const char* env = std::getenv("TF_MEMGUARD_HOST_RETIRE");
    emulate_retire_ = env != nullptr && env[0] == '1';
  }

  void* allocate(std::size_t bytes, std::size_t alignment, bool region) override {
    const std::size_t g = backing_.granule();
    if (!region || alignment > g) return plain_.allocate(bytes, alignment, region);
    const std::size_t size = ((bytes == 0 ? 1 : bytes) + g - 1) / g * g;
    void* p = mmap(nullptr, size, checked_ ? PROT_NONE : PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    backing_.add_region(reinterpret_cast<std::uintptr_t>(p), size);
    return p;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t alignment, bool region) override {
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    if (!region || !backing_.has_region(base)) return plain_.deallocate(p, bytes, alignment, region);
    backing_.remove_region(base, [](std::uintptr_t) {}, [](std::uintptr_t, backing_map::handle) {});
    const std::size_t g = backing_.granule();
    munmap(p, ((bytes == 0 ? 1 : bytes) + g - 1) / g * g);
  }

  bool backs_on_demand() const override { return true; }

  bool back(void* p, std::size_t bytes, std::size_t* added) override {
    return backing_.back(
        reinterpret_cast<std::uintptr_t>(p), bytes, [this](std::uintptr_t) { return ++handles_; },
        [](std::uintptr_t, backing_map::handle) { return true; },
        [this](std::uintptr_t at, std::size_t n) {
          return !checked_ || mprotect(reinterpret_cast<void*>(at), n, PROT_READ | PROT_WRITE) == 0;
        },
        [] {}, [this](std::uintptr_t at) { give_back(at); }, added);
  }

  std::size_t discard(void* p, std::size_t bytes) override {
    return backing_.discard(
        reinterpret_cast<std::uintptr_t>(p), bytes, [] {}, [this](std::uintptr_t at) { give_back(at); },
        [this](std::uintptr_t at, backing_map::handle) { give_back(at); });
  }

  // TF_MEMGUARD_HOST_RETIRE=1 runs the CUDA upstream's bookkeeping for reclaims (retired
  // granules keep their pages until a "synchronization"; see backing.h), so that a trace
  // replayed on the host counts the moves and synchronizations a GPU would make. Host
  // memory gains nothing by it (its pages stay until then): an emulation, off by default.
  std::size_t retire(void* p, std::size_t bytes, std::size_t want) override {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    if (emulate_retire_) return backing_.retire(a, bytes, want);
    const std::uintptr_t lo = backing_.from_top(a, bytes, want);
    return discard(reinterpret_cast<void*>(lo), bytes - (lo - a));
  }
  void settle() override {
    backing_.settle([] {}, [this](std::uintptr_t at) { give_back(at); }, [](backing_map::handle) {});
  }
  // Host memory needs none; the emulation counts those a GPU would make.
  std::uint64_t synchronizations() const override { return backing_.stats().syncs; }
  std::string backing_summary() const override { return backing_.summary(); }

  std::size_t unbacked(const void* p, std::size_t bytes) const override {
    return backing_.missing(reinterpret_cast<std::uintptr_t>(p), bytes);
  }
  std::size_t discardable(const void* p, std::size_t bytes) const override {
    return backing_.inside(reinterpret_cast<std::uintptr_t>(p), bytes);
  }

  std::size_t default_alignment() const override { return plain_.default_alignment(); }
  std::size_t page_size() const override { return backing_.granule(); }
  std::size_t total_memory() const override { return plain_.total_memory(); }
  const char* name() const override {
    return checked_ ? "host (backed on demand, checked)" : "host (backed on demand)";
  }

 private:
  void give_back(std::uintptr_t at) {
    const std::size_t g = backing_.granule();
    madvise(reinterpret_cast<void*>(at), g, MADV_DONTNEED);
    if (checked_) mprotect(reinterpret_cast<void*>(at), g, PROT_NONE);
  }

  const bool checked_;
  bool emulate_retire_ = false;
  host_upstream plain_;
  backing_map backing_;
  backing_map::handle handles_ = 0;  // each granule mapped gets a handle of its own
};

}  // namespace

std::unique_ptr<upstream> make_host_upstream() { return std::make_unique<host_upstream>(); }
std::unique_ptr<upstream> make_host_on_demand_upstream(bool checked, std::size_t granule) {
  if (granule == 0) {
    const char* env = std::getenv("TF_MEMGUARD_HOST_GRANULE");
    granule = env != nullptr ? std::strtoull(env, nullptr, 10) : 0;
  }
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (granule < page || (granule & (granule - 1)) != 0) granule = 64u << 10;
  return std::make_unique<host_on_demand_upstream>(granule, checked);
}

}  // namespace tfmg
