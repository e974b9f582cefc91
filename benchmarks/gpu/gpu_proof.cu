// The pool on CUDA memory, proven on a real GPU (benchmarks/gpu/run_h200.sh builds and
// runs this on the lent H200; no TensorFlow there).
//
//   gpu_proof TRACE_DIR OUT.json
//
// 1. Correctness against device memory: random allocate/free under a budget; every block
//    is filled by a kernel with a pattern of its own when handed out and checked by a
//    kernel when freed, so overlapping or unmapped blocks show up as mismatches or
//    faults; the budget is checked after every operation; tfmg_pool_check at the end.
// 2. The same from 8 threads at once (each with its own stream), then the checker.
// 3. Latency: the traces of benchmarks/alloc_latency.py (dumped by dump_traces.py) through
//    the pool, cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync (a pool with the
//    release threshold at its maximum), all in this process; host-side ns per op.
// 4. The smallest budget at which the pool completes each churn trace, by bisection.
// 5. Managed memory: a pool over cuMemAllocManaged; a kernel writes its blocks, the host
//    reads them back.
// With -DTFMG_WITH_CNMEM (and cnmem.cpp built in: run_h200.sh does it when a snapshot of
// NVIDIA/cnmem is carried in .cnmem/, never committed), CNMeM replays the same traces in
// the same process: a fixed pool of the budget (CNMEM_FLAGS_CANNOT_GROW), the NULL
// stream, timed as the pool is (one untimed pass, median of three), and its smallest
// budget by the same bisection.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cc/tfmg/c_api.h"
#ifdef TFMG_WITH_CNMEM
#include "cnmem.h"
#endif

#define CUDA_OK(x)                                                                      \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

namespace {

__global__ void fill(uint32_t* p, size_t n, uint32_t pattern) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = pattern ^ static_cast<uint32_t>(i);
  }
}

__global__ void check(const uint32_t* p, size_t n, uint32_t pattern, unsigned long long* bad) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    if (p[i] != (pattern ^ static_cast<uint32_t>(i))) atomicAdd(bad, 1ull);
  }
}

unsigned blocks_for(size_t words) { return static_cast<unsigned>(std::min<size_t>(1024, (words + 255) / 256)); }

tfmg_pool* make_pool(uint64_t budget, tfmg_upstream_kind kind) {
  tfmg_pool_options o;
  tfmg_pool_options_init(&o);
  o.max_bytes = budget;
  o.upstream = kind;
  o.device = 0;
  // TFMG_ZONE_THRESHOLD=65536: small requests in a zone of their own (off by default), for
  // a comparison in one call (NOTES, "Small blocks in a zone of their own").
  if (const char* z = std::getenv("TFMG_ZONE_THRESHOLD")) o.zone_threshold = std::strtoull(z, nullptr, 10);
  tfmg_pool* p = nullptr;
  if (tfmg_pool_create(&o, &p) != TFMG_OK) {
    std::fprintf(stderr, "pool: %s\n", tfmg_last_error());
    std::exit(2);
  }
  return p;
}

struct result_json {
  std::ostringstream s;
};

// ---- 1 and 2: correctness ----------------------------------------------------------

struct correctness {
  uint64_t ops = 0, allocs = 0, refusals = 0, mismatches = 0, budget_violations = 0;
  bool valid = false;
};

// sync_before_free: wait for the block's check before freeing it, as a program sharing a
// pool across streams must. Without it (one stream) the block goes back with its check
// still queued, as PyTorch frees tensors: stream order alone must keep the reuse right,
// and reclaims move the physical memory of such blocks with no synchronization.
correctness random_ops_with_kernels(tfmg_pool* pool, uint64_t budget, int ops, uint32_t seed,
                                    cudaStream_t stream, unsigned long long* bad_dev, bool sync_before_free = true) {
  correctness c;
  std::mt19937 rng(seed);
  struct live_block { uint32_t* p; size_t bytes; uint32_t pattern; };
  std::vector<live_block> live;
  for (int i = 0; i < ops; ++i) {
    ++c.ops;
    if (live.empty() || (rng() % 100) < 55) {
      // Log-uniform 256 B .. 8 MiB.
      const double lg = std::log(256.0) + (std::log(8.0 * 1024 * 1024) - std::log(256.0)) * (rng() / 4294967296.0);
      size_t bytes = static_cast<size_t>(std::exp(lg)) & ~size_t(3);
      if (bytes < 4) bytes = 4;
      void* p = nullptr;
      if (tfmg_pool_allocate(pool, bytes, 0, 0, &p) != TFMG_OK) {
        ++c.refusals;
        continue;
      }
      ++c.allocs;
      const uint32_t pattern = rng();
      fill<<<blocks_for(bytes / 4), 256, 0, stream>>>(static_cast<uint32_t*>(p), bytes / 4, pattern);
      live.push_back({static_cast<uint32_t*>(p), bytes, pattern});
    } else {
      const size_t k = rng() % live.size();
      const live_block b = live[k];
      check<<<blocks_for(b.bytes / 4), 256, 0, stream>>>(b.p, b.bytes / 4, b.pattern, bad_dev);
      // The block may be handed out again at once, to another stream's work.
      if (sync_before_free) CUDA_OK(cudaStreamSynchronize(stream));
      tfmg_pool_deallocate(pool, b.p, nullptr);
      live[k] = live.back();
      live.pop_back();
    }
    tfmg_stats s;
    tfmg_pool_get_stats(pool, &s);
    if (static_cast<uint64_t>(s.bytes_reserved) > budget) ++c.budget_violations;
  }
  for (const auto& b : live) {
    check<<<blocks_for(b.bytes / 4), 256, 0, stream>>>(b.p, b.bytes / 4, b.pattern, bad_dev);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  for (const auto& b : live) tfmg_pool_deallocate(pool, b.p, nullptr);
  return c;
}

// ---- 3 and 4: traces ---------------------------------------------------------------

struct trace {
  std::string name;
  std::vector<tfmg_replay_op> ops;
  uint64_t slots = 0, peak_live = 0;
};

bool load_trace(const std::string& dir, const std::string& name, trace* t) {
  std::ifstream meta(dir + "/" + name + ".meta");
  std::ifstream bin(dir + "/" + name + ".bin", std::ios::binary);
  if (!meta || !bin) return false;
  uint64_t n = 0;
  meta >> n >> t->slots >> t->peak_live;
  t->ops.resize(n);
  bin.read(reinterpret_cast<char*>(t->ops.data()), n * sizeof(tfmg_replay_op));
  t->name = name;
  return static_cast<bool>(bin);
}

// The traces of alloc_latency.py (dump_traces.py), in its table's order.
const char* const kTraceNames[] = {"pairs_512", "pairs_64k", "pairs_4m", "churn_100", "churn_2000", "churn_10000"};

bool load_named(const std::string& dir, const char* name, trace* t) {
  if (load_trace(dir, name, t)) return true;
  std::fprintf(stderr, "missing trace %s\n", name);
  return false;
}

// The budget a trace is timed under: ample (4x its peak live bytes, and 64 MiB), so that
// the timing is of the index, not of reclaiming at the budget.
uint64_t timing_budget(const trace& t) { return 4 * t.peak_live + (64u << 20); }

template <class Alloc, class Free>
double replay_ns(const trace& t, Alloc&& alloc, Free&& free_fn, bool* ok) {
  std::vector<void*> table(t.slots, nullptr);
  *ok = true;
  const auto start = std::chrono::steady_clock::now();
  for (const auto& op : t.ops) {
    if (op.is_free) {
      free_fn(table[op.slot]);
      table[op.slot] = nullptr;
    } else {
      void* p = alloc(op.size);
      if (p == nullptr) {
        *ok = false;
        break;
      }
      table[op.slot] = p;
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  for (void* p : table) {
    if (p != nullptr) free_fn(p);
  }
  return std::chrono::duration<double, std::nano>(stop - start).count() / t.ops.size();
}

double median3(double a, double b, double c) { return std::max(std::min(a, b), std::min(std::max(a, b), c)); }

// Steady state: one pool replays the trace once untimed (its first pass maps the device
// memory the trace needs, a one-time cost; *cold_ns gets it), then three timed passes.
double pool_ns(const trace& t, uint64_t budget, double* cold_ns) {
  double r[3];
  tfmg_pool* pool = make_pool(budget, TFMG_UPSTREAM_CUDA);
  tfmg_replay_result res;
  tfmg_replay_pool(pool, t.ops.data(), t.ops.size(), t.slots, &res);
  *cold_ns = res.failed_at == UINT64_MAX ? double(res.elapsed_ns) / t.ops.size() : -1.0;
  for (double& v : r) {
    tfmg_replay_pool(pool, t.ops.data(), t.ops.size(), t.slots, &res);
    v = res.failed_at == UINT64_MAX ? double(res.elapsed_ns) / t.ops.size() : -1.0;
  }
  tfmg_pool_destroy(pool, 1);
  return median3(r[0], r[1], r[2]);
}

bool pool_completes(const trace& t, uint64_t budget) {
  tfmg_pool* pool = make_pool(budget, TFMG_UPSTREAM_CUDA);
  tfmg_replay_result res;
  tfmg_replay_pool(pool, t.ops.data(), t.ops.size(), t.slots, &res);
  tfmg_pool_destroy(pool, 1);
  return res.failed_at == UINT64_MAX;
}

// The smallest budget (to 0.2% of the peak) at which `completes(t, budget)`, over the
// trace's peak live bytes.
template <class Completes>
double min_budget_over_peak(const trace& t, Completes&& completes) {
  uint64_t lo = t.peak_live, hi = t.peak_live + t.peak_live / 4 + (4u << 20);
  while (!completes(t, hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > t.peak_live / 500) {
    const uint64_t mid = lo + (hi - lo) / 2;
    (completes(t, mid) ? hi : lo) = mid;
  }
  return double(hi) / double(t.peak_live);
}

#ifdef TFMG_WITH_CNMEM
bool cnmem_start(uint64_t size) {
  cnmemDevice_t d;
  std::memset(&d, 0, sizeof d);
  d.device = 0;
  d.size = size;
  return cnmemInit(1, &d, CNMEM_FLAGS_CANNOT_GROW) == CNMEM_STATUS_SUCCESS;
}

void* cnmem_alloc(uint64_t n) {
  void* p = nullptr;
  return cnmemMalloc(&p, n, nullptr) == CNMEM_STATUS_SUCCESS ? p : nullptr;
}

void cnmem_free(void* p) { cnmemFree(p, nullptr); }

// -1 when the trace does not complete in a pool of `budget`.
double cnmem_ns(const trace& t, uint64_t budget) {
  if (!cnmem_start(budget)) return -1.0;
  bool ok = true;
  replay_ns(t, cnmem_alloc, cnmem_free, &ok);
  double r[3];
  for (double& v : r) v = replay_ns(t, cnmem_alloc, cnmem_free, &ok);
  cnmemFinalize();
  return ok ? median3(r[0], r[1], r[2]) : -1.0;
}

bool cnmem_completes(const trace& t, uint64_t budget) {
  if (!cnmem_start(budget)) return false;
  bool ok = true;
  replay_ns(t, cnmem_alloc, cnmem_free, &ok);
  cnmemFinalize();
  return ok;
}

#endif

}  // namespace

// `gpu_proof TRACE_DIR OUT.json seeds`: only the smallest budgets of the churn traces
// listed in TRACE_DIR/seeds.txt (dump_traces.py --seeds: the same kinds made with other
// seeds), the pool's and CNMeM's, and their mean and worst per kind. A trace is one draw
// of the random churn: the pool's smallest budget on churn_100 moved from 1.082 to 1.151
// over six seeds on the H200 (results/gpu_h200.json, other_seeds): one trace does not
// rank two allocators that differ by a few percent.
int seeds_main(const std::string& dir, const char* out) {
  std::ifstream list(dir + "/seeds.txt");
  if (!list) {
    std::fprintf(stderr, "no %s/seeds.txt: write the traces with dump_traces.py --seeds 1,2,...\n", dir.c_str());
    return 2;
  }
#ifndef TFMG_WITH_CNMEM
  std::printf("(built without CNMeM: its column is 0)\n");
#endif
  std::string name;
  std::map<std::string, std::vector<std::pair<double, double>>> by_kind;
  std::printf("%-20s %12s %12s\n", "trace", "pool", "CNMeM");
  while (list >> name) {
    trace t;
    if (!load_trace(dir, name, &t)) {
      std::fprintf(stderr, "missing trace %s\n", name.c_str());
      return 2;
    }
    const double mb = min_budget_over_peak(t, pool_completes);
#ifdef TFMG_WITH_CNMEM
    const double cmb = min_budget_over_peak(t, cnmem_completes);
#else
    const double cmb = 0.0;
#endif
    std::printf("%-20s %12.4f %12.4f\n", name.c_str(), mb, cmb);
    std::fflush(stdout);
    by_kind[name.substr(0, name.rfind("_s"))].emplace_back(mb, cmb);
  }
  std::ostringstream js;
  js << "{\n  \"seeds\": {";
  bool first = true;
  std::printf("\n%-12s %22s %22s\n", "kind", "pool mean / worst", "CNMeM mean / worst");
  for (const auto& [kind, v] : by_kind) {
    double ps = 0, cs = 0, pw = 0, cw = 0;
    js << (first ? "\n" : ",\n") << "    \"" << kind << "\": {\"pool\": [";
    for (size_t i = 0; i < v.size(); ++i) js << (i ? ", " : "") << v[i].first;
    js << "], \"cnmem\": [";
    for (size_t i = 0; i < v.size(); ++i) js << (i ? ", " : "") << v[i].second;
    for (const auto& [p, c] : v) {
      ps += p, cs += c, pw = std::max(pw, p), cw = std::max(cw, c);
    }
    const double n = double(v.size());
    js << "], \"pool_mean\": " << ps / n << ", \"cnmem_mean\": " << cs / n << ", \"pool_worst\": " << pw
       << ", \"cnmem_worst\": " << cw << "}";
    std::printf("%-12s %13.4f / %.4f %13.4f / %.4f\n", kind.c_str(), ps / n, pw, cs / n, cw);
    first = false;
  }
  js << "\n  }\n}\n";
  std::ofstream(out) << js.str();
  std::printf("wrote %s\n", out);
  return 0;
}

// `gpu_proof TRACE_DIR OUT.json timing`: only the pool's ns/op on each trace (as in the
// full run: one untimed pass, the median of three timed), a pass of a few seconds, so
// that two builds of the core can be run alternately many times in one call
// (run_h200_ab.sh): on this machine one build's time moved 1.5-2x between passes.
int timing_main(const std::string& dir, const char* out) {
  std::ostringstream js;
  js << "{";
  bool first = true;
  for (const char* name : kTraceNames) {
    trace t;
    if (!load_named(dir, name, &t)) return 2;
    double cold_ns = 0;
    const double p_ns = pool_ns(t, timing_budget(t), &cold_ns);
    std::printf("%-12s %8.1f\n", name, p_ns);
    js << (first ? "" : ", ") << "\"" << name << "\": " << p_ns;
    first = false;
  }
  js << "}\n";
  std::ofstream(out) << js.str();
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[3], "seeds") == 0) {
    CUDA_OK(cudaSetDevice(0));
    return seeds_main(argv[1], argv[2]);
  }
  if (argc == 4 && std::strcmp(argv[3], "timing") == 0) {
    CUDA_OK(cudaSetDevice(0));
    return timing_main(argv[1], argv[2]);
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: gpu_proof TRACE_DIR OUT.json [seeds|timing]\n");
    return 2;
  }
  const std::string dir = argv[1];
  CUDA_OK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::ostringstream js;
  js << "{\n  \"device\": \"" << prop.name << "\",\n";

  // 1. Correctness, one thread.
  unsigned long long* bad_dev = nullptr;
  CUDA_OK(cudaMalloc(&bad_dev, sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(bad_dev, 0, sizeof(unsigned long long)));
  const uint64_t budget = 512ull << 20;
  tfmg_pool* pool = make_pool(budget, TFMG_UPSTREAM_CUDA);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  correctness c1 = random_ops_with_kernels(pool, budget, 20000, 1, stream, bad_dev);
  unsigned long long bad = 0;
  CUDA_OK(cudaMemcpy(&bad, bad_dev, sizeof bad, cudaMemcpyDeviceToHost));
  c1.mismatches = bad;
  c1.valid = tfmg_pool_check(pool) == TFMG_OK;
  tfmg_stats c1s;
  tfmg_pool_get_stats(pool, &c1s);  // reclaims: free granules unmapped at the budget, then remapped
  std::printf("correctness: %llu ops, %llu allocs, %llu refused, %llu mismatching words, %llu budget violations, "
              "valid=%d, %lld reclaims\n",
              (unsigned long long)c1.ops, (unsigned long long)c1.allocs, (unsigned long long)c1.refusals,
              (unsigned long long)c1.mismatches, (unsigned long long)c1.budget_violations, c1.valid,
              (long long)c1s.num_reclaims);
  char backing[512];
  tfmg_pool_describe(pool, backing, sizeof backing);
  std::printf("  %s\n", backing);
  tfmg_pool_destroy(pool, 1);

  // 1b. One stream, blocks freed with their checks still queued (as PyTorch frees), at
  // a budget that keeps reclaims (granules moved, no synchronization) busy.
  CUDA_OK(cudaMemset(bad_dev, 0, sizeof(unsigned long long)));
  pool = make_pool(budget, TFMG_UPSTREAM_CUDA);
  correctness c1b = random_ops_with_kernels(pool, budget, 20000, 3, stream, bad_dev, false);
  CUDA_OK(cudaMemcpy(&bad, bad_dev, sizeof bad, cudaMemcpyDeviceToHost));
  c1b.mismatches = bad;
  c1b.valid = tfmg_pool_check(pool) == TFMG_OK;
  tfmg_stats c1bs;
  tfmg_pool_get_stats(pool, &c1bs);
  tfmg_pool_describe(pool, backing, sizeof backing);
  std::printf("queued frees: %llu ops, %llu allocs, %llu refused, %llu mismatching words, %llu budget violations, "
              "valid=%d, %lld reclaims\n  %s\n",
              (unsigned long long)c1b.ops, (unsigned long long)c1b.allocs, (unsigned long long)c1b.refusals,
              (unsigned long long)c1b.mismatches, (unsigned long long)c1b.budget_violations, c1b.valid,
              (long long)c1bs.num_reclaims, backing);
  tfmg_pool_destroy(pool, 1);

  // 2. Eight threads.
  CUDA_OK(cudaMemset(bad_dev, 0, sizeof(unsigned long long)));
  const uint64_t budget_mt = 2048ull << 20;
  pool = make_pool(budget_mt, TFMG_UPSTREAM_CUDA);
  std::vector<std::thread> threads;
  std::vector<correctness> per(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      cudaSetDevice(0);
      cudaStream_t s;
      cudaStreamCreate(&s);
      per[t] = random_ops_with_kernels(pool, budget_mt, 12500, 100 + t, s, bad_dev);
      cudaStreamDestroy(s);
    });
  }
  for (auto& th : threads) th.join();
  CUDA_OK(cudaMemcpy(&bad, bad_dev, sizeof bad, cudaMemcpyDeviceToHost));
  uint64_t mt_ops = 0, mt_viol = 0;
  for (auto& p : per) {
    mt_ops += p.ops;
    mt_viol += p.budget_violations;
  }
  tfmg_stats st;
  tfmg_pool_get_stats(pool, &st);
  const bool mt_valid = tfmg_pool_check(pool) == TFMG_OK && st.bytes_in_use == 0;
  std::printf("threads: 8 x 12500 ops (%llu), %llu mismatching words, %llu budget violations, valid=%d, "
              "%lld reclaims\n",
              (unsigned long long)mt_ops, bad, (unsigned long long)mt_viol, mt_valid, (long long)st.num_reclaims);
  tfmg_pool_destroy(pool, 1);
  js << "  \"correctness\": {\"ops\": " << c1.ops << ", \"allocs\": " << c1.allocs << ", \"refusals\": "
     << c1.refusals << ", \"mismatching_words\": " << c1.mismatches << ", \"budget_violations\": "
     << c1.budget_violations << ", \"valid\": " << (c1.valid ? "true" : "false")
     << ", \"num_reclaims\": " << c1s.num_reclaims << "},\n";
  js << "  \"queued_frees\": {\"ops\": " << c1b.ops << ", \"allocs\": " << c1b.allocs << ", \"refusals\": "
     << c1b.refusals << ", \"mismatching_words\": " << c1b.mismatches << ", \"budget_violations\": "
     << c1b.budget_violations << ", \"valid\": " << (c1b.valid ? "true" : "false")
     << ", \"num_reclaims\": " << c1bs.num_reclaims << ", \"backing\": \"" << backing << "\"},\n";
  js << "  \"threads\": {\"threads\": 8, \"ops\": " << mt_ops << ", \"mismatching_words\": " << bad
     << ", \"budget_violations\": " << mt_viol << ", \"valid\": " << (mt_valid ? "true" : "false")
     << ", \"num_reclaims\": " << st.num_reclaims << "},\n";

  // 3 and 4. Traces.
  cudaMemPool_t mempool;
  CUDA_OK(cudaDeviceGetDefaultMemPool(&mempool, 0));
  uint64_t threshold = UINT64_MAX;
  CUDA_OK(cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &threshold));
  js << "  \"traces\": {\n";
  std::printf("\n%-12s %12s %12s %14s %14s %12s\n", "trace", "pool ns/op", "(1st pass)", "cudaMalloc",
              "cudaMallocAsync", "min budget");
  bool first = true;
  for (const char* name : kTraceNames) {
    trace t;
    if (!load_named(dir, name, &t)) return 2;
    double cold_ns = 0;
    const double p_ns = pool_ns(t, timing_budget(t), &cold_ns);
    bool ok1 = true, ok2 = true;
    const double m_ns = replay_ns(
        t, [](uint64_t n) { void* p = nullptr; return cudaMalloc(&p, n) == cudaSuccess ? p : nullptr; },
        [](void* p) { cudaFree(p); }, &ok1);
    // cudaMallocAsync's pool keeps what it got (release threshold at maximum): one
    // untimed pass first, as for tf_memguard's pool.
    replay_ns(
        t, [stream](uint64_t n) { void* p = nullptr; return cudaMallocAsync(&p, n, stream) == cudaSuccess ? p : nullptr; },
        [stream](void* p) { cudaFreeAsync(p, stream); }, &ok2);
    const double a_ns = replay_ns(
        t, [stream](uint64_t n) { void* p = nullptr; return cudaMallocAsync(&p, n, stream) == cudaSuccess ? p : nullptr; },
        [stream](void* p) { cudaFreeAsync(p, stream); }, &ok2);
    CUDA_OK(cudaStreamSynchronize(stream));
    const bool churn = std::strncmp(name, "churn", 5) == 0;
    const double mb = churn ? min_budget_over_peak(t, pool_completes) : 0.0;
    std::printf("%-12s %12.1f %12.1f %14.1f %14.1f %12.4f\n", name, p_ns, cold_ns, m_ns, a_ns, mb);
#ifdef TFMG_WITH_CNMEM
    const double c_ns = cnmem_ns(t, timing_budget(t));
    const double cmb = churn ? min_budget_over_peak(t, cnmem_completes) : 0.0;
    std::printf("%-12s %12.1f %12s %14s %14s %12.4f   (CNMeM)\n", "", c_ns, "", "", "", cmb);
#endif
    js << (first ? "" : ",\n") << "    \"" << name << "\": {\"ops\": " << t.ops.size() << ", \"peak_live_bytes\": "
       << t.peak_live << ", \"pool_ns_per_op\": " << p_ns << ", \"pool_first_pass_ns_per_op\": " << cold_ns
       << ", \"cuda_malloc_ns_per_op\": " << m_ns
       << ", \"cuda_async_ns_per_op\": " << a_ns;
    if (churn) js << ", \"min_budget_over_peak_live\": " << mb;
#ifdef TFMG_WITH_CNMEM
    js << ", \"cnmem_ns_per_op\": " << c_ns;
    if (churn) js << ", \"cnmem_min_budget_over_peak_live\": " << cmb;
#endif
    js << "}";
    first = false;
  }
  js << "\n  },\n";

  // 5. Managed memory used by a kernel.
  tfmg_pool* managed = make_pool(256ull << 20, TFMG_UPSTREAM_CUDA_MANAGED);
  uint64_t managed_bad = 0, managed_blocks = 0;
  std::vector<std::pair<uint32_t*, size_t>> blocks;
  for (int i = 0; i < 64; ++i) {
    const size_t bytes = (size_t(1) << (10 + i % 12));
    void* p = nullptr;
    if (tfmg_pool_allocate(managed, bytes, 0, 0, &p) != TFMG_OK) break;
    fill<<<blocks_for(bytes / 4), 256, 0, stream>>>(static_cast<uint32_t*>(p), bytes / 4, 0xabc000u + i);
    blocks.emplace_back(static_cast<uint32_t*>(p), bytes);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  for (size_t b = 0; b < blocks.size(); ++b) {
    const uint32_t* h = blocks[b].first;  // managed: readable on the host
    for (size_t i = 0; i < blocks[b].second / 4; ++i) {
      if (h[i] != ((0xabc000u + b) ^ static_cast<uint32_t>(i))) ++managed_bad;
    }
    ++managed_blocks;
  }
  for (auto& b : blocks) tfmg_pool_deallocate(managed, b.first, nullptr);
  const bool managed_valid = tfmg_pool_check(managed) == TFMG_OK;
  tfmg_pool_destroy(managed, 1);
  std::printf("\nmanaged: %llu blocks written by a kernel, read on the host: %llu mismatching words, valid=%d\n",
              (unsigned long long)managed_blocks, (unsigned long long)managed_bad, managed_valid);
  js << "  \"managed\": {\"blocks\": " << managed_blocks << ", \"mismatching_words\": " << managed_bad
     << ", \"valid\": " << (managed_valid ? "true" : "false") << "}\n}\n";

  std::ofstream(argv[2]) << js.str();
  std::printf("wrote %s\n", argv[2]);
  const bool pass = c1.mismatches == 0 && c1.budget_violations == 0 && c1.valid && bad == 0 && mt_viol == 0 &&
                    mt_valid && managed_bad == 0 && managed_valid;
  std::printf("%s\n", pass ? "GPU PROOF PASSED" : "GPU PROOF FAILED");
  return pass ? 0 : 1;
}
