// Host memory upstream: regions come from mmap (page-aligned, returned to the OS on
// munmap); single blocks (pass-through and overshoot) from posix_memalign, as
// TensorFlow's own CPU allocator does.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

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

  void discard(void* p, std::size_t bytes) override { madvise(p, bytes, MADV_DONTNEED); }

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

}  // namespace

std::unique_ptr<upstream> make_host_upstream() { return std::make_unique<host_upstream>(); }

}  // namespace tfmg
