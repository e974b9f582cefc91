"""Out-of-memory errors in evaluation steps under Keras' torch backend on the GPU (the
glue's pool): fit()'s validation at a validation_batch_size too large, evaluate() and
predict() at a batch_size too large, each with MemGuardCallback. Each error must carry
tf_memguard's note with a size of that step that fits (tf_memguard/_inference.py); the
size must run in the same process after the except block; the budget must hold. Then the
largest size that runs, by bisection in fresh processes, for the ratio.

Usage: KERAS_BACKEND=torch python3 benchmarks/gpu/evaluation_oom.py --out DIR
(also runs on the TensorFlow backend on the CPU). Writes DIR/gpu_evaluation_oom.json on
Keras' torch backend, DIR/cpu_evaluation_oom.json on TensorFlow's (with --calls
nested_evaluate,nested_predict, an evaluate() or predict() a callback calls at each
epoch's end of a fit() at 64: ..._evaluation_oom_nested.json)."""
import argparse
import json
import os
import re
import subprocess
import sys

SCENARIO = r'''
import gc, json, re, sys
import tf_memguard
BUDGET, CALL, SIZE = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch_backend = __import__("keras").backend.backend() == "torch"
tf_memguard.install(max_bytes=BUDGET, device="cuda:0" if torch_backend else None)
import numpy as np, keras
from keras import layers
rng = np.random.default_rng(0)
x = rng.random((4096, 64, 64, 3), dtype=np.float32)
y = rng.integers(0, 10, 4096)
keras.utils.set_random_seed(0)
m = keras.Sequential([keras.Input((64, 64, 3))] + [
    l for f in (32, 64, 128) for l in (layers.Conv2D(f, 3, padding="same", activation="relu"),
                                       layers.BatchNormalization(), layers.MaxPooling2D())
] + [layers.GlobalAveragePooling2D(), layers.Dense(10)])
m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
oom = tf_memguard._backend.oom_errors()
out = {"call": CALL, "size": SIZE}

class EachEpoch(keras.callbacks.Callback):
    """A user's callback that evaluates (or predicts) at each epoch's end, inside fit()."""
    def __init__(self, size):
        super().__init__()
        self.size = size
    def on_epoch_end(self, epoch, logs=None):
        if CALL == "nested_evaluate":
            self.model.evaluate(x, y, batch_size=self.size, verbose=0)
        else:
            self.model.predict(x, batch_size=self.size, verbose=0)

def attempt(size, callbacks):
    if CALL.startswith("nested_"):
        m.fit(x[:1024], y[:1024], batch_size=64, epochs=1, verbose=0, callbacks=[EachEpoch(size)] + callbacks)
    elif CALL == "validation":
        m.fit(x[:1024], y[:1024], batch_size=64, epochs=1, verbose=0, validation_data=(x, y),
              validation_batch_size=size, callbacks=callbacks)
    elif CALL == "evaluate":
        m.evaluate(x, y, batch_size=size, verbose=0, callbacks=callbacks)
    else:
        m.predict(x, batch_size=size, verbose=0, callbacks=callbacks)

if CALL != "validation":
    m.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0)
gc.collect()
if CALL == "probe":
    # How much a step grows the pool at each size: test_on_batch() / predict_on_batch()
    # (what the note's sizes are measured with) against evaluate() / predict() over one
    # batch and over the whole data set (what the retry runs).
    def grew(fn):
        gc.collect()
        tf_memguard.reset_peak()
        s = tf_memguard.stats()
        before, refusals = s["bytes_in_use"], s["num_refusals"]
        try:
            fn()
        except oom:
            return {"out_of_memory": True, "before": before}
        s = tf_memguard.stats()
        return {"grew": s["window_peak_bytes_in_use"] - before, "left": s["bytes_in_use"] - before,
                "refusals_taken": s["num_refusals"] - refusals}
    # (SIZE must run: what a call that ran out leaves is not freed here)
    for size in (SIZE // 8, SIZE // 4, SIZE // 2, SIZE):
        out[str(size)] = {
            "test_on_batch": grew(lambda: m.test_on_batch(x[:size], y[:size])),
            "evaluate_all": grew(lambda: m.evaluate(x, y, batch_size=size, verbose=0)),
            "predict_on_batch": grew(lambda: m.predict_on_batch(x[:size])),
            "predict_all": grew(lambda: m.predict(x, batch_size=size, verbose=0)),
        }
    # Again beside the whole data set held in the pool as one tensor (on the torch backend
    # what a failed evaluate() at 4,096 holds: its batch, 192 MiB).
    held = keras.ops.convert_to_tensor(x)
    out["held"] = tf_memguard.stats()["bytes_in_use"]
    for size in (SIZE // 8, SIZE // 4, SIZE // 2, SIZE):
        out[f"{size}_beside_held"] = {
            "test_on_batch": grew(lambda: m.test_on_batch(x[:size], y[:size])),
            "predict_on_batch": grew(lambda: m.predict_on_batch(x[:size])),
        }
    del held
    print("RESULT " + json.dumps(out))
    sys.exit(0)
out["in_use_before"] = tf_memguard.stats()["bytes_in_use"]
try:
    attempt(SIZE, [tf_memguard.MemGuardCallback(verbose=0)])
    out["first"] = "ran"
except oom as e:
    out["first"] = "out of memory"
    note = (getattr(e, "__notes__", None) or [""])[-1]
    out["note"] = note
    found = re.search(r"(?:validation_)?batch_size=(\d+) \(or less\)", note)
    out["named"] = int(found.group(1)) if found else None
gc.collect()
# What the failed call left in the pool when the retry begins (its data must be gone).
out["in_use_before_retry"] = tf_memguard.stats()["bytes_in_use"]
if out.get("named"):
    try:
        attempt(out["named"], [])
        out["retry"] = "ran"
    except oom:
        out["retry"] = "out of memory"
s = tf_memguard.stats()
out["peak_reserved"], out["limit"] = s["peak_bytes_reserved"], s["bytes_limit"]
out["peak_in_use"] = s["peak_bytes_in_use"]
print("RESULT " + json.dumps(out))
'''


def run(budget, call, size):
    p = subprocess.run([sys.executable, "-c", SCENARIO, str(budget), call, str(size)], capture_output=True,
                       text=True, timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"call": call, "size": size, "error": (p.stdout + p.stderr)[-1500:]}
    return json.loads(lines[-1][7:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--budget", type=int, default=512 << 20)
    ap.add_argument("--failed", type=int, default=4096)
    ap.add_argument("--bisect", type=int, default=5, help="fresh-process runs at most per call, for the largest")
    ap.add_argument("--probe", type=int, default=0,
                    help="first, a step's growth at this size, half and a quarter: test_on_batch() and "
                         "predict_on_batch() against evaluate() and predict()")
    ap.add_argument("--calls", default="validation,evaluate,predict",
                    help="of validation, evaluate, predict, nested_evaluate, nested_predict")
    a = ap.parse_args()
    rows, probe = [], None
    if a.probe:
        probe = run(a.budget, "probe", a.probe)
        print("probe", json.dumps(probe), flush=True)
    for call in a.calls.split(","):
        r = run(a.budget, call, a.failed)
        print(json.dumps({k: v for k, v in r.items() if k != "note"}), flush=True)
        print("  note:", r.get("note", "")[-420:], flush=True)
        named = r.get("named")
        if named and r.get("retry") != "ran":
            # The retry in the process ran out: does the size named run in a fresh one?
            t = run(a.budget, call, named)
            r["named_in_a_fresh_process"] = t.get("first", t.get("error", "")[-200:])
            print(f"  {call} at {named} (named), fresh process: {r['named_in_a_fresh_process']}", flush=True)
        # The largest size that runs, in fresh processes (a plain run: no note asked for).
        lo, hi = (named, a.failed) if named and r.get("retry") == "ran" else (0, a.failed)
        for _ in range(a.bisect):
            if hi - lo <= max(8, lo // 32):
                break
            # (geometric: the size named is far below the failed one, and the largest that
            # runs near the named one)
            mid = int((max(lo, 1) * hi) ** 0.5) if hi > 4 * max(lo, 1) else (lo + hi) // 2
            t = run(a.budget, call, mid)
            ok = t.get("first") == "ran"
            print(f"  {call} at {mid}: {'ran' if ok else t.get('first', t.get('error', '')[-200:])}", flush=True)
            lo, hi = (mid, hi) if ok else (lo, mid)
        r["largest_that_ran"], r["smallest_out_of_memory"] = lo, hi
        r["named_over_largest"] = round(named / lo, 3) if named and lo else None
        rows.append(r)
    os.makedirs(a.out, exist_ok=True)
    name = "gpu" if os.environ.get("KERAS_BACKEND") == "torch" else "cpu"
    if all(c.startswith("nested_") for c in a.calls.split(",")):
        name += "_evaluation_oom_nested"
    else:
        name += "_evaluation_oom"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump({"budget": a.budget, "failed_size": a.failed, "probe": probe,
                   "rows": rows}, f, indent=1)
    print(f"{'call':<16}{'named':>8}{'retry':>16}{'largest ran':>13}{'ran out at':>12}{'ratio':>8}")
    for r in rows:
        print(f"{r['call']:<16}{str(r.get('named')):>8}{str(r.get('retry')):>16}{r['largest_that_ran']:>13}"
              f"{r['smallest_out_of_memory']:>12}{str(r['named_over_largest']):>8}")


if __name__ == "__main__":
    main()
