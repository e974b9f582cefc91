"""What tf_memguard costs TensorFlow, and how tight a budget it can hold, beside the
allocator it replaces.

The reference CNN (the small CNN of tf_budget.py: 4,096 generated samples of 32x32x3,
batch 64, fixed seed), one epoch per fresh process:

* step_time_ratio: the time of a training step under tf_memguard with a budget that fits
  (2x the epoch's peak) over the same with TensorFlow's own allocator (the plugin turned
  off with TF_MEMGUARD_DISABLE=1): epochs 2-5 of each process timed (the first traces the
  step), processes interleaved, --repeat of each; oneDNN off and on. On this 2-core
  machine an epoch takes one of two times, about 1.45 or 2.5 s without oneDNN, whichever
  the allocator, TensorFlow's own included, and in the same process from one epoch to
  the next (benchmarks/NOTES.md): so the ratio is of the medians of each process's fastest
  epoch (step_time_ratio), and also of all epochs (step_time_ratio_all_epochs).
* min_budget_over_peak_live: the smallest budget at which the epoch completes under
  tf_memguard (bisection, oneDNN off: a hard budget needs it off), over that epoch's peak
  bytes in use at a budget that fits.
* bfc_min_budget_over_peak_live: the same under TensorFlow's BFC allocator
  (TF_CPU_ALLOCATOR_USE_BFC=true, its limit TF_CPU_BFC_MEM_LIMIT_IN_MB, tf_memguard off),
  over the same peak live bytes: the epoch's tensors are the same under both (fixed seed),
  and the pool counts them as requested (to 64 bytes). BFC's own peak
  (tf.config.experimental.get_memory_info) counts the chunks it hands out, which can be up
  to twice the request (it splits a free chunk only when the rest is at least as large),
  so its ratio over its own peak is given too (bfc_min_budget_over_own_peak).

Prints a table and writes benchmarks/results/tf_overhead.json.

    python benchmarks/tf_overhead.py [--repeat 5] [--precision 0.01]
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
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
mode, budget, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import numpy as np
if mode == "memguard":
    import tf_memguard
    tf_memguard.install(max_bytes=budget)
import tensorflow as tf, keras
rng = np.random.default_rng(0)
n = 4096
x = rng.random((n, 32, 32, 3), dtype=np.float32)
y = (x[:, :16].mean(axis=(1, 2, 3)) > x[:, 16:].mean(axis=(1, 2, 3))).astype("int32")
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((32, 32, 3)),
    keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
    keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.predict(x[:8], verbose=0)   # built; the step's trace comes with the epoch
def peak():
    if mode == "memguard":
        return tf_memguard.stats()["peak_bytes_in_use"]
    if mode == "bfc":
        return tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return None
class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()
    def on_epoch_end(self, epoch, logs=None):
        self.last = time.perf_counter() - self.t0
        self.all = getattr(self, "all", []) + [self.last]
timer = EpochTimes()
try:
    model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=[timer])
    ok = True
except tf.errors.ResourceExhaustedError:
    ok = False
print(json.dumps({"ok": ok, "seconds": getattr(timer, "last", None), "epoch_seconds": getattr(timer, "all", []),
                  "peak": peak()}))
"""


def child(mode, budget=0, onednn=False, epochs=1):
    """`epochs` of the reference CNN in a fresh process ("memguard", "bfc" or "tf":
    TensorFlow's own allocator); "seconds" is the last epoch's time."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0")
    for key in ("TF_MEMGUARD_DISABLE", "TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"):
        env.pop(key, None)
    if mode != "memguard":
        env["TF_MEMGUARD_DISABLE"] = "1"
    if mode == "bfc":
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(max(1, budget >> 20))
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(budget), str(epochs)], env=env,
                         capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        # A refusal TensorFlow could not survive is a failure at that budget too.
        return {"ok": False, "seconds": None, "peak": None, "rc": out.returncode}
    return json.loads(lines[-1])


def min_budget(mode, lo, hi, precision):
    """Smallest budget (bytes; BFC's limit is whole MiB) at which the epoch completes,
    between `lo` (fails) and `hi` (completes)."""
    step = 1 << 20
    runs = 0
    while hi - lo > max(step, precision * lo):
        mid = (lo + hi) // 2
        if mode == "bfc":
            mid = max(lo + step, mid // step * step)
        runs += 1
        if child(mode, mid)["ok"]:
            hi = mid
        else:
            lo = mid
    return hi, runs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per configuration, interleaved. Defaults to 5.")
    ap.add_argument("--precision", type=float, default=0.01,
                    help="bisection precision, as a share of the budget. Defaults to 0.01.")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tf_overhead.json"))
    args = ap.parse_args(argv)
    started = time.time()

    # Each allocator's peak for the epoch, at a budget that surely fits (1 GiB).
    generous = 1 << 30
    peaks = {}
    for mode in ("memguard", "bfc"):
        r = child(mode, generous)
        if not r["ok"]:
            raise RuntimeError(f"{mode}: the epoch did not complete under 1 GiB")
        peaks[mode] = r["peak"]
    mins, runs = {}, {}
    for mode in ("memguard", "bfc"):
        hi = 4 * peaks["memguard"]
        if not child(mode, hi)["ok"]:
            hi = generous
        mins[mode], runs[mode] = min_budget(mode, peaks["memguard"] // 2, hi, args.precision)

    budget = 2 * peaks["memguard"]
    timing = {}
    for onednn in (False, True):
        times = {"tf_allocator": [], "memguard": []}
        for _ in range(args.repeat):  # interleaved, so that the machine's noise spreads over both
            times["tf_allocator"].append(child("tf", 0, onednn, epochs=5)["epoch_seconds"][1:])
            times["memguard"].append(child("memguard", budget, onednn, epochs=5)["epoch_seconds"][1:])
        tag = "onednn" if onednn else "no_onednn"
        timing[tag] = {k: [[round(v, 3) for v in run] for run in vs] for k, vs in times.items()}
        best = {k: statistics.median(min(run) for run in vs) for k, vs in times.items()}
        every = {k: statistics.median(v for run in vs for v in run) for k, vs in times.items()}
        timing[tag]["best_epoch_median"] = {k: round(v, 3) for k, v in best.items()}
        timing[tag]["all_epochs_median"] = {k: round(v, 3) for k, v in every.items()}
        timing[tag]["ratio"] = round(best["memguard"] / best["tf_allocator"], 3)
        timing[tag]["ratio_all_epochs"] = round(every["memguard"] / every["tf_allocator"], 3)

    result = {
        "step_time_ratio": {k: v["ratio"] for k, v in timing.items()},
        "step_time_ratio_all_epochs": {k: v["ratio_all_epochs"] for k, v in timing.items()},
        "min_budget_over_peak_live": round(mins["memguard"] / peaks["memguard"], 4),
        "bfc_min_budget_over_peak_live": round(mins["bfc"] / peaks["memguard"], 4),
        "bfc_min_budget_over_own_peak": round(mins["bfc"] / peaks["bfc"], 4),
        "peak_live_bytes": peaks,
        "min_budget_bytes": mins,
        "bisection_runs": runs,
        "timing_seconds": timing,
        "budget_for_timing_bytes": budget,
        "command": "python benchmarks/tf_overhead.py --repeat %d --precision %g" % (args.repeat, args.precision),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "seconds": round(time.time() - started, 1),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    mib = 1 << 20
    print("reference CNN (4,096 samples of 32x32x3, batch 64, one epoch)\n")
    live = peaks["memguard"]
    print(f"peak live bytes of the epoch: {live / mib:.1f} MiB\n")
    print(f"{'allocator':<12} {'own peak':>10} {'min budget':>11} {'min/peak live':>14} {'min/own peak':>13}")
    for mode, name in (("memguard", "tf_memguard"), ("bfc", "TF BFC")):
        print(f"{name:<12} {peaks[mode] / mib:>8.1f}Mi {mins[mode] / mib:>9.1f}Mi {mins[mode] / live:>14.4f} "
              f"{mins[mode] / peaks[mode]:>13.4f}")
    print(f"\nepochs 2-5 of {args.repeat} interleaved runs each: the median of each run's fastest epoch, "
          "and of all epochs")
    print(f"{'oneDNN':<10} {'TF allocator s':>15} {'tf_memguard s':>14} {'ratio':>6} {'all epochs':>11}")
    for tag, t in timing.items():
        b = t["best_epoch_median"]
        print(f"{tag:<10} {b['tf_allocator']:>15.3f} {b['memguard']:>14.3f} {t['ratio']:>6.3f} {t['ratio_all_epochs']:>11.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
