"""Does the budget hold while Keras trains, and what does TensorFlow take outside it?

Trains a small CNN (generated data, 2 epochs) under a budget B in a fresh process per
configuration, sampling every 2 ms: the process's resident memory (RSS), glibc's heap in
use (mallinfo2: where Eigen's and oneDNN's scratch buffers come from, which bypass
TensorFlow's allocator), and the pool's statistics. For oneDNN off and on
(TF_ENABLE_ONEDNN_OPTS), three runs: TensorFlow's own allocator (plugin turned off with
TF_MEMGUARD_DISABLE=1: the baseline), tf_memguard without install() (the pool passes
allocations through and counts them), and tf_memguard under the budget.

Prints a table and writes benchmarks/results/tf_budget.json. Times are ratios against
the baseline run of the same oneDNN setting, measured in the same invocation.

    python benchmarks/tf_budget.py [--budget-mib 160] [--epochs 2]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CHILD = r"""
import ctypes, json, os, sys, threading, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
budget = int(sys.argv[1]); epochs = int(sys.argv[2])
import numpy as np, tensorflow as tf, keras
import tf_memguard

libc = ctypes.CDLL("libc.so.6")
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def heap():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd

samples = {"rss": 0, "heap": 0, "pool_reserved": 0, "pool_in_use": 0, "overshoot": 0}
stop = threading.Event()
def sample():
    while not stop.is_set():
        s = tf_memguard.stats()
        for key, v in (("rss", rss()), ("heap", heap()), ("pool_reserved", s["bytes_reserved"]),
                       ("pool_in_use", s["bytes_in_use"]), ("overshoot", s["overshoot_bytes_in_use"])):
            samples[key] = max(samples[key], v)
        time.sleep(0.002)

rng = np.random.default_rng(0)
n = 4096
x = rng.random((n, 32, 32, 3), dtype=np.float32)
y = (x[:, :16].mean(axis=(1, 2, 3)) > x[:, 16:].mean(axis=(1, 2, 3))).astype("int32")
if budget:
    tf_memguard.install(max_bytes=budget)
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((32, 32, 3)),
    keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
    keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.predict(x[:8], verbose=0)
base_rss, base_heap = rss(), heap()
base_pool = tf_memguard.stats()
t = threading.Thread(target=sample, daemon=True); t.start()
start = time.perf_counter()
h = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0)
elapsed = time.perf_counter() - start
stop.set(); t.join()
s = tf_memguard.stats()
from tensorflow.python.util import _pywrap_util_port
print(json.dumps({
    "seconds": elapsed, "accuracy": h.history["accuracy"][-1],
    "onednn": bool(_pywrap_util_port.IsMklEnabled()),
    "rss_growth": samples["rss"] - base_rss, "heap_growth": samples["heap"] - base_heap,
    "pool_peak_in_use": s["peak_bytes_in_use"], "pool_peak_reserved": s["peak_bytes_reserved"],
    "pool_peak_in_use_sampled": samples["pool_in_use"], "overshoot_peak": s["peak_overshoot_bytes"],
    "overshoot_by_kind": s["overshoot_bytes_by_kind"], "refusals": s["num_refusals"],
    "allocs": s["num_allocs"] - base_pool["num_allocs"], "limit": s["bytes_limit"]}))
"""


def run_child(budget, epochs, onednn, disable=False):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0")
    env.pop("TF_MEMGUARD_DISABLE", None)
    if disable:
        env["TF_MEMGUARD_DISABLE"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, str(budget), str(epochs)], env=env,
                         capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n):
    return n / (1 << 20)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=int, default=160, help="the budget B. Defaults to 160.")
    ap.add_argument("--epochs", type=int, default=2, help="Defaults to 2.")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per configuration, interleaved; times are medians. Defaults to 3.")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tf_budget.json"))
    args = ap.parse_args(argv)
    budget = args.budget_mib << 20

    rows = {}
    for onednn in (False, True):
        tag = "onednn" if onednn else "no_onednn"
        configs = [(0, True), (0, False), (budget, False)]
        runs = [[], [], []]
        for _ in range(args.repeat):  # interleaved, so that noise spreads over all three
            for i, (b, disable) in enumerate(configs):
                runs[i].append(run_child(b, args.epochs, onednn, disable=disable))
        base, counted, guarded = [dict(rs[-1], seconds=statistics.median(r["seconds"] for r in rs),
                                       seconds_all=[round(r["seconds"], 3) for r in rs]) for rs in runs]
        for r in (base, counted, guarded):
            r["time_ratio_vs_tf_allocator"] = round(r["seconds"] / base["seconds"], 3)
        rows[f"{tag}_tf_allocator"] = base
        rows[f"{tag}_passthrough"] = counted
        rows[f"{tag}_budget"] = guarded

    print(f"budget B = {args.budget_mib} MiB; small CNN, 4,096 samples of 32x32x3, batch 64, "
          f"{args.epochs} epochs\n")
    print(f"{'run':<22} {'oneDNN':>6} {'time s':>7} {'x TF':>7} {'pool peak':>10} {'reserved':>9} "
          f"{'overshoot':>10} {'refused':>7} {'RSS +':>8} {'malloc +':>9} {'acc':>5}")
    for name, r in rows.items():
        print(f"{name:<22} {str(r['onednn']):>6} {r['seconds']:>7.2f} "
              f"{r['time_ratio_vs_tf_allocator']:>7.3f} {mib(r['pool_peak_in_use']):>8.1f}Mi "
              f"{mib(r['pool_peak_reserved']):>7.1f}Mi {mib(r['overshoot_peak']):>8.1f}Mi {r['refusals']:>7} "
              f"{mib(r['rss_growth']):>6.1f}Mi {mib(r['heap_growth']):>7.1f}Mi {r['accuracy']:>5.2f}")
    print("\n'x TF': time over the same run with TensorFlow's own allocator (plugin off), whose "
          "pool columns are empty. 'RSS +' is the resident-memory growth during fit against its level before; "
          "'malloc +' the growth of glibc's heap, which holds what TensorFlow allocates outside "
          "its allocator (Eigen and oneDNN scratch): not under the budget.")
    out = {
        "command": "python benchmarks/tf_budget.py --budget-mib %d --epochs %d --repeat %d" % (
            args.budget_mib, args.epochs, args.repeat),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "budget_bytes": budget,
        "runs": rows,
        "summary": {name: {"reserved_within_budget": r["pool_peak_reserved"] <= budget,
                           "rss_growth_over_budget": round(r["rss_growth"] / budget, 3),
                           "outside_allocator_mib": round(mib(r["heap_growth"]), 1)}
                    for name, r in rows.items() if name.endswith("_budget")},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
