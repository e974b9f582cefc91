"""Allocation latency and fragmentation of the pool against the system allocator and
TensorFlow's own BFC allocator.

For each trace (benchmarks/traces.py), in one run:
  * ns per operation for the pool, for posix_memalign/free and for TensorFlow's
    BFCAllocator (median of --repeat replays, each in native code: no Python per
    operation), and their ratios;
  * the smallest budget at which the pool completes the trace, found by bisection,
    divided by the trace's peak live bytes; the same for BFC (its total memory).
BFC is TensorFlow's class from the installed wheel, driven by benchmarks/native/bfc_replay.cc
(compiled here against tf.sysconfig into benchmarks/build/), set up as TensorFlow sets it
up for the CPU under TF_CPU_ALLOCATOR_USE_BFC=true; without TensorFlow its columns are
left out.
"The pool" is as TensorFlow's CPU tensors get it by default: backed on demand
(upstream="host_lazy", 64 KiB granules), its budget bounding the bytes backed, its
address space twice the budget, free granules given back at the budget (pool.h:
"Backing on demand"). Both figures again for the plain pool (the budget as one region:
Pool()'s default upstream), and the smallest budgets of other layouts tried.

Prints a table and writes benchmarks/results/alloc_latency.json.

    python benchmarks/alloc_latency.py [--repeat 5] [--quick]
"""
import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import traces as tr  # noqa: E402
from tf_memguard import _core  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# Pool layouts compared for fragmentation (what was tried). The first five: the plain
# pool, the budget as one region of address space.
VARIANTS = {
    "plain": dict(),  # the whole budget as one region, small/large split at 1 MiB
    "lazy_regions": dict(region_bytes=2 << 20),
    "no_split_by_size": dict(small_threshold=1),  # every request placed as "large"
    "small_below_64k": dict(small_threshold=64 * 1024),
    "small_below_8m": dict(small_threshold=8 * 1024 * 1024),
    # Backed on demand (host_lazy, TensorFlow's CPU pool: 64 KiB granules): the budget
    # bounds the bytes backed, the address space is twice the budget, free granules are
    # given back.
    "on_demand_64k": dict(upstream="host_lazy"),
    # The same with 2 MiB granules, as CUDA virtual memory backs a GPU pool (and its
    # default small/large split at four granules).
    "on_demand_2m": dict(upstream="host_lazy", env={"TF_MEMGUARD_HOST_GRANULE": str(2 << 20)}),
    # ... and at the CUDA pool's 256 B alignment: the H200's smallest budgets exactly
    # (gpu_proof: 1.0838 / 1.0947 / 1.0871 on the fixed churns; NOTES).
    "on_demand_2m_a256": dict(upstream="host_lazy", alignment=256,
                              env={"TF_MEMGUARD_HOST_GRANULE": str(2 << 20)}),
    # ... and there with requests below 64 KiB in a zone of their own (asked for; NOTES,
    # "Small blocks in a zone of their own").
    "on_demand_2m_a256_zones": dict(upstream="host_lazy", alignment=256, zone_threshold=64 << 10,
                                    env={"TF_MEMGUARD_HOST_GRANULE": str(2 << 20)}),
}


def replay_pool(trace, budget, env=None, **options):
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # read when the pool's upstream is made
    try:
        pool = _core.Pool(max_bytes=budget, **options)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        return _core.replay_pool(pool, trace.sizes, trace.slots, trace.is_free, trace.nslots)
    finally:
        pool.close(force=True)


def replay_system(trace):
    return _core.replay_system(trace.sizes, trace.slots, trace.is_free, trace.nslots, 64)


def load_bfc():
    """TensorFlow's BFCAllocator replayer (benchmarks/native/bfc_replay.cc), built against
    the installed TensorFlow; None without TensorFlow."""
    try:
        import tensorflow as tf  # its libtensorflow_framework, which holds BFCAllocator
    except ImportError:
        return None
    src = os.path.join(HERE, "native", "bfc_replay.cc")
    lib = os.path.join(HERE, "build", f"libbfc_replay-{tf.__version__}.so")
    if not os.path.exists(lib) or os.path.getmtime(lib) < os.path.getmtime(src):
        os.makedirs(os.path.dirname(lib), exist_ok=True)
        cmd = ["g++", "-O2", "-shared", "-fPIC", "-w", src, "-o", lib,
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
        subprocess.run(cmd, check=True)
    f = ctypes.CDLL(lib).tfmg_bfc_replay
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64,
                                          ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    f.restype = ctypes.c_int
    return f


class BFC:
    def __init__(self, replay):
        self._replay = replay

    def run(self, trace, budget):
        import numpy as np
        arrays = [np.ascontiguousarray(trace.sizes, dtype=np.uint64), np.ascontiguousarray(trace.slots, np.uint32),
                  np.ascontiguousarray(trace.is_free, np.uint32)]
        elapsed, failed = ctypes.c_int64(), ctypes.c_int64()
        self._replay(*(a.ctypes.data for a in arrays), trace.ops, trace.nslots, int(budget), ctypes.byref(elapsed),
                     ctypes.byref(failed))
        return {"elapsed_ns": elapsed.value, "failed_at": failed.value if failed.value >= 0 else None}


def ns_per_op(run, trace, repeat):
    samples = []
    for _ in range(repeat):
        r = run()
        if r["failed_at"] is not None:
            raise RuntimeError(f"{trace.name}: replay failed at op {r['failed_at']}")
        samples.append(r["elapsed_ns"] / trace.ops)
    return statistics.median(samples)


def min_budget(trace, precision=0.002, bfc=None, **options):
    """Smallest budget (within `precision`) at which the pool (or `bfc`) completes the trace."""
    def ok(budget):
        if bfc is not None:
            return bfc.run(trace, int(budget))["failed_at"] is None
        return replay_pool(trace, int(budget), **options)["failed_at"] is None

    lo = trace.peak_live_bytes  # nothing below the peak can work
    hi = int(lo * 1.25) + (4 << 20)
    while not ok(hi):
        lo, hi = hi, hi * 2
    while (hi - lo) > precision * trace.peak_live_bytes:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="replays per timing (median). Defaults to 5.")
    ap.add_argument("--quick", action="store_true", help="one replay per timing, no variants")
    ap.add_argument("--out", default=os.path.join(RESULTS, "alloc_latency.json"))
    ap.add_argument("--seeds", default="",
                    help="comma-separated seeds: also the smallest budgets of churn traces made with "
                         "these seeds (100,000 operations each), mean and worst per layout")
    args = ap.parse_args(argv)
    repeat = 1 if args.quick else args.repeat

    results = {}
    variants = {}
    started = time.time()
    # "pool": as TensorFlow's CPU tensors get it by default (backed on demand, host_lazy);
    # "plain_pool": the budget as one region (Pool()'s default upstream, "host").
    pool_options = VARIANTS["on_demand_64k"]
    replay = load_bfc()
    bfc = BFC(replay) if replay is not None else None
    for trace in tr.standard_traces():
        budget = 4 * trace.peak_live_bytes + (64 << 20)
        times = {"system": [], "pool": [], "plain": [], "bfc": []}
        for _ in range(repeat):  # interleaved, so that the machine's noise spreads over all
            times["system"].append(ns_per_op(lambda: replay_system(trace), trace, 1))
            times["pool"].append(ns_per_op(lambda: replay_pool(trace, budget, **pool_options), trace, 1))
            times["plain"].append(ns_per_op(lambda: replay_pool(trace, budget), trace, 1))
            if bfc is not None:
                times["bfc"].append(ns_per_op(lambda: bfc.run(trace, budget), trace, 1))
        system, pool, plain = (statistics.median(times[k]) for k in ("system", "pool", "plain"))
        row = {
            "description": trace.description,
            "ops": trace.ops,
            "peak_live_bytes": trace.peak_live_bytes,
            "pool_ns_per_op": round(pool, 1),
            "system_ns_per_op": round(system, 1),
            "pool_over_system": round(pool / system, 3),
            "plain_pool_ns_per_op": round(plain, 1),
        }
        if bfc is not None:
            row["bfc_ns_per_op"] = round(statistics.median(times["bfc"]), 1)
            row["pool_over_bfc"] = round(pool / row["bfc_ns_per_op"], 3)
        if trace.name.startswith("churn"):
            row["min_budget_over_peak_live"] = round(min_budget(trace, **pool_options) / trace.peak_live_bytes, 4)
            row["plain_pool_min_budget_over_peak_live"] = round(min_budget(trace) / trace.peak_live_bytes, 4)
            if bfc is not None:
                row["bfc_min_budget_over_peak_live"] = round(min_budget(trace, bfc=bfc) / trace.peak_live_bytes, 4)
            if not args.quick:
                variants[trace.name] = {
                    name: round(min_budget(trace, **opts) / trace.peak_live_bytes, 4)
                    for name, opts in VARIANTS.items()
                }
        results[trace.name] = row

    print("pool: backed on demand, 64 KiB granules (host_lazy, TensorFlow's CPU pool); plain: the budget as one "
          "region; BFC: TensorFlow's BFCAllocator (min budget: its total memory)")

    def fmt(v, spec):
        return spec % v if v is not None else "-"
    print(f"{'trace':<12} {'pool ns/op':>11} {'system':>7} {'BFC':>7} {'pool/BFC':>9} "
          f"{'min budget/peak: pool':>22} {'BFC':>7} | {'plain: ns/op':>13} {'min budget/peak':>16}")
    for name, r in results.items():
        print(f"{name:<12} {r['pool_ns_per_op']:>11.1f} {r['system_ns_per_op']:>7.1f} "
              f"{fmt(r.get('bfc_ns_per_op'), '%.1f'):>7} {fmt(r.get('pool_over_bfc'), '%.3f'):>9} "
              f"{fmt(r.get('min_budget_over_peak_live'), '%.4f'):>22} "
              f"{fmt(r.get('bfc_min_budget_over_peak_live'), '%.4f'):>7} | "
              f"{r['plain_pool_ns_per_op']:>13.1f} {fmt(r.get('plain_pool_min_budget_over_peak_live'), '%.4f'):>16}")
    if variants:
        names = list(VARIANTS)
        print("\nmin budget / peak live by pool layout (what was tried):")
        print(f"{'trace':<12} " + " ".join(f"{n:>17}" for n in names))
        for t, v in variants.items():
            print(f"{t:<12} " + " ".join(f"{v[n]:>17.4f}" for n in names))

    def ratio(key):
        return round(results["churn_10000"][key] / results["churn_100"][key], 3)

    summary = {
        "churn_2000_pool_ns_per_op_le_100": results["churn_2000"]["pool_ns_per_op"] <= 100,
        "churn_10000_over_churn_100": ratio("pool_ns_per_op"),
        "min_budget_over_peak_live_le_1_10": all(
            r["min_budget_over_peak_live"] <= 1.10 for n, r in results.items() if "min_budget_over_peak_live" in r),
        "plain_churn_2000_ns_per_op_le_100": results["churn_2000"]["plain_pool_ns_per_op"] <= 100,
        "plain_churn_10000_over_churn_100": ratio("plain_pool_ns_per_op"),
        "churn_2000_pool_ns_per_op_le_60": results["churn_2000"]["pool_ns_per_op"] <= 60,
        "pool_no_slower_than_bfc": all(r["pool_over_bfc"] <= 1 for r in results.values()) if bfc else None,
        "pool_min_budget_no_worse_than_bfc": all(
            r["min_budget_over_peak_live"] <= r["bfc_min_budget_over_peak_live"]
            for r in results.values() if "bfc_min_budget_over_peak_live" in r) if bfc else None,
        "plain_min_budget_over_peak_live_le_1_10": all(
            r["plain_pool_min_budget_over_peak_live"] <= 1.10
            for n, r in results.items() if "plain_pool_min_budget_over_peak_live" in r),
    }
    out = {
        "command": "python benchmarks/alloc_latency.py" + (" --quick" if args.quick else "")
                   + (f" --seeds {args.seeds}" if args.seeds else ""),
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
        "bfc": {"tensorflow": __import__("tensorflow").__version__} if bfc else None,
        "repeat": repeat,
        "seconds": round(time.time() - started, 1),
        "traces": results,
        "variants_min_budget_over_peak_live": variants,
        "summary": summary,
    }
    other_seeds = {}
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",")]
        layouts = ("plain", "on_demand_64k", "on_demand_2m")
        print(f"\nmin budget / peak live on seeds {seeds} (100,000 operations), mean / worst:")
        print(f"{'trace':<12} " + " ".join(f"{n:>17}" for n in layouts))
        for name, n, hi in tr.CHURN_KINDS:
            traces = [tr.churn(name, n, 256, hi, seed=seed, ops=100_000) for seed in seeds]
            other_seeds[name] = {}
            for layout in layouts:
                v = [min_budget(t, precision=0.004, **VARIANTS[layout]) / t.peak_live_bytes for t in traces]
                other_seeds[name][layout] = {"mean": round(statistics.mean(v), 4), "worst": round(max(v), 4)}
            print(f"{name:<12} " + " ".join(
                f"{'%.3f / %.3f' % (other_seeds[name][l]['mean'], other_seeds[name][l]['worst']):>17}"
                for l in layouts))
        out["other_seeds"] = {"seeds": seeds, "min_budget_over_peak_live": other_seeds}

    print("\nsummary:", json.dumps(summary))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
