// The C interface over tfmg::pool: argument checks, status codes, per-thread messages.
#include "cc/tfmg/c_api.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "cc/tfmg/pool.h"

struct tfmg_pool {
  explicit tfmg_pool(std::unique_ptr<tfmg::upstream> up, const tfmg::pool_config& config, tfmg_upstream_kind kind)
      : impl(std::move(up), config), upstream(kind) {}
  tfmg::pool impl;
  tfmg_upstream_kind upstream;
};

namespace {

thread_local std::string last_error;

tfmg_status fail(tfmg_status status, std::string message) {
  last_error = std::move(message);
  return status;
}

tfmg_status fail(const tfmg::pool_error& e) { return fail(e.status, e.message); }

#define TFMG_EXPECT_POOL(p)                                                          \
  do {                                                                               \
    if ((p) == nullptr) return fail(TFMG_ERROR_INVALID_ARGUMENT, "pool is null");    \
  } while (0)

bool is_pow2(std::uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

}  // namespace

extern "C" {

int tfmg_abi_version(void) { return TFMG_ABI_VERSION; }

const char* tfmg_status_string(tfmg_status status) {
  switch (status) {
    case TFMG_OK: return "ok";
    case TFMG_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case TFMG_ERROR_OUT_OF_MEMORY: return "out of memory";
    case TFMG_ERROR_UNKNOWN_POINTER: return "unknown pointer";
    case TFMG_ERROR_DOUBLE_FREE: return "double free";
    case TFMG_ERROR_UPSTREAM: return "upstream failure";
    case TFMG_ERROR_INVALID_STATE: return "invalid state";
  }
  return "unknown status";
}

const char* tfmg_last_error(void) { return last_error.c_str(); }

void tfmg_pool_options_init(tfmg_pool_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof *o);
  o->upstream = TFMG_UPSTREAM_HOST;
  o->trim_above_peak = -1.0;  // the upstream's default
}

tfmg_status tfmg_pool_create(const tfmg_pool_options* o, tfmg_pool** out) {
  if (o == nullptr || out == nullptr) return fail(TFMG_ERROR_INVALID_ARGUMENT, "options and out must not be null");
  if (o->upstream != TFMG_UPSTREAM_HOST && o->upstream != TFMG_UPSTREAM_CUDA &&
      o->upstream != TFMG_UPSTREAM_CUDA_MANAGED && o->upstream != TFMG_UPSTREAM_HOST_ON_DEMAND &&
      o->upstream != TFMG_UPSTREAM_HOST_LAZY) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT,
                "upstream=" + std::to_string(o->upstream) +
                    ": must be host (0), cuda (1), cuda_managed (2), host_on_demand (3) or host_lazy (4)");
  }
  if (o->alignment != 0 && (!is_pow2(o->alignment) || o->alignment > (1u << 20))) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "alignment=" + std::to_string(o->alignment) +
                                                 ": must be 0 (default) or a power of two up to 1 MiB");
  }
  tfmg::pool_config c;
  c.max_bytes = o->max_bytes;
  c.alignment = o->alignment;
  if (o->region_bytes != 0) c.region_bytes = o->region_bytes;
  if (o->small_threshold != 0) c.small_threshold = o->small_threshold;
  if (o->address_factor > 64) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "address_factor=" + std::to_string(o->address_factor) +
                                                 ": must be 0 (the default, 2) or 1 to 64");
  }
  c.address_factor = o->address_factor;
  if (!(o->trim_above_peak <= 16.0)) {  // NaN too
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "trim_above_peak=" + std::to_string(o->trim_above_peak) +
                                                 ": must be 0 (off), a fraction such as 0.04 (at most 16), "
                                                 "or negative for the default");
  }
  c.trace_capacity = o->trace_capacity;
  std::unique_ptr<tfmg::upstream> up;
  if (o->upstream == TFMG_UPSTREAM_HOST) {
    up = tfmg::make_host_upstream();
  } else if (o->upstream == TFMG_UPSTREAM_HOST_ON_DEMAND || o->upstream == TFMG_UPSTREAM_HOST_LAZY) {
    if (o->granule_bytes != 0 && ((o->granule_bytes & (o->granule_bytes - 1)) != 0 || o->granule_bytes < 4096 ||
                                  o->granule_bytes > (uint64_t{1} << 30))) {
      return fail(TFMG_ERROR_INVALID_ARGUMENT, "granule_bytes=" + std::to_string(o->granule_bytes) +
                                                   ": must be 0 (the default) or a power of two from 4 KiB to 1 GiB");
    }
    up = tfmg::make_host_on_demand_upstream(o->upstream == TFMG_UPSTREAM_HOST_ON_DEMAND, o->granule_bytes);
  } else {
    std::string why;
    up = tfmg::make_cuda_upstream(o->device, o->upstream == TFMG_UPSTREAM_CUDA_MANAGED, &why);
    if (!up) return fail(TFMG_ERROR_UPSTREAM, "cannot use CUDA memory: " + why);
  }
  if (o->small_threshold == 0 && up->backs_on_demand()) {
    // Backed in granules, small blocks packed at the high end share granules: below four
    // granules counts as small (8 MiB for CUDA's 2 MiB; the smallest budget of the churn
    // traces, mean of four seeds: 1.104 / 1.086 / 1.051 against 1.133 / 1.090 / 1.051).
    c.small_threshold = std::max(c.small_threshold, 4 * up->page_size());
  }
  c.trim_above_peak = o->trim_above_peak < 0 ? up->default_trim_above_peak() : o->trim_above_peak;
  // Zones are asked for, never the default: on random churn (2 MiB granules) small
  // requests below 64 KiB in their own zone cut the smallest budget by 2-4%, but on a real
  // Keras-on-PyTorch training trace they raised the granules backed from 1.040 to 1.114 of
  // the peak in use (the trim line, which steps that repeat make free, gave up after 17
  // synchronizations) and from 1.096 to 1.114 without it (benchmarks/NOTES.md, "Small
  // blocks in a zone of their own").
  if (o->zone_threshold > 1) c.zone_threshold = o->zone_threshold;
  try {
    *out = new tfmg_pool(std::move(up), c, o->upstream);
  } catch (const std::bad_alloc&) {
    return fail(TFMG_ERROR_OUT_OF_MEMORY, "no memory to create the pool");
  }
  return TFMG_OK;
}

tfmg_status tfmg_pool_destroy(tfmg_pool* p, int force) {
  if (p == nullptr) return TFMG_OK;
  const std::size_t in_use = p->impl.in_use_blocks();
  if (in_use != 0 && !force) {
    return fail(TFMG_ERROR_INVALID_STATE,
                std::to_string(in_use) + " block(s) still in use (" + p->impl.describe() +
                    "): free them first, or destroy with force to release their memory too");
  }
  delete p;
  return TFMG_OK;
}

tfmg_status tfmg_pool_allocate(tfmg_pool* p, uint64_t bytes, uint64_t alignment, uint32_t flags,
                               void** out) {
  TFMG_EXPECT_POOL(p);
  if (out == nullptr) return fail(TFMG_ERROR_INVALID_ARGUMENT, "out must not be null");
  *out = nullptr;
  tfmg::pool_error e{};
  try {
    void* ptr = p->impl.allocate(bytes, alignment, flags, &e);
    if (ptr == nullptr) return fail(e);
    *out = ptr;
  } catch (const std::bad_alloc&) {
    return fail(TFMG_ERROR_OUT_OF_MEMORY, "no host memory for the pool's own bookkeeping");
  }
  return TFMG_OK;
}

tfmg_status tfmg_pool_deallocate(tfmg_pool* p, void* ptr, uint64_t* size_out) {
  TFMG_EXPECT_POOL(p);
  tfmg::pool_error e{};
  std::size_t size = 0;
  if (!p->impl.deallocate(ptr, &size, &e)) return fail(e);
  if (size_out != nullptr) *size_out = size;
  return TFMG_OK;
}

tfmg_status tfmg_pool_block_size(tfmg_pool* p, const void* ptr, uint64_t* out) {
  TFMG_EXPECT_POOL(p);
  std::size_t size = 0;
  if (!p->impl.block_size(ptr, &size)) {
    return fail(TFMG_ERROR_UNKNOWN_POINTER, "not a block in use in this pool");
  }
  if (out != nullptr) *out = size;
  return TFMG_OK;
}

tfmg_status tfmg_pool_set_limit(tfmg_pool* p, uint64_t max_bytes) {
  TFMG_EXPECT_POOL(p);
  tfmg::pool_error e{};
  return p->impl.set_limit(max_bytes, false, &e) ? TFMG_OK : fail(e);
}

tfmg_status tfmg_pool_set_limit_draining(tfmg_pool* p, uint64_t max_bytes) {
  TFMG_EXPECT_POOL(p);
  tfmg::pool_error e{};
  return p->impl.set_limit(max_bytes, true, &e) ? TFMG_OK : fail(e);
}

tfmg_status tfmg_pool_set_wait(tfmg_pool* p, int64_t idle_ns) {
  TFMG_EXPECT_POOL(p);
  if (idle_ns < 0) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "idle_ns=" + std::to_string(idle_ns) + ": must be 0 (no waiting) or more");
  }
  p->impl.set_wait_ns(idle_ns);
  return TFMG_OK;
}

int64_t tfmg_pool_wait(tfmg_pool* p) { return p == nullptr ? 0 : p->impl.wait_ns(); }

tfmg_status tfmg_pool_end_failed_wait(tfmg_pool* p) {
  TFMG_EXPECT_POOL(p);
  p->impl.end_failed_wait();
  return TFMG_OK;
}

tfmg_status tfmg_pool_get_stats(tfmg_pool* p, tfmg_stats* out) {
  TFMG_EXPECT_POOL(p);
  if (out == nullptr) return fail(TFMG_ERROR_INVALID_ARGUMENT, "out must not be null");
  *out = p->impl.stats();
  return TFMG_OK;
}

tfmg_status tfmg_pool_clear_stats(tfmg_pool* p) {
  TFMG_EXPECT_POOL(p);
  p->impl.clear_stats();
  return TFMG_OK;
}

tfmg_status tfmg_pool_reset_peak(tfmg_pool* p) {
  TFMG_EXPECT_POOL(p);
  p->impl.reset_peak();
  return TFMG_OK;
}

tfmg_status tfmg_pool_last_refusal(tfmg_pool* p, tfmg_refusal* out) {
  TFMG_EXPECT_POOL(p);
  if (out == nullptr) return fail(TFMG_ERROR_INVALID_ARGUMENT, "out must not be null");
  if (!p->impl.last_refusal(out)) return fail(TFMG_ERROR_INVALID_STATE, "no request has been refused");
  return TFMG_OK;
}

tfmg_status tfmg_pool_release_unused(tfmg_pool* p, uint64_t* released) {
  TFMG_EXPECT_POOL(p);
  const std::size_t n = p->impl.release_unused();
  if (released != nullptr) *released = n;
  return TFMG_OK;
}

tfmg_status tfmg_pool_trace(tfmg_pool* p, tfmg_trace_event* events, uint64_t capacity,
                            uint64_t* count, uint64_t* dropped) {
  TFMG_EXPECT_POOL(p);
  if (count == nullptr || (events == nullptr && capacity != 0)) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "count must not be null, nor events with a capacity");
  }
  std::uint64_t d = 0;
  auto all = p->impl.trace(&d);
  const std::size_t n = std::min<std::size_t>(all.size(), capacity);
  if (n != 0) std::memcpy(events, all.data(), n * sizeof(tfmg_trace_event));
  *count = capacity == 0 ? all.size() : n;
  if (dropped != nullptr) *dropped = d;
  return TFMG_OK;
}

tfmg_status tfmg_pool_trace_clear(tfmg_pool* p) {
  TFMG_EXPECT_POOL(p);
  p->impl.trace_clear();
  return TFMG_OK;
}

tfmg_status tfmg_pool_trace_start(tfmg_pool* p, uint64_t capacity) {
  TFMG_EXPECT_POOL(p);
  if (capacity > (uint64_t{1} << 28)) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "capacity=" + std::to_string(capacity) + ": at most 2**28 events");
  }
  p->impl.trace_start(capacity);
  return TFMG_OK;
}

tfmg_status tfmg_pool_live_blocks(tfmg_pool* p, tfmg_live_block* out, uint64_t capacity, uint64_t* count) {
  TFMG_EXPECT_POOL(p);
  if (count == nullptr || (out == nullptr && capacity != 0)) {
    return fail(TFMG_ERROR_INVALID_ARGUMENT, "count must not be null, nor out with a capacity");
  }
  const auto all = p->impl.live_blocks();
  const std::size_t n = std::min<std::size_t>(all.size(), capacity);
  if (n != 0) std::memcpy(out, all.data(), n * sizeof(tfmg_live_block));
  *count = capacity == 0 ? all.size() : n;
  return TFMG_OK;
}

tfmg_status tfmg_pool_check(tfmg_pool* p) {
  TFMG_EXPECT_POOL(p);
  std::string why;
  if (!p->impl.is_valid(&why)) return fail(TFMG_ERROR_INVALID_STATE, "pool invariant broken: " + why);
  return TFMG_OK;
}

tfmg_status tfmg_pool_get_layout(tfmg_pool* p, tfmg_pool_layout* out) {
  TFMG_EXPECT_POOL(p);
  if (out == nullptr) return fail(TFMG_ERROR_INVALID_ARGUMENT, "out must not be null");
  out->alignment = p->impl.granule();
  out->page_bytes = p->impl.source().page_size();
  out->small_threshold = p->impl.small_threshold();
  out->address_factor = p->impl.address_factor();
  out->zone_threshold = p->impl.zone_threshold();
  out->backs_on_demand = p->impl.source().backs_on_demand() ? 1 : 0;
  out->upstream = p->upstream;
  return TFMG_OK;
}

uint64_t tfmg_pool_total_memory(tfmg_pool* p) {
  return p == nullptr ? 0 : p->impl.source().total_memory();
}

void tfmg_pool_describe(tfmg_pool* p, char* buf, uint64_t buf_size) {
  if (buf == nullptr || buf_size == 0) return;
  const std::string s = p == nullptr ? std::string("(null pool)") : p->impl.describe();
  const std::size_t n = std::min<std::size_t>(s.size(), buf_size - 1);
  std::memcpy(buf, s.data(), n);
  buf[n] = '\0';
}

}  // extern "C"
