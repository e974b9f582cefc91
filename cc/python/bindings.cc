// tf_memguard._core: the Python face of the core's C interface.
//
// Glue only: converts types, releases the GIL around pool calls, and turns statuses into
// Python exceptions carrying the core's message. The public API is plain Python on top
// (tf_memguard/__init__.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cc/tfmg/c_api.h"

namespace py = pybind11;

namespace {

PyObject* g_out_of_budget = nullptr;   // MemoryError
PyObject* g_pool_error = nullptr;      // RuntimeError: wrong state
PyObject* g_unknown_pointer = nullptr; // ValueError
PyObject* g_double_free = nullptr;     // ValueError

[[noreturn]] void raise(tfmg_status status, const std::string& message) {
  PyObject* type = PyExc_RuntimeError;
  switch (status) {
    case TFMG_ERROR_INVALID_ARGUMENT: type = PyExc_ValueError; break;
    case TFMG_ERROR_OUT_OF_MEMORY: type = g_out_of_budget; break;
    case TFMG_ERROR_UNKNOWN_POINTER: type = g_unknown_pointer; break;
    case TFMG_ERROR_DOUBLE_FREE: type = g_double_free; break;
    case TFMG_ERROR_UPSTREAM: type = PyExc_MemoryError; break;
    default: type = g_pool_error; break;
  }
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

// Runs a core call without the GIL and raises on failure. The message is read on the
// same thread, right after the call, as tfmg_last_error() is per thread.
template <class F>
void call(F&& f) {
  tfmg_status s;
  std::string message;
  {
    py::gil_scoped_release release;
    s = f();
    if (s != TFMG_OK) message = tfmg_last_error();
  }
  if (s != TFMG_OK) raise(s, message);
}

// Ints and anything with __index__ (numpy's integers); never bools, which are ints to
// Python but never a size anyone meant.
uint64_t to_u64(const py::handle& value, const char* name, bool saturate) {
  PyObject* index = py::isinstance<py::bool_>(value) || PyFloat_Check(value.ptr()) ? nullptr : PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw py::value_error(std::string(name) + "=" + py::repr(value).cast<std::string>() +
                          ": must be an int");
  }
  py::int_ v = py::reinterpret_steal<py::int_>(index);
  if (v < py::int_(0)) {
    throw py::value_error(std::string(name) + "=" + py::repr(value).cast<std::string>() +
                          ": must not be negative");
  }
  if (v > py::int_(std::numeric_limits<uint64_t>::max())) {
    if (saturate) return std::numeric_limits<uint64_t>::max();
    throw py::value_error(std::string(name) + "=" + py::repr(value).cast<std::string>() +
                          ": larger than 2**64 - 1");
  }
  return v.cast<uint64_t>();
}

// The names of TFMG_KIND_*, in order.
const char* const kKinds[TFMG_NUM_KINDS] = {"other", "kernel", "tensor", "raw", "constant",
                                            "data", "input", "xla", "copy"};

unsigned parse_kind(const std::string& kind) {
  for (unsigned k = 0; k < TFMG_NUM_KINDS; ++k) {
    if (kind == kKinds[k]) return k;
  }
  std::string names;
  for (const char* k : kKinds) names += std::string(names.empty() ? "'" : ", '") + k + "'";
  throw py::value_error("kind='" + kind + "': must be one of " + names);
}

py::dict stats_dict(const tfmg_stats& s) {
  py::dict d;
  d["num_allocs"] = s.num_allocs;
  d["bytes_in_use"] = s.bytes_in_use;
  d["peak_bytes_in_use"] = s.peak_bytes_in_use;
  d["largest_alloc_size"] = s.largest_alloc_size;
  d["bytes_limit"] = s.bytes_limit;
  d["bytes_reserved"] = s.bytes_reserved;
  d["peak_bytes_reserved"] = s.peak_bytes_reserved;
  d["largest_free_block_bytes"] = s.largest_free_block_bytes;
  d["num_frees"] = s.num_frees;
  d["num_refusals"] = s.num_refusals;
  d["window_peak_bytes_in_use"] = s.window_peak_bytes_in_use;
  d["bytes_free"] = s.bytes_free;
  d["largest_allocatable_bytes"] = s.largest_allocatable_bytes;
  d["num_regions"] = s.num_regions;
  d["blocks_in_use"] = s.blocks_in_use;
  d["passthrough_bytes_in_use"] = s.passthrough_bytes_in_use;
  d["overshoot_bytes_in_use"] = s.overshoot_bytes_in_use;
  d["peak_overshoot_bytes"] = s.peak_overshoot_bytes;
  d["num_overshoots"] = s.num_overshoots;
  d["batch_bytes_in_use"] = s.batch_bytes_in_use;
  d["window_peak_batch_bytes"] = s.window_peak_batch_bytes;
  d["window_max_batch_bytes"] = s.window_max_batch_bytes;
  d["window_in_use_at_max_batch"] = s.window_in_use_at_max_batch;
  d["window_tight_request_bytes"] = s.window_tight_request_bytes;
  d["window_tight_largest_free_bytes"] = s.window_tight_largest_free_bytes;
  d["window_tight_in_use_bytes"] = s.window_tight_in_use_bytes;
  d["num_reclaims"] = s.num_reclaims;
  d["bytes_reclaimed"] = s.bytes_reclaimed;
  d["num_waits"] = s.num_waits;
  d["num_waits_served"] = s.num_waits_served;
  d["wait_ns"] = s.wait_ns;
  d["longest_wait_ns"] = s.longest_wait_ns;
  py::dict by_kind, bytes_by_kind, in_use_by_kind, over_in_use_by_kind;
  for (int k = 0; k < TFMG_NUM_KINDS; ++k) {
    by_kind[kKinds[k]] = s.overshoots_by_kind[k];
    bytes_by_kind[kKinds[k]] = s.overshoot_bytes_by_kind[k];
    in_use_by_kind[kKinds[k]] = s.bytes_in_use_by_kind[k];
    over_in_use_by_kind[kKinds[k]] = s.overshoot_in_use_by_kind[k];
  }
  d["overshoots_by_kind"] = by_kind;
  d["overshoot_bytes_by_kind"] = bytes_by_kind;
  d["bytes_in_use_by_kind"] = in_use_by_kind;
  d["overshoot_in_use_by_kind"] = over_in_use_by_kind;
  d["fragmentation"] = s.fragmentation;
  return d;
}

py::dict refusal_dict(const tfmg_refusal& r) {
  py::dict d;
  d["sequence"] = r.sequence;
  d["requested_bytes"] = r.requested_bytes;
  d["alignment"] = r.alignment;
  d["bytes_in_use"] = r.bytes_in_use;
  d["bytes_reserved"] = r.bytes_reserved;
  d["largest_free_block_bytes"] = r.largest_free_block_bytes;
  d["largest_allocatable_bytes"] = r.largest_allocatable_bytes;
  d["bytes_limit"] = r.bytes_limit;
  d["batch_bytes_in_use"] = r.batch_bytes_in_use;
  d["overshoot_bytes_in_use"] = r.overshoot_bytes_in_use;
  d["passthrough_bytes_in_use"] = r.passthrough_bytes_in_use;
  d["requested_batch"] = r.requested_batch != 0;
  d["kind"] = r.kind >= 0 && r.kind < TFMG_NUM_KINDS ? kKinds[r.kind] : "other";
  d["waited_ns"] = r.waited_ns;
  py::dict in_use_by_kind, over_in_use_by_kind;
  for (int k = 0; k < TFMG_NUM_KINDS; ++k) {
    in_use_by_kind[kKinds[k]] = r.bytes_in_use_by_kind[k];
    over_in_use_by_kind[kKinds[k]] = r.overshoot_in_use_by_kind[k];
  }
  d["bytes_in_use_by_kind"] = in_use_by_kind;
  d["overshoot_in_use_by_kind"] = over_in_use_by_kind;
  return d;
}

tfmg_upstream_kind parse_upstream(const std::string& upstream) {
  if (upstream == "host") return TFMG_UPSTREAM_HOST;
  if (upstream == "cuda") return TFMG_UPSTREAM_CUDA;
  if (upstream == "cuda_managed") return TFMG_UPSTREAM_CUDA_MANAGED;
  if (upstream == "host_on_demand") return TFMG_UPSTREAM_HOST_ON_DEMAND;
  if (upstream == "host_lazy") return TFMG_UPSTREAM_HOST_LAZY;
  throw py::value_error("upstream='" + upstream +
                        "': must be 'host', 'host_lazy', 'host_on_demand', 'cuda' or 'cuda_managed'");
}

// Owns a tfmg_pool created by this module.
class Pool {
 public:
  Pool(const py::object& max_bytes, const py::object& alignment, const py::object& region_bytes,
       const py::object& small_threshold, const py::object& trace_capacity, const std::string& upstream,
       int device, const py::object& address_factor, const py::object& trim_above_peak,
       const py::object& zone_threshold) {
    tfmg_pool_options o;
    tfmg_pool_options_init(&o);
    o.upstream = parse_upstream(upstream);
    o.device = device;
    o.max_bytes = to_u64(max_bytes, "max_bytes", false);
    o.alignment = to_u64(alignment, "alignment", false);
    o.region_bytes = to_u64(region_bytes, "region_bytes", true);
    o.small_threshold = to_u64(small_threshold, "small_threshold", false);
    o.trace_capacity = to_u64(trace_capacity, "trace_capacity", false);
    o.address_factor = to_u64(address_factor, "address_factor", false);
    o.zone_threshold = to_u64(zone_threshold, "zone_threshold", false);
    if (!trim_above_peak.is_none()) {
      const double t = trim_above_peak.cast<double>();
      if (!(t >= 0.0)) throw py::value_error("trim_above_peak=" + std::to_string(t) + ": must be 0 (off), a "
                                             "fraction such as 0.04, or None for the default");
      o.trim_above_peak = t;
    }
    call([&] { return tfmg_pool_create(&o, &pool_); });
  }
  // A process-wide device pool: shared with the TensorFlow plugin, never destroyed.
  explicit Pool(tfmg_pool* shared) : pool_(shared), owned_(false) {}
  ~Pool() {
    if (pool_ != nullptr && owned_) tfmg_pool_destroy(pool_, 1);
  }

  tfmg_pool* get() const {
    if (pool_ == nullptr) {
      PyErr_SetString(g_pool_error, "the pool is closed: create a new Pool");
      throw py::error_already_set();
    }
    return pool_;
  }

  uintptr_t allocate(const py::object& nbytes, const py::object& alignment, bool must_succeed,
                     bool batch, const std::string& kind, bool wait) {
    const uint64_t n = to_u64(nbytes, "nbytes", true);
    const uint64_t a = to_u64(alignment, "alignment", false);
    if (wait && must_succeed) throw py::value_error("wait=True with must_succeed=True: a request that must succeed never waits");
    const uint32_t flags = (must_succeed ? TFMG_ALLOC_MUST_SUCCEED : 0u) | (batch ? TFMG_ALLOC_BATCH : 0u) |
                           (wait ? TFMG_ALLOC_WAIT : 0u) | TFMG_ALLOC_KIND(parse_kind(kind));
    tfmg_pool* p = get();
    void* out = nullptr;
    call([&] { return tfmg_pool_allocate(p, n, a, flags, &out); });
    return reinterpret_cast<uintptr_t>(out);
  }

  uint64_t free(const py::object& address) {
    void* ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(to_u64(address, "address", false)));
    tfmg_pool* p = get();
    uint64_t size = 0;
    call([&] { return tfmg_pool_deallocate(p, ptr, &size); });
    return size;
  }

  uint64_t block_size(const py::object& address) {
    const void* ptr =
        reinterpret_cast<const void*>(static_cast<uintptr_t>(to_u64(address, "address", false)));
    tfmg_pool* p = get();
    uint64_t size = 0;
    call([&] { return tfmg_pool_block_size(p, ptr, &size); });
    return size;
  }

  void set_wait(double seconds) {
    if (!(seconds >= 0.0) || seconds > 3600.0) {
      throw py::value_error("wait=" + py::repr(py::float_(seconds)).cast<std::string>() +
                            ": must be a number of seconds from 0 (refuse at once) to 3600");
    }
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_set_wait(p, static_cast<int64_t>(seconds * 1e9)); });
  }
  double wait() { return tfmg_pool_wait(get()) / 1e9; }
  void end_failed_wait() {
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_end_failed_wait(p); });
  }

  void set_limit(const py::object& max_bytes, bool drain) {
    const uint64_t n = to_u64(max_bytes, "max_bytes", false);
    tfmg_pool* p = get();
    call([&] { return drain ? tfmg_pool_set_limit_draining(p, n) : tfmg_pool_set_limit(p, n); });
  }

  py::dict stats() {
    tfmg_pool* p = get();
    tfmg_stats s{};
    call([&] { return tfmg_pool_get_stats(p, &s); });
    return stats_dict(s);
  }

  void clear_stats() {
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_clear_stats(p); });
  }

  void reset_peak() {
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_reset_peak(p); });
  }

  py::object last_refusal() {
    tfmg_pool* p = get();
    tfmg_refusal r{};
    tfmg_status s;
    {
      py::gil_scoped_release release;
      s = tfmg_pool_last_refusal(p, &r);
    }
    if (s != TFMG_OK) return py::none();
    return refusal_dict(r);
  }

  uint64_t release_unused() {
    tfmg_pool* p = get();
    uint64_t n = 0;
    call([&] { return tfmg_pool_release_unused(p, &n); });
    return n;
  }

  // The trace's events, oldest first, and how many were dropped.
  std::vector<tfmg_trace_event> trace_events(uint64_t* dropped) {
    tfmg_pool* p = get();
    uint64_t total = 0;
    std::vector<tfmg_trace_event> events;
    call([&] {
      tfmg_status s = tfmg_pool_trace(p, nullptr, 0, &total, nullptr);
      if (s != TFMG_OK) return s;
      events.resize(total);
      return tfmg_pool_trace(p, events.data(), total, &total, dropped);
    });
    events.resize(total);
    return events;
  }

  py::dict trace() {
    uint64_t dropped = 0;
    std::vector<tfmg_trace_event> events = trace_events(&dropped);
    static const char* const ops[] = {"alloc", "free", "refuse", "overshoot"};
    py::list list;
    for (const auto& e : events) {
      py::dict d;
      d["sequence"] = e.sequence;
      d["op"] = e.op < 4 ? ops[e.op] : "?";
      d["region"] = e.region;
      d["size"] = e.size;
      d["offset"] = e.offset;
      d["address"] = e.address;
      d["thread"] = e.thread;
      list.append(d);
    }
    py::dict out;
    out["events"] = list;
    out["dropped"] = dropped;
    return out;
  }

  // The trace as arrays (for the memory model): op, size, address, flags.
  py::dict trace_arrays() {
    uint64_t dropped = 0;
    std::vector<tfmg_trace_event> events = trace_events(&dropped);
    const auto n = static_cast<py::ssize_t>(events.size());
    py::array_t<uint32_t> op(n), flags(n), thread(n);
    py::array_t<uint64_t> size(n), address(n), sequence(n);
    auto t = thread.mutable_unchecked<1>();
    auto o = op.mutable_unchecked<1>();
    auto f = flags.mutable_unchecked<1>();
    auto z = size.mutable_unchecked<1>();
    auto a = address.mutable_unchecked<1>();
    auto q = sequence.mutable_unchecked<1>();
    for (py::ssize_t i = 0; i < n; ++i) {
      o(i) = events[i].op;
      f(i) = events[i].flags;
      z(i) = events[i].size;
      a(i) = events[i].address;
      q(i) = events[i].sequence;
      t(i) = events[i].thread;
    }
    py::dict out;
    out["op"] = op;
    out["size"] = size;
    out["address"] = address;
    out["flags"] = flags;
    out["sequence"] = sequence;
    out["thread"] = thread;
    out["dropped"] = dropped;
    return out;
  }

  void trace_start(const py::object& capacity) {
    const uint64_t c = to_u64(capacity, "capacity", false);
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_trace_start(p, c); });
  }

  py::dict live_blocks() {
    tfmg_pool* p = get();
    std::vector<tfmg_live_block> blocks;
    call([&] {
      uint64_t n = 0;
      tfmg_status s = tfmg_pool_live_blocks(p, nullptr, 0, &n);
      if (s != TFMG_OK) return s;
      blocks.resize(n + 64);  // a few more may come meanwhile
      s = tfmg_pool_live_blocks(p, blocks.data(), blocks.size(), &n);
      blocks.resize(n);
      return s;
    });
    const auto n = static_cast<py::ssize_t>(blocks.size());
    py::array_t<uint64_t> address(n), size(n), offset(n);
    py::array_t<uint32_t> flags(n);
    py::array_t<int32_t> region(n);
    for (py::ssize_t i = 0; i < n; ++i) {
      address.mutable_at(i) = blocks[i].address;
      size.mutable_at(i) = blocks[i].size;
      offset.mutable_at(i) = blocks[i].offset;
      flags.mutable_at(i) = blocks[i].flags;
      region.mutable_at(i) = blocks[i].region;
    }
    py::dict out;
    out["address"] = address;
    out["size"] = size;
    out["flags"] = flags;
    out["region"] = region;
    out["offset"] = offset;
    return out;
  }

  py::dict layout() {
    tfmg_pool* p = get();
    tfmg_pool_layout l{};
    call([&] { return tfmg_pool_get_layout(p, &l); });
    static const char* const upstreams[] = {"host", "cuda", "cuda_managed", "host_on_demand", "host_lazy"};
    py::dict d;
    d["alignment"] = l.alignment;
    d["page_bytes"] = l.page_bytes;
    d["small_threshold"] = l.small_threshold;
    d["address_factor"] = l.address_factor;
    d["zone_threshold"] = l.zone_threshold;
    d["backs_on_demand"] = l.backs_on_demand != 0;
    d["upstream"] = l.upstream >= 0 && l.upstream < 5 ? upstreams[l.upstream] : "?";
    return d;
  }

  void trace_clear() {
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_trace_clear(p); });
  }

  bool check() {
    tfmg_pool* p = get();
    call([&] { return tfmg_pool_check(p); });
    return true;
  }

  std::string describe() {
    tfmg_pool* p = get();
    char buf[512];
    tfmg_pool_describe(p, buf, sizeof buf);
    return buf;
  }

  uint64_t total_memory() { return tfmg_pool_total_memory(get()); }
  bool shared() const { return !owned_; }

  void close(bool force) {
    if (pool_ == nullptr) return;
    if (!owned_) {
      PyErr_SetString(g_pool_error, "a device pool is shared with TensorFlow and cannot be closed");
      throw py::error_already_set();
    }
    call([&] { return tfmg_pool_destroy(pool_, force ? 1 : 0); });
    pool_ = nullptr;
  }

 private:
  tfmg_pool* pool_ = nullptr;
  bool owned_ = true;
};

std::vector<tfmg_replay_op> to_ops(py::array_t<uint64_t, py::array::c_style | py::array::forcecast> sizes,
                                   py::array_t<uint32_t, py::array::c_style | py::array::forcecast> slots,
                                   py::array_t<uint32_t, py::array::c_style | py::array::forcecast> is_free) {
  if (sizes.ndim() != 1 || slots.ndim() != 1 || is_free.ndim() != 1 ||
      sizes.shape(0) != slots.shape(0) || sizes.shape(0) != is_free.shape(0)) {
    throw py::value_error("sizes, slots and is_free must be 1-D arrays of one length");
  }
  std::vector<tfmg_replay_op> ops(static_cast<std::size_t>(sizes.shape(0)));
  auto s = sizes.unchecked<1>();
  auto l = slots.unchecked<1>();
  auto f = is_free.unchecked<1>();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    ops[i].size = s(i);
    ops[i].slot = l(i);
    ops[i].is_free = f(i);
  }
  return ops;
}

py::dict result_dict(const tfmg_replay_result& r) {
  py::dict d;
  d["elapsed_ns"] = r.elapsed_ns;
  d["completed"] = r.completed;
  d["failed_at"] = r.failed_at == UINT64_MAX ? py::object(py::none()) : py::int_(r.failed_at);
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tf_memguard's native core: the budget pool (private; use tf_memguard).";
  if (tfmg_abi_version() != TFMG_ABI_VERSION) {
    throw std::runtime_error("libtfmg_core.so has ABI version " + std::to_string(tfmg_abi_version()) +
                             ", this module was built for " + std::to_string(TFMG_ABI_VERSION) +
                             ": reinstall tf_memguard so both come from one build");
  }
  g_out_of_budget = PyErr_NewExceptionWithDoc(
      "tf_memguard._core.OutOfBudgetError",
      "A request the budget cannot serve. The pool is unchanged and usable.", PyExc_MemoryError,
      nullptr);
  g_pool_error = PyErr_NewExceptionWithDoc("tf_memguard._core.PoolError",
                                           "A pool call made in a state that does not allow it.",
                                           PyExc_RuntimeError, nullptr);
  g_unknown_pointer = PyErr_NewExceptionWithDoc(
      "tf_memguard._core.UnknownPointerError", "A free of an address the pool did not hand out.",
      PyExc_ValueError, nullptr);
  g_double_free = PyErr_NewExceptionWithDoc("tf_memguard._core.DoubleFreeError",
                                            "A free of a block that is already free.",
                                            PyExc_ValueError, nullptr);
  m.attr("OutOfBudgetError") = py::handle(g_out_of_budget);
  m.attr("PoolError") = py::handle(g_pool_error);
  m.attr("UnknownPointerError") = py::handle(g_unknown_pointer);
  m.attr("DoubleFreeError") = py::handle(g_double_free);
  m.attr("ABI_VERSION") = TFMG_ABI_VERSION;

  py::class_<Pool>(m, "Pool")
      .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&,
                    const py::object&, const std::string&, int, const py::object&, const py::object&, const py::object&>(),
           py::arg("max_bytes") = 0, py::arg("alignment") = 0, py::arg("region_bytes") = 0,
           py::arg("small_threshold") = 0, py::arg("trace_capacity") = 0, py::arg("upstream") = "host",
           py::arg("device") = 0, py::arg("address_factor") = 0, py::arg("trim_above_peak") = py::none(),
           py::arg("zone_threshold") = 0)
      .def("allocate", &Pool::allocate, py::arg("nbytes"), py::arg("alignment") = 0,
           py::arg("must_succeed") = false, py::arg("batch") = false, py::arg("kind") = "other",
           py::arg("wait") = false)
      .def("set_wait", &Pool::set_wait, py::arg("seconds"))
      .def_property_readonly("wait", &Pool::wait)
      .def("end_failed_wait", &Pool::end_failed_wait,
           "The step whose wait gave up has unwound: requests that do not fit wait again at once\n"
           "(else they are refused at once until none was refused for the wait time).")
      .def("free", &Pool::free, py::arg("address"))
      .def("block_size", &Pool::block_size, py::arg("address"))
      .def("set_limit", &Pool::set_limit, py::arg("max_bytes"), py::arg("drain") = false)
      .def("stats", &Pool::stats)
      .def("clear_stats", &Pool::clear_stats)
      .def("reset_peak", &Pool::reset_peak)
      .def("last_refusal", &Pool::last_refusal)
      .def("release_unused", &Pool::release_unused)
      .def("trace", &Pool::trace)
      .def("trace_clear", &Pool::trace_clear)
      .def("trace_arrays", &Pool::trace_arrays)
      .def("trace_start", &Pool::trace_start, py::arg("capacity"))
      .def("live_blocks", &Pool::live_blocks)
      .def("layout", &Pool::layout)
      .def("check", &Pool::check)
      .def("describe", &Pool::describe)
      .def("total_memory", &Pool::total_memory)
      .def_property_readonly("shared", &Pool::shared)
      .def("close", &Pool::close, py::arg("force") = false);

  m.def(
      "device_pool",
      [](const std::string& device) {
        tfmg_pool* p = nullptr;
        call([&] { return tfmg_device_pool(device.c_str(), &p); });
        return new Pool(p);
      },
      py::arg("device"), "The process-wide pool of a device, shared with the TensorFlow plugin.");
  m.def(
      "configure_device_pool",
      [](const std::string& device, const std::string& upstream, int index) {
        tfmg_pool_options o;
        tfmg_pool_options_init(&o);
        o.upstream = parse_upstream(upstream);
        o.device = index;
        call([&] { return tfmg_device_pool_configure(device.c_str(), &o); });
        tfmg_pool* p = nullptr;
        call([&] { return tfmg_device_pool_find(device.c_str(), &p); });
        return new Pool(p);
      },
      py::arg("device"), py::arg("upstream"), py::arg("index") = 0,
      "Creates the process-wide pool of a device over the given upstream (no budget yet).");
  m.def(
      "find_device_pool",
      [](const std::string& device) -> py::object {
        tfmg_pool* p = nullptr;
        if (tfmg_device_pool_find(device.c_str(), &p) != TFMG_OK) return py::none();
        return py::cast(new Pool(p), py::return_value_policy::take_ownership);
      },
      py::arg("device"));
  m.attr("PLUGIN_GPU_HOOK") = TFMG_PLUGIN_GPU_HOOK;
  m.def("plugin_state", &tfmg_plugin_state);
  m.def("set_profile_batch", &tfmg_set_profile_batch, py::arg("batch_size"),
        "While non-zero, the TensorFlow plugin tags kernel allocations whose first dimension is "
        "this batch size, so the pool can split a step's peak into fixed and per-sample bytes.");
  m.def("profile_batch", &tfmg_profile_batch);
  m.def("plugin_path", []() { return std::string(tfmg_plugin_path()); });
  m.def("plugin_message", []() { return std::string(tfmg_plugin_message()); });
  m.attr("PLUGIN_LOADED") = TFMG_PLUGIN_LOADED;
  m.attr("PLUGIN_REGISTERED") = TFMG_PLUGIN_REGISTERED;
  m.attr("PLUGIN_SERVING") = TFMG_PLUGIN_SERVING;
  m.attr("PLUGIN_DISABLED") = TFMG_PLUGIN_DISABLED;
  m.attr("PLUGIN_DUPLICATE") = TFMG_PLUGIN_DUPLICATE;
  m.attr("PLUGIN_MISMATCH") = TFMG_PLUGIN_MISMATCH;
  m.attr("PLUGIN_GLUE_FAILED") = TFMG_PLUGIN_GLUE_FAILED;

  m.def(
      "replay_pool",
      [](Pool& pool, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> sizes,
         py::array_t<uint32_t, py::array::c_style | py::array::forcecast> slots,
         py::array_t<uint32_t, py::array::c_style | py::array::forcecast> is_free, uint64_t nslots) {
        auto ops = to_ops(sizes, slots, is_free);
        tfmg_pool* p = pool.get();
        tfmg_replay_result r{};
        call([&] { return tfmg_replay_pool(p, ops.data(), ops.size(), nslots, &r); });
        return result_dict(r);
      },
      py::arg("pool"), py::arg("sizes"), py::arg("slots"), py::arg("is_free"), py::arg("nslots"));
  m.def(
      "replay_system",
      [](py::array_t<uint64_t, py::array::c_style | py::array::forcecast> sizes,
         py::array_t<uint32_t, py::array::c_style | py::array::forcecast> slots,
         py::array_t<uint32_t, py::array::c_style | py::array::forcecast> is_free, uint64_t nslots,
         uint64_t alignment) {
        auto ops = to_ops(sizes, slots, is_free);
        tfmg_replay_result r{};
        call([&] { return tfmg_replay_system(ops.data(), ops.size(), nslots, alignment, &r); });
        return result_dict(r);
      },
      py::arg("sizes"), py::arg("slots"), py::arg("is_free"), py::arg("nslots"),
      py::arg("alignment") = 64);
  m.def(
      "replay_step",
      [](py::array_t<uint64_t, py::array::c_style | py::array::forcecast> sizes,
         py::array_t<uint32_t, py::array::c_style | py::array::forcecast> slots,
         py::array_t<uint32_t, py::array::c_style | py::array::forcecast> flags, uint64_t nslots,
         const py::object& max_bytes, const std::string& upstream, uint64_t alignment, uint64_t granule_bytes,
         uint64_t address_factor, uint64_t small_threshold, uint64_t zone_threshold) {
        if (sizes.ndim() != 1 || slots.ndim() != 1 || flags.ndim() != 1 || sizes.shape(0) != slots.shape(0) ||
            sizes.shape(0) != flags.shape(0)) {
          throw py::value_error("sizes, slots and flags must be 1-D arrays of one length");
        }
        tfmg_pool_options o;
        tfmg_pool_options_init(&o);
        o.max_bytes = to_u64(max_bytes, "max_bytes", false);
        o.upstream = parse_upstream(upstream);
        o.alignment = alignment;
        o.granule_bytes = granule_bytes;
        o.address_factor = address_factor;
        o.small_threshold = small_threshold;
        o.zone_threshold = zone_threshold == 0 ? 1 : zone_threshold;  // the layout's: 0 there is none
        o.trim_above_peak = 0.0;
        std::vector<tfmg_step_op> ops(static_cast<std::size_t>(sizes.shape(0)));
        auto z = sizes.unchecked<1>();
        auto l = slots.unchecked<1>();
        auto f = flags.unchecked<1>();
        for (std::size_t i = 0; i < ops.size(); ++i) ops[i] = tfmg_step_op{z(i), l(i), f(i)};
        tfmg_step_result r{};
        call([&] { return tfmg_replay_step(&o, ops.data(), ops.size(), nslots, &r); });
        py::dict d;
        d["fits"] = r.fits != 0;
        d["failed_at"] = r.failed_at == UINT64_MAX ? py::object(py::none()) : py::int_(r.failed_at);
        d["peak_bytes_reserved"] = r.peak_bytes_reserved;
        d["peak_account"] = r.peak_account;
        d["peak_overshoot"] = r.peak_overshoot;
        d["blocks_at_peak"] = r.blocks_at_peak;
        d["large_blocks_at_peak"] = r.large_blocks_at_peak;
        d["slack_at_peak"] = r.slack_at_peak;
        return d;
      },
      py::arg("sizes"), py::arg("slots"), py::arg("flags"), py::arg("nslots"), py::arg("max_bytes"),
      py::arg("upstream") = "host_lazy", py::arg("alignment") = 0, py::arg("granule_bytes") = 0,
      py::arg("address_factor") = 0, py::arg("small_threshold") = 0, py::arg("zone_threshold") = 0,
      "Replays a step (ops: allocations, and frees flagged STEP_FREE) through a fresh pool with that budget.");
  m.attr("STEP_FREE") = TFMG_STEP_FREE;
  m.attr("ALLOC_MUST_SUCCEED") = TFMG_ALLOC_MUST_SUCCEED;
  m.attr("ALLOC_BATCH") = TFMG_ALLOC_BATCH;
  m.attr("ALLOC_BATCH_ROWS") = TFMG_ALLOC_BATCH_ROWS;
  m.attr("ALLOC_BATCH_SQUARE") = TFMG_ALLOC_BATCH_SQUARE;
  m.attr("ALLOC_KIND_SHIFT") = TFMG_ALLOC_KIND_SHIFT;
  m.attr("KINDS") = py::make_tuple("other", "kernel", "tensor", "raw", "constant", "data", "input", "xla", "copy");
}
