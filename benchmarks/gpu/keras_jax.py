"""Keras on JAX under tf_memguard (XLA's cap), on a real GPU (the lent H200).

Two models, a CNN (64x64x3, conv + batch norm) and a 4-block transformer (sequence 128,
width 256), each under a 2 GiB cap. Every run is its own process (XLA reads its cap once
per process), all from one call of this script:

  advice   fit at about half the limit for 2 epochs with MemGuardCallback: its
           suggestion, each epoch's peak in the logs against XLA's own peak
           (memory_stats()["peak_bytes_in_use"]).
  oom      fit at 4x the suggestion: the explained error (refused before it ran, or the
           runtime OOM), the weights unchanged, and a retry at the suggestion in the same
           process that trains (its loss read every step: XLA reports a failed step only
           when its result is read).
  trains   fit at the suggestion for 2 epochs in a fresh process, loss read every step.
  limit    the largest batch size that trains 2 epochs in 2 of 2 fresh processes (loss
           read every step), on a grid from the suggestion to 1.25x it (steps of 3-10%).
  timing   in one process, fit(epochs=4) alternately without and with MemGuardCallback
           (3 rounds after a warm-up, 4x the samples: epochs of 64 steps): the median
           epoch time (epochs 2-4 of each fit) with over without. Run alone on the GPU.

The advice runs first (both models at once), then the timing (one process at a time),
then every other job, TFMG_JAX_PARALLEL (8) processes at a time: each process has its own
cap, so the jobs do not share memory, only the GPU's time.

Usage (from the repository root, Keras as wheels in /tmp/site): python3
benchmarks/gpu/keras_jax.py --out DIR; writes DIR/gpu_keras_jax.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = int(os.environ.get("TFMG_JAX_CAP", 2 << 30))
DEVICE = os.environ.get("TFMG_JAX_DEVICE", "GPU:0")  # CPU:0 for a dry run without a GPU
SAMPLES = {"cnn": 4096, "transformer": 2048} if "TFMG_JAX_SAMPLES" not in os.environ else \
    {"cnn": int(os.environ["TFMG_JAX_SAMPLES"]), "transformer": int(os.environ["TFMG_JAX_SAMPLES"])}


def model_and_data(kind):
    """probe_jax.py's models and data (the same as measured there), seeded."""
    import keras
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import probe_jax
    keras.utils.set_random_seed(0)
    m, shape = probe_jax.keras_model(kind)
    X, Y = probe_jax.data(kind, shape, SAMPLES[kind])
    return m, X, Y


def keras_callback():
    import keras
    return keras.callbacks.Callback


def reader():
    """A callback that reads each step's loss, so that a failed step raises there."""
    import keras

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])
    return Read()


def one(job, kind, batch):
    os.environ["KERAS_BACKEND"] = "jax"
    sys.path.insert(0, ROOT)
    import tf_memguard
    tf_memguard.install(max_bytes=CAP, device=DEVICE)
    import jax
    import numpy as np
    m, X, Y = model_and_data(kind)

    def stats():
        return jax.devices()[0].memory_stats() or {}
    out = {"job": job, "kind": kind, "batch": batch}
    if job == "advice":
        cb = tf_memguard.MemGuardCallback(verbose=0)
        h = m.fit(X, Y, batch_size=batch, epochs=2, verbose=0, callbacks=[cb, reader()])
        r = cb.report
        out.update(suggestion=r.suggested_batch_size, method=r.suggestion_method,
                   logged_peaks_mib=h.history["memguard_peak_mib"], peak_source=r.peak_source,
                   xla_peak=stats().get("peak_bytes_in_use"), limit=stats().get("bytes_limit"),
                   memory_model=r.memory_model, report=str(r))
    elif job == "oom":
        m.fit(X[:batch // 4], Y[:batch // 4], batch_size=max(1, batch // 16), epochs=1, verbose=0)
        w0 = [np.array(v.value) for v in m.trainable_variables]
        t = time.perf_counter()
        try:
            m.fit(X, Y, batch_size=batch, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - the type is measured
            out["error"] = f"{type(e).__name__}: {str(e)[:1200]}"
        out["seconds_to_error"] = time.perf_counter() - t
        import gc
        gc.collect()  # as the error's note says: the failed fit()'s batches go with it
        out["weights_unchanged"] = all(np.array_equal(a, np.array(v.value)) for a, v in zip(w0, m.trainable_variables))
        s = tf_memguard.report().suggested_batch_size
        out["suggestion"] = s
        try:
            h = m.fit(X, Y, batch_size=s, epochs=1, verbose=0, callbacks=[reader()])
            out["retry"] = {"batch": s, "loss": h.history["loss"]}
        except Exception as e:  # noqa: BLE001
            out["retry"] = f"{type(e).__name__}: {str(e)[:400]}"
    elif job == "trains":
        try:
            h = m.fit(X, Y, batch_size=batch, epochs=2, verbose=0, callbacks=[reader()])
            out["trained"] = bool(np.isfinite(h.history["loss"][-1]))
        except Exception as e:  # noqa: BLE001
            out["trained"] = False
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["xla_peak"] = stats().get("peak_bytes_in_use")
    elif job == "timing":
        class Times(keras_callback()):
            def on_train_begin(self, logs=None):
                self.t = []

            def on_epoch_begin(self, epoch, logs=None):
                self.t0 = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                float(logs["loss"])
                self.t.append(time.perf_counter() - self.t0)
        plain, guarded, hooks = [], [], []
        X, Y = np.concatenate([X] * 4), np.concatenate([Y] * 4)
        m.fit(X, Y, batch_size=batch, epochs=1, verbose=0)
        for _ in range(int(os.environ.get("TFMG_JAX_ROUNDS", 3))):  # ABAB: epochs 2-4 of each fit (the first holds the per-fit check)
            for cbs, into in (([], plain), ([tf_memguard.MemGuardCallback(verbose=0, advice=False)], guarded)):
                t = Times()
                m.fit(X, Y, batch_size=batch, epochs=4, verbose=0, callbacks=cbs + [t])
                into.extend(t.t[1:])
                if cbs:  # the guard's own time per epoch (its first epoch holds its compile)
                    hooks.extend(cbs[0]._xla.hook_epochs[1:])
        t0 = time.perf_counter()
        for _ in range(100):
            jax.devices()[0].memory_stats()
        out.update(plain_s=plain, guarded_s=guarded, guard_seconds_per_epoch=hooks,
                   memory_stats_seconds=(time.perf_counter() - t0) / 100,
                   ratio=statistics.median(guarded) / statistics.median(plain))
    return out


def run(job, kind, batch):
    try:
        p = subprocess.run([sys.executable, __file__, "--one", job, kind, str(batch)], capture_output=True,
                           text=True, timeout=int(os.environ.get("TFMG_JAX_JOB_TIMEOUT", 240)))
    except subprocess.TimeoutExpired as e:
        r = {"job": job, "kind": kind, "batch": batch, "timed_out": True, "stderr": str(e.stderr or "")[-2000:]}
        print(json.dumps(r), flush=True)
        return r
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    r = json.loads(lines[-1][7:]) if lines else {"job": job, "kind": kind, "batch": batch, "rc": p.returncode,
                                                 "stderr": p.stderr[-2000:]}
    print(json.dumps({k: v for k, v in r.items() if k != "memory_model"}), flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--one", nargs=3)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one[0], a.one[1], int(a.one[2])), default=str), flush=True)
        return
    if os.environ.get("TFMG_JAX_JOBS"):  # a rerun of named jobs, one at a time: job:kind:batch,...
        rerun = {"cap": CAP, "rounds": int(os.environ.get("TFMG_JAX_ROUNDS", 3)), "jobs": []}
        for spec in os.environ["TFMG_JAX_JOBS"].split(","):
            job, kind, batch = spec.split(":")
            rerun["jobs"].append(run(job, kind, int(batch)))
            with open(os.path.join(a.out, "gpu_keras_jax_rerun.json"), "w") as f:
                json.dump(rerun, f, indent=1, default=str)
        return
    results = {"cap": CAP, "models": {}}
    path = os.path.join(a.out, "gpu_keras_jax.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    halves = {"cnn": 256, "transformer": 96}
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(int(os.environ.get("TFMG_JAX_PARALLEL", 8)))
    advice = {k: pool.submit(run, "advice", k, h) for k, h in halves.items()}
    for kind, half in halves.items():
        results["models"][kind] = {"advice": advice[kind].result()}
    save()
    for kind, half in halves.items():  # alone on the GPU (TFMG_JAX_TIMING=0: not run, for a dry run)
        results["models"][kind]["timing"] = run("timing", kind, half) \
            if os.environ.get("TFMG_JAX_TIMING", "1") != "0" else {}
    save()
    jobs = {}
    for kind, r in results["models"].items():
        s = r["advice"].get("suggestion") or halves[kind]
        r["grid"] = grid = sorted({s} | {int(s * f) for f in (1.03, 1.06, 1.1, 1.15, 1.25)})
        jobs[(kind, "oom")] = pool.submit(run, "oom", kind, 4 * s)
        for b in grid:
            for i in range(2):
                jobs[(kind, b, i)] = pool.submit(run, "trains", kind, b)
    for kind, r in results["models"].items():
        s = r["advice"].get("suggestion") or halves[kind]
        r["oom"] = jobs[(kind, "oom")].result()
        r["trains"] = [jobs[(kind, s, i)].result() for i in range(2)]
        runs = {b: [jobs[(kind, b, i)].result() for i in range(2)] for b in r["grid"]}
        r["limit_runs"] = {b: [bool(t.get("trained")) for t in ts] for b, ts in runs.items()}
        largest, failed = 0, None
        for b in r["grid"]:  # the largest of the grid below which every size trained 2 of 2
            if all(r["limit_runs"][b]):
                largest = b
            else:
                failed = b
                break
        r["largest_trained"] = largest or None
        r["smallest_failed"] = failed
        ok = all(t.get("trained") for t in r["trains"])
        r["suggestion_trained_2_of_2"] = ok
        # The true largest lies in [largest, failed): the ratio in (s / failed, s / largest].
        r["suggestion_over_largest"] = s / largest if ok and largest else None
        r["suggestion_over_largest_at_least"] = s / failed if ok and failed else None
        save()
    print(json.dumps({k: {"suggestion": v["advice"].get("suggestion"), "trained_2_of_2":
                          v["suggestion_trained_2_of_2"], "largest_trained": v["largest_trained"],
                          "smallest_failed": v["smallest_failed"], "ratio": v["suggestion_over_largest"],
                          "timing": v["timing"].get("ratio"), "oom_retry": v["oom"].get("retry")}
                      for k, v in results["models"].items()}))


if __name__ == "__main__":
    main()
