"""What the advice costs: the first epoch of examples/train_under_budget.py with
MemGuardCallback() against MemGuardCallback(advice=False), in fresh processes, interleaved.

Two cases: the example as it is (validation_split=0.1: 3,687 training samples, so fit()'s
last batch is partial and gives the memory model its second batch size for free), and the
same data without a validation split (4,096 samples, 64 divides them: the second size comes
from a short fit() of its own at 32 samples, two steps). Prints a table and writes
benchmarks/results/advice_overhead.json.

    python benchmarks/advice_overhead.py [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")

RUN = """
import os, sys, time, json
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, {examples!r})
import tf_memguard
tf_memguard.install(max_bytes="128MiB")
import keras
from _data import pattern_images, small_cnn
x, y = pattern_images(4096)
keras.utils.set_random_seed(0)
m = small_cnn()
m.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=["accuracy"])
times = []
class Timer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.t = time.perf_counter()
    def on_epoch_end(self, epoch, logs=None):
        times.append(time.perf_counter() - self.t)
m.fit(x, y, batch_size=64, epochs=2, validation_split={split}, verbose=0,
      callbacks=[tf_memguard.MemGuardCallback(verbose=0, advice={advice}), Timer()])
from tf_memguard._recording import advice_steps
rep = tf_memguard.report()
in_fit = advice_steps()
suggested = rep.suggested_batch_size   # read: a suggestion above 64 is confirmed by a step now
print(json.dumps({{"first": times[0], "second": times[1], "suggested": suggested,
                   "method": rep.suggestion_method, "peak_reserved": tf_memguard.stats()["peak_bytes_reserved"],
                   "steps_in_fit": in_fit, "steps_in_all": advice_steps()}}))
"""


def one(advice, split):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run([sys.executable, "-c", RUN.format(examples=EXAMPLES, advice=advice, split=split)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(lines[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "advice_overhead.json"))
    args = ap.parse_args(argv)
    result = {}
    for label, split in (("the example (validation_split=0.1)", 0.1), ("4,096 samples, no split", 0.0)):
        on, off = [], []
        for _ in range(args.rounds):  # interleaved, so that the machine's load falls on both
            off.append(one(False, split))
            on.append(one(True, split))
        ratio = statistics.median(r["first"] for r in on) / statistics.median(r["first"] for r in off)
        result[label] = {
            "first_epoch_s_advice": [round(r["first"], 3) for r in on],
            "first_epoch_s_no_advice": [round(r["first"], 3) for r in off],
            "first_epoch_ratio": round(ratio, 3),
            "second_epoch_ratio": round(statistics.median(r["second"] for r in on) /
                                        statistics.median(r["second"] for r in off), 3),
            "suggested": [r["suggested"] for r in on], "method": on[-1]["method"],
            "peak_reserved_max": max(r["peak_reserved"] for r in on + off), "budget": 128 << 20,
            # Training steps (and their samples) the advice ran beyond fit()'s own: during
            # fit(), and in all once the suggestion was read (its confirmation).
            "advice_steps_in_fit": [r["steps_in_fit"]["steps"] for r in on],
            "advice_steps_in_all": [r["steps_in_all"]["steps"] for r in on],
            "advice_samples_in_all": [r["steps_in_all"]["samples"] for r in on],
        }
    print(f"{'case':<38}{'epoch 1, advice':>16}{'no advice':>11}{'ratio':>7}{'epoch 2':>9}"
          f"{'steps beyond fit: in fit / all (samples)':>44}  suggested")
    for label, r in result.items():
        steps = f"{max(r['advice_steps_in_fit'])} / {max(r['advice_steps_in_all'])} ({max(r['advice_samples_in_all'])})"
        print(f"{label:<38}{statistics.median(r['first_epoch_s_advice']):>15.2f}s"
              f"{statistics.median(r['first_epoch_s_no_advice']):>10.2f}s{r['first_epoch_ratio']:>7.3f}"
              f"{r['second_epoch_ratio']:>9.3f}{steps:>44}  {r['suggested']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
