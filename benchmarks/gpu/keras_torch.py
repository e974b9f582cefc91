"""Keras on PyTorch under tf_memguard's budget, on a real GPU (the lent H200).

Each run is its own process (PyTorch's allocator is chosen once per process), all in one
call of this script:

  caching    Keras CNN (inputs 64x64x3, 20,480 samples, batch 256, 3 epochs) with PyTorch's
             caching allocator: epoch times, max_memory_reserved / max_memory_allocated.
  memguard   the same under tf_memguard.install(max_bytes=0.5, device="cuda:0") with
             MemGuardCallback: epoch times, peak bytes backed / peak bytes in use.
             caching and memguard alternate (ABAB); the ratio is of the medians of
             epochs 2-3 (epoch 1 holds cuDNN's autotuning and PyTorch's warm-up).
             tf_memguard's defaults: on CUDA trim_above_peak 0.04 (free granules move
             under new blocks whenever the bytes backed would pass 1.04 x the peak in
             use so far; no device synchronization).
  memguard_trim  memguard with TF_MEMGUARD_TRIM_ABOVE_PEAK=--trim (default 0: no trim
             line, the default before granules moved), a third run in each round
             (ABCABC...); --trim none: no such runs.
  oom        budget = 80% of memguard's peak in use: fit at batch 256 must raise
             torch.OutOfMemoryError carrying tf_memguard's note; then, in the same
             process, cuBLAS still works, the weights are unchanged, and fit at the
             suggested batch size trains; find_batch_size answers within 4 steps and its
             size trains too.
  naive      the same budget with a naive pluggable allocator (cuMemAlloc per tensor,
             NULL when over the budget): what PyTorch does with a null block, and whether
             cuBLAS survives it (the failure the issue reports).
  torch_only plain PyTorch (no Keras) under a 1 GiB budget: a 2 GiB tensor is refused
             with torch.OutOfMemoryError and a matmul works afterwards.
  cublas_naive / cublas_memguard
             why a naive allocator breaks cuBLAS: under a 256 MiB budget, memory is filled
             so that a matmul's output (4 MiB) fits but cuBLAS's workspace does not; then
             the filler is freed and the same matmul runs again, checked against the CPU.

  advice     (--advice-only) the batch-size advice on PyTorch: under the oom budget, a
             fit at batch 128 for two epochs with MemGuardCallback's defaults gives its
             suggestion (the memory model of its steps, from the glue's events); the
             suggestion must train two epochs, and is compared with the largest size that
             trains two epochs, by bisection (each fit its own process). Writes
             gpu_keras_torch_advice.json.
  --advice-check  the advice at 128 under ADVICE_BUDGET and its suggestion trained in two
             fresh processes, then the oom scenario; no bisection (the limit of an earlier
             one). Writes gpu_keras_torch_advice_check.json.
  --oom-only the oom scenario alone under ADVICE_BUDGET bytes, find_batch_size's steps
             (after the OOM, and in a fresh process: find) kept to replay offline, each
             short run it made with the pool's state before it. Writes
             gpu_keras_torch_oom.json, find_steps_after_oom.json, find_traces.json.
  --peaks B1,B2,...  one epoch at each size in a fresh process under ADVICE_BUDGET: every
             step's peak and what was in use as it began (an epoch against the second
             step a short run records). Writes gpu_keras_torch_peaks.json.
  --leak     what the pool and Python hold after an OOM, the suggestion's short runs, a
             retry and a plain fit(), against a fresh short fit() (with the advice and
             without). Writes gpu_keras_torch_leak.json.

Usage (from the repository root, after `python3 setup.py build_ext --inplace` with
PyTorch present): python3 benchmarks/gpu/keras_torch.py --out DIR
Writes DIR/gpu_keras_torch.json (then benchmarks/results/gpu_keras_torch.json).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZE, SAMPLES, BATCH, EPOCHS, CLASSES = 64, 20480, 256, 3, 4

NAIVE_SRC = r"""
// A naive budget allocator for PyTorch's pluggable interface: cuMemAlloc per tensor,
// NULL when the budget would be passed (what the issue's first attempt did).
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/types.h>
#include <map>
#include <mutex>
typedef int (*alloc_t)(unsigned long long*, size_t);
typedef int (*free_t)(unsigned long long);
static alloc_t mem_alloc; static free_t mem_free;
static std::mutex mu; static std::map<void*, size_t> sizes; static size_t used = 0;
static size_t budget() { static size_t b = strtoull(getenv("NAIVE_BUDGET"), 0, 10); return b; }
static void load() {
  if (mem_alloc) return;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  mem_alloc = (alloc_t)dlsym(h, "cuMemAlloc_v2"); mem_free = (free_t)dlsym(h, "cuMemFree_v2");
}
extern "C" void* naive_malloc(ssize_t size, int device, void* stream) {
  std::lock_guard<std::mutex> l(mu); load();
  if (used + size > budget()) return nullptr;
  unsigned long long p = 0;
  if (mem_alloc(&p, size ? size : 1) != 0) return nullptr;
  sizes[(void*)p] = size; used += size; return (void*)p;
}
extern "C" void naive_free(void* p, ssize_t size, int device, void* stream) {
  std::lock_guard<std::mutex> l(mu); load();
  auto it = sizes.find(p); if (it == sizes.end()) return;
  used -= it->second; sizes.erase(it); mem_free((unsigned long long)p);
}
"""


# ----------------------------------------------------------------------------- child


def _data():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from _data import pattern_images
    return pattern_images(SAMPLES, size=SIZE, classes=CLASSES, seed=0)


def _model():
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((SIZE, SIZE, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _epoch_timer(probe=None):
    import keras
    import torch

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []
            self.probes = []  # probe() at each epoch's end (tf_memguard: the pool's describe())

        def on_epoch_begin(self, epoch, logs=None):
            torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._t)
            if probe is not None:
                self.probes.append(probe())

    return EpochTimes()


def _weights(model):
    return [v.numpy().copy() for v in model.weights]


def _cublas_after_refusal(out, budget):
    """Fills the budget but for 8 MiB, multiplies two 1024x1024 matrices (their 4 MiB
    output fits, cuBLAS's workspace does not), frees the filler and multiplies again."""
    import torch
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    ref = (a.double().cpu() @ b.double().cpu())
    used = 3 * (4 << 20)  # a, b, and room for the output
    fill = torch.empty(budget - used - (4 << 20), dtype=torch.uint8, device="cuda")
    for attempt in ("first", "after_freeing"):
        try:
            c = a @ b
            torch.cuda.synchronize()
            err = float(((c.double().cpu() - ref).norm() / ref.norm()).item())
            out[attempt] = {"ok": err < 1e-2, "relative_error": err}
        except Exception as e:  # noqa: BLE001 - the point is which error
            out[attempt] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        del fill
        fill = None
        import gc
        gc.collect()
    return out


def _dump_trace(path):
    """The pool's trace (allocations and frees, sizes, offsets) as arrays, for offline
    study of placement (benchmarks/keras_trace.py)."""
    import numpy as np
    import tf_memguard
    t = tf_memguard.device_pool("cuda:0").trace()
    ev = t["events"]
    ops = {"alloc": 0, "free": 1, "refuse": 2, "overshoot": 3}
    np.savez_compressed(path, op=np.array([ops.get(e["op"], 9) for e in ev], dtype=np.uint8),
                        size=np.array([e["size"] for e in ev], dtype=np.uint64),
                        address=np.array([e["address"] for e in ev], dtype=np.uint64),
                        dropped=np.array([t["dropped"]], dtype=np.uint64))
    return len(ev)


def _advice_fit(out, budget):
    """fit() at ADVICE_BATCH for ADVICE_EPOCHS epochs under the budget, with
    MemGuardCallback's defaults: whether it trained, and the advice it measured."""
    import tf_memguard
    tf_memguard.install(max_bytes=budget, device="cuda:0")
    import torch
    x, y = _data()
    model = _model()
    batch, epochs = int(os.environ["ADVICE_BATCH"]), int(os.environ.get("ADVICE_EPOCHS", "1"))
    guard = tf_memguard.MemGuardCallback(verbose=0)
    out.update(batch_size=batch, epochs=epochs, budget_bytes=budget)
    try:
        hist = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[guard])
        out["fits"] = True
        out["epoch_peaks_mib"] = hist.history["memguard_peak_mib"]
    except torch.OutOfMemoryError as e:
        out["fits"] = False
        out["error"] = str(e)[:600]
    rep = tf_memguard.report()
    out["suggested"] = rep.suggested_batch_size if rep else None
    out["method"] = rep.suggestion_method if rep else None
    out["peak_reserved"] = tf_memguard.stats("cuda:0")["peak_bytes_reserved"]
    if rep and os.environ.get("REPORT_OUT"):
        rep.to_json(os.environ["REPORT_OUT"])   # the memory model, to replay offline
    return out


def _advice(budget):
    """The advice after two epochs at 128 under `budget`, checked against fit() itself."""
    first = run_child("advice", budget, ADVICE_BATCH="128", ADVICE_EPOCHS="2",
                      REPORT_OUT=os.path.join(os.environ.get("OUT", "/tmp"), "advice_report.json"))
    size = first.get("suggested")
    result = {"budget_bytes": budget, "advised_run": first, "suggested": size}
    if not size:
        return result

    def trains(b):
        r = run_child("advice", budget, ADVICE_BATCH=str(b), ADVICE_EPOCHS="2")
        result.setdefault("fits_by_size", []).append([b, r.get("fits")])
        return bool(r.get("fits"))

    result["suggested_trains"] = trains(size)
    lo, hi = (size, 4 * size) if result["suggested_trains"] else (1, size)
    while hi - lo > max(1, lo // 33):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trains(mid) else (lo, mid)
    result["largest_that_trains"] = lo
    result["ratio"] = size / lo if lo else None
    return result


def _find_traces(out, budget):
    """find_batch_size's two recorded steps, kept (TRACES_OUT) to replay offline: the steps
    at 32 and at the first model's answer, and each model's answer."""
    import tf_memguard
    from tf_memguard._memory_model import StepModel
    from tf_memguard._recording import Snapshot, StepRecorder, fit_steps
    tf_memguard.install(max_bytes=budget, device="cuda:0")
    x, y = _data()
    model = _model()
    pool = tf_memguard.device_pool("cuda:0")
    snap, rec = Snapshot(model), StepRecorder(pool)
    first = fit_steps(model, x, y, 32, rec)
    snap.restore()
    m1 = StepModel.build(first, None)
    s1 = m1.largest_fitting(budget, at_most=len(x))
    second = fit_steps(model, x, y, s1, rec)
    snap.restore()
    out.update(budget_bytes=budget, first_size=32, first_complete=first.complete, one_size_answer=s1,
               second_complete=second is not None and second.complete)
    if second is not None:
        m2 = StepModel.build(second, first) if second.complete else StepModel.build(first, second)
        out["two_size_answer"] = m2.largest_fitting(budget, at_most=len(x))
    with open(os.environ["TRACES_OUT"], "w") as f:
        json.dump({"budget": budget, "first": first.to_dict(), "second": second.to_dict() if second else None}, f)
    return out


def _log_find_steps(out):
    """Each short run find_batch_size makes, into out["find_tried"]: its size, whether its
    recorded step completed (None: refused before it was recorded), the pool's bytes in
    use before it and the refusal after it (why find after an OOM answered 32)."""
    import tf_memguard
    from tf_memguard import _find
    real = _find.fit_steps
    out["find_tried"] = tried = []

    def logged(model, x, y, size, recorder, **kw):
        before = tf_memguard.stats("cuda:0")
        trace = real(model, x, y, size, recorder, **kw)
        tried.append({"size": size, "steps": kw.get("steps"), "complete": None if trace is None else trace.complete,
                      "in_use_before": before["bytes_in_use"], "reserved_before": before["bytes_reserved"],
                      "refusal": tf_memguard.last_refusal("cuda:0")})
        return trace
    _find.fit_steps = logged


def _step_peaks(out, budget):
    """One epoch at PEAK_BATCH in a fresh process: each step's peak (the pool's window
    peak) and what was in use as it began, and where it ran out, if it did (do a short
    run's steps and an epoch's peak alike on the GPU?)."""
    import keras
    import torch

    import tf_memguard
    tf_memguard.install(max_bytes=budget, device="cuda:0")
    b = int(os.environ["PEAK_BATCH"])
    x, y = _data()
    model = _model()
    peaks, begins = [], []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            begins.append(tf_memguard.stats("cuda:0")["bytes_in_use"])
            tf_memguard.reset_peak("cuda:0")

        def on_train_batch_end(self, batch, logs=None):
            peaks.append(tf_memguard.stats("cuda:0")["window_peak_bytes_in_use"])
    out["batch_size"] = b
    try:
        model.fit(x, y, batch_size=b, epochs=1, verbose=0, callbacks=[Peaks()])
        out["trained"] = True
    except torch.OutOfMemoryError as e:
        out["trained"], out["error"] = False, str(e)[:400]
    out["steps_run"], out["step_peaks_mib"] = len(peaks), [round(v / 2**20, 1) for v in peaks]
    out["begin_in_use_mib"] = sorted(set(round(v / 2**20, 1) for v in begins))
    return out


def _after_oom_leak(out, budget):
    """What stays in the pool after an out-of-memory error at BATCH and gc.collect(), that
    a fresh process does not hold after a short fit() of the same model: the pool's live
    blocks beside each other, and the CUDA tensors Python still holds, with their holders."""
    import gc
    import collections

    import keras
    import torch

    import tf_memguard
    tf_memguard.install(max_bytes=budget, device="cuda:0")
    pool = tf_memguard.device_pool("cuda:0")
    x, y = _data()
    model = _model()
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    gc.collect()
    before = collections.Counter(int(s) for s in pool.live_blocks()["size"])
    out["in_use_after_short_fit"] = tf_memguard.stats("cuda:0")["bytes_in_use"]
    guard = tf_memguard.MemGuardCallback(verbose=0, advice=os.environ.get("LEAK_ADVICE", "1") == "1")
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[guard])
    except torch.OutOfMemoryError as e:
        out["oom"] = str(e)[:200]
        del e
    gc.collect()
    after = collections.Counter(int(s) for s in pool.live_blocks()["size"])
    out["in_use_after_oom"] = tf_memguard.stats("cuda:0")["bytes_in_use"]
    out["blocks_added"] = sorted((after - before).items())
    out["blocks_gone"] = sorted((before - after).items())
    held = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda and o.untyped_storage().nbytes() >= 1 << 20:
                refs = [type(r).__name__ for r in gc.get_referrers(o)][:6]
                held.append({"shape": list(o.shape), "bytes": o.untyped_storage().nbytes(), "referrers": refs})
        except Exception:  # noqa: BLE001 - a diagnostic over every object
            pass
    out["cuda_tensors_held"] = sorted(held, key=lambda h: -h["bytes"])[:40]

    def added_since(what):
        gc.collect()
        now = collections.Counter(int(s) for s in pool.live_blocks()["size"])
        out["in_use_after_" + what] = tf_memguard.stats("cuda:0")["bytes_in_use"]
        out["blocks_added_after_" + what] = sorted((now - before).items())
    rep = tf_memguard.report()
    size = rep.suggested_batch_size if rep else 0
    out["suggested"] = size
    added_since("suggestion")
    if size:
        try:
            model.fit(x, y, batch_size=size, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            out["retry_ok"] = True
        except torch.OutOfMemoryError:
            out["retry_ok"] = False
        added_since("retry")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, steps_per_epoch=2)
        added_since("plain_fit")
    return out


def _find_fresh(out, budget):
    """find_batch_size in a fresh process (no OOM before it), its steps, and whether one
    epoch at its answer trains."""
    import torch

    import tf_memguard
    from tf_memguard import _find
    tf_memguard.install(max_bytes=budget, device="cuda:0")
    if os.environ.get("FIND_FIRST_STEPS"):  # --find-only: one step or two at the first size
        _find.FIRST_STEPS = int(os.environ["FIND_FIRST_STEPS"])
    out["first_steps"] = _find.FIRST_STEPS
    x, y = _data()
    model = _model()
    _log_find_steps(out)
    t = time.perf_counter()
    out["find_batch_size"] = tf_memguard.find_batch_size(model, x, y)
    out["find_batch_size_seconds"] = time.perf_counter() - t
    out["find_steps"] = [[s.batch_size, s.complete] if s is not None else None for s in _find.last_steps]
    try:
        model.fit(x, y, batch_size=out["find_batch_size"], epochs=1, verbose=0)
        out["find_batch_size_fit_ok"] = True
    except torch.OutOfMemoryError as e:
        out["find_batch_size_fit_ok"] = False
        out["find_batch_size_error"] = str(e)[:600]
    return out


def child(mode, budget):
    import gc
    out = {"mode": mode}
    if mode in ("cublas_naive", "cublas_memguard"):
        budget = 256 << 20
    if mode == "memguard_trim":  # memguard, with TF_MEMGUARD_TRIM_ABOVE_PEAK set by the parent
        mode = "memguard"
        out["trim_above_peak"] = float(os.environ.get("TF_MEMGUARD_TRIM_ABOVE_PEAK", "0"))
    if mode == "advice":
        return _advice_fit(out, budget)
    if mode == "traces":
        return _find_traces(out, budget)
    if mode == "find":
        return _find_fresh(out, budget)
    if mode == "leak":
        return _after_oom_leak(out, budget)
    if mode == "peaks":
        return _step_peaks(out, budget)
    if mode in ("memguard", "oom", "torch_only", "cublas_memguard"):
        import tf_memguard
        b = {"memguard": 0.5, "oom": budget, "torch_only": 1 << 30, "cublas_memguard": budget}[mode]
        cfg = tf_memguard.install(max_bytes=b, device="cuda:0")
        out["budget_bytes"] = cfg.max_bytes
    if mode in ("naive", "cublas_naive"):
        import torch
        so = "/tmp/naive_alloc.so"
        subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-x", "c++", "-", "-o", so, "-ldl"], input=NAIVE_SRC,
                       text=True, check=True)
        os.environ["NAIVE_BUDGET"] = str(budget)
        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(so, "naive_malloc", "naive_free"))
        out["budget_bytes"] = budget
    import torch
    if mode.startswith("cublas"):
        return _cublas_after_refusal(out, budget)
    if mode == "torch_only":
        import tf_memguard
        try:
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            out["refused"] = False
        except torch.OutOfMemoryError as e:
            out["refused"], out["error"] = True, str(e)[:600]
        a = torch.randn(2048, 2048, device="cuda")
        out["matmul_after"] = float((a @ a).abs().sum().item()) > 0
        out["stats"] = {k: tf_memguard.stats("cuda:0")[k] for k in
                        ("bytes_in_use", "bytes_reserved", "num_refusals", "bytes_limit")}
        return out

    import keras
    x, y = _data()
    model = _model()
    probe = None
    if mode == "memguard":
        import tf_memguard
        probe = tf_memguard.device_pool("cuda:0").describe
    timer = _epoch_timer(probe)
    callbacks = [timer]
    if mode in ("memguard", "oom"):
        import tf_memguard
        # The timed runs measure the allocator in a plain training run: no advice (its
        # recorded steps and short fit() of its own) in them; the OOM run keeps the defaults.
        guard = tf_memguard.MemGuardCallback(verbose=0, advice=mode != "memguard")
        callbacks.append(guard)
    if mode in ("caching", "memguard"):
        hist = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks)
        out["epoch_seconds"] = timer.seconds
        out["accuracy"] = float(hist.history["accuracy"][-1])
        if mode == "caching":
            out["peak_reserved"] = torch.cuda.max_memory_reserved()
            out["peak_live"] = torch.cuda.max_memory_allocated()
        else:
            s = tf_memguard.stats("cuda:0")
            out["peak_reserved"] = s["peak_bytes_reserved"]
            out["peak_live"] = s["peak_bytes_in_use"]
            out["num_reclaims"] = s["num_reclaims"]
            out["bytes_reclaimed"] = s["bytes_reclaimed"]
            out["backing"] = tf_memguard.device_pool("cuda:0").describe()
            out["backing_per_epoch"] = timer.probes
            out["history_keys"] = sorted(k for k in hist.history if k.startswith("memguard"))
            out["epoch_peaks_mib"] = hist.history["memguard_peak_mib"]
            out["report"] = str(tf_memguard.report())
            if os.environ.get("TRACE_OUT"):
                out["trace_events"] = _dump_trace(os.environ["TRACE_OUT"])
        return out

    # oom / naive: a step over the budget, then what still works in this process.
    before = _weights(model)
    import warnings
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - what the failure is, is the point here
        out["raised"] = type(e).__module__ + "." + type(e).__name__
        out["is_torch_oom"] = isinstance(e, torch.OutOfMemoryError)
        out["message"] = str(e)[:1500]
        out["notes"] = [n[:1500] for n in getattr(e, "__notes__", [])]
        del e
    caught.__exit__(None, None, None)
    out["warnings"] = [str(w.message)[:500] for w in seen]
    if mode == "oom":
        smp = getattr(callbacks[-1], "_sampler", None)
        out["sampler"] = None if smp is None else {
            "prefix": smp.prefix is not None, "nested_runs": smp._nested_runs, "too_large": smp.too_large,
            "template": smp.template is not None, "first": smp.first is not None}
    gc.collect()
    try:
        a = torch.randn(2048, 2048, device="cuda")
        out["matmul_after"] = float((a @ a).abs().sum().item()) > 0
        torch.cuda.synchronize()
        # (Freed: kept, its 16 MiB sat beside every later step, the advice's short runs,
        # the retry and find_batch_size's, which a user's process would not hold.)
        del a
    except Exception as e:  # noqa: BLE001
        out["matmul_after"] = False
        out["matmul_error"] = str(e)[:600]
        return out
    import numpy as np
    out["weights_unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))
    if mode == "naive":
        return out
    rep = tf_memguard.report()
    t = time.perf_counter()
    out["suggested"] = rep.suggested_batch_size if rep else None   # worked out now (after the except block)
    out["suggestion_seconds"] = time.perf_counter() - t
    out["suggestion_method"] = rep.suggestion_method if rep else None
    smp = getattr(callbacks[-1], "_sampler", None)
    if smp is not None:
        out["after_oom_completed"] = list(smp.after_oom)
        out["after_oom_too_large"] = smp.too_large
    if out["suggested"]:
        try:
            hist = model.fit(x, y, batch_size=out["suggested"], epochs=1, verbose=0,
                             callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            out["retry_ok"] = True
            out["retry_peak_fraction"] = float(hist.history["memguard_budget_fraction"][-1])
        except torch.OutOfMemoryError as e:
            out["retry_ok"] = False
            out["retry_error"] = str(e)[:600]
    gc.collect()
    _log_find_steps(out)
    t = time.perf_counter()
    size = tf_memguard.find_batch_size(model, x, y)
    out["find_batch_size"] = size
    out["find_batch_size_seconds"] = time.perf_counter() - t
    from tf_memguard import _find
    out["find_steps"] = [[t.batch_size, t.complete] if t is not None else None for t in _find.last_steps]
    if os.environ.get("FIND_STEPS_OUT"):
        with open(os.environ["FIND_STEPS_OUT"], "w") as f:
            json.dump([t.to_dict() if t is not None else None for t in _find.last_steps], f)
    try:
        model.fit(x, y, batch_size=size, epochs=1, verbose=0)
        out["find_batch_size_fit_ok"] = True
    except torch.OutOfMemoryError as e:
        out["find_batch_size_fit_ok"] = False
        out["find_batch_size_error"] = str(e)[:600]
    out["last_refusal"] = tf_memguard.last_refusal("cuda:0")
    s = tf_memguard.stats("cuda:0")
    out["refusals"] = s["num_refusals"]
    out["peak_reserved"] = s["peak_bytes_reserved"]
    return out


# ----------------------------------------------------------------------------- parent


def run_child(mode, budget=0, timeout=900, **extra_env):
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]), **extra_env)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--budget", str(budget)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"mode": mode}
    result["returncode"] = proc.returncode
    result["wall_seconds"] = time.perf_counter() - t
    if proc.returncode != 0 or not lines:
        result["stderr_tail"] = proc.stderr[-3000:]
    print(f"  {mode}: rc={proc.returncode} in {result['wall_seconds']:.0f} s", flush=True)
    return result


def write_result(out, name, result):
    """`result` as JSON to out/name (the folder made if needed)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timing-only", action="store_true",
                    help="only the timed rounds (caching, memguard, memguard_trim): no traced, oom, naive, "
                         "torch_only or cublas runs; writes gpu_keras_torch_timing.json")
    ap.add_argument("--oom-only", action="store_true",
                    help="only the out-of-memory scenario and find_batch_size's steps under ADVICE_BUDGET bytes; "
                         "writes gpu_keras_torch_oom.json and find_traces.json")
    ap.add_argument("--leak", action="store_true",
                    help="what stays in the pool after an out-of-memory error (with and without the advice); "
                         "writes gpu_keras_torch_leak.json")
    ap.add_argument("--peaks", default=None,
                    help="comma-separated batch sizes: one epoch at each in a fresh process under ADVICE_BUDGET, "
                         "its steps' peaks; writes gpu_keras_torch_peaks.json")
    ap.add_argument("--advice-only", action="store_true",
                    help="only the advice check (one memguard run for the budget, then fits at batch sizes "
                         "around the suggestion); writes gpu_keras_torch_advice.json")
    ap.add_argument("--advice-check", action="store_true",
                    help="the advice at 128 under ADVICE_BUDGET bytes, its suggestion trained two epochs in 2 fresh "
                         "processes, and the oom scenario: no bisection (the limit of an earlier one); writes "
                         "gpu_keras_torch_advice_check.json")
    ap.add_argument("--find-only", type=int, default=0, metavar="N",
                    help="find_batch_size in 2 N fresh processes under ADVICE_BUDGET, alternately with one step and "
                         "two at its first size (_find.FIRST_STEPS), each answer trained one epoch; writes "
                         "gpu_keras_torch_find.json")
    ap.add_argument("--trim", default="0",
                    help="TF_MEMGUARD_TRIM_ABOVE_PEAK of the third allocator of each round (default 0: tf_memguard "
                         "with no trim line; 'none': no such runs)")
    args = ap.parse_args()
    args.trim = None if args.trim == "none" else float(args.trim)
    if args.child:
        print(json.dumps(child(args.child, args.budget)), flush=True)
        return

    if args.leak:
        budget = int(os.environ["ADVICE_BUDGET"])
        result = {"with_advice": run_child("leak", budget, LEAK_ADVICE="1"),
                  "without_advice": run_child("leak", budget, LEAK_ADVICE="0"),
                  "command": "ADVICE_BUDGET=%d bash benchmarks/gpu/run_keras_torch.sh --leak" % budget}
        write_result(args.out, "gpu_keras_torch_leak.json", result)
        for k in ("with_advice", "without_advice"):
            r = result[k]
            print(k, {n: v for n, v in r.items() if n.startswith(("in_use", "blocks", "suggested", "retry"))}, json.dumps(r.get("cuda_tensors_held"))[:1500],
                  r.get("stderr_tail", "")[-800:])
        return

    if args.peaks:
        budget = int(os.environ["ADVICE_BUDGET"])
        result = {"runs": [run_child("peaks", budget, PEAK_BATCH=v) for v in args.peaks.split(",")],
                  "command": "ADVICE_BUDGET=%d bash benchmarks/gpu/run_keras_torch.sh --peaks %s" % (budget, args.peaks)}
        write_result(args.out, "gpu_keras_torch_peaks.json", result)
        for r in result["runs"]:
            p = r.get("step_peaks_mib") or [0]
            print(r.get("batch_size"), "trained", r.get("trained"), "steps", r.get("steps_run"), "first 3", p[:3],
                  "max", max(p), "at step", p.index(max(p)), "begin MiB", r.get("begin_in_use_mib"), r.get("error", ""))
        return

    if args.advice_check:
        budget = int(os.environ["ADVICE_BUDGET"])
        first = run_child("advice", budget, ADVICE_BATCH="128", ADVICE_EPOCHS="2")
        size = first.get("suggested")
        trained = [run_child("advice", budget, ADVICE_BATCH=str(size), ADVICE_EPOCHS="2").get("fits")
                   for _ in range(2)] if size else []
        result = {"budget_bytes": budget, "advised_run": first, "suggested": size, "suggested_trained": trained,
                  "oom": run_child("oom", budget),
                  "command": "ADVICE_BUDGET=%d bash benchmarks/gpu/run_keras_torch.sh --advice-check" % budget}
        write_result(args.out, "gpu_keras_torch_advice_check.json", result)
        o = result["oom"]
        print(json.dumps({"suggested": size, "trained": trained, "method": first.get("method"),
                          "after_oom": o.get("suggested"), "retry_ok": o.get("retry_ok"),
                          "after_oom_method": o.get("suggestion_method"), "find": o.get("find_batch_size"),
                          "find_ok": o.get("find_batch_size_fit_ok")}))
        return

    if args.find_only:
        budget = int(os.environ["ADVICE_BUDGET"])
        runs = [run_child("find", budget, FIND_FIRST_STEPS=str(k))
                for _ in range(args.find_only) for k in (1, 2)]
        result = {"runs": [{k: r.get(k) for k in ("first_steps", "find_batch_size", "find_steps",
                                                  "find_batch_size_seconds", "find_batch_size_fit_ok",
                                                  "find_batch_size_error", "returncode", "stderr_tail")}
                           for r in runs],
                  "budget_bytes": budget,
                  "command": "ADVICE_BUDGET=%d bash benchmarks/gpu/run_keras_torch.sh --find-only %d"
                             % (budget, args.find_only)}
        write_result(args.out, "gpu_keras_torch_find.json", result)
        for r in result["runs"]:
            print(r["first_steps"], r["find_batch_size"], r["find_steps"], r["find_batch_size_fit_ok"],
                  (r.get("stderr_tail") or "")[-400:])
        return

    if args.oom_only:
        # The out-of-memory error, its retry and find_batch_size under the budget of the
        # advice run (ADVICE_BUDGET), and find_batch_size's steps kept to replay offline.
        budget = int(os.environ["ADVICE_BUDGET"])
        result = {"oom": run_child("oom", budget, FIND_STEPS_OUT=os.path.join(args.out, "find_steps_after_oom.json")),
                  "traces": run_child("traces", budget, TRACES_OUT=os.path.join(args.out, "find_traces.json")),
                  "find_fresh": run_child("find", budget),
                  "command": "ADVICE_BUDGET=%d bash benchmarks/gpu/run_keras_torch.sh --oom-only" % budget}
        write_result(args.out, "gpu_keras_torch_oom.json", result)
        o = result["oom"]
        print(json.dumps({k: o.get(k) for k in ("suggested", "suggestion_method", "retry_ok", "find_batch_size",
                                                "find_batch_size_fit_ok")}), json.dumps(result["traces"]),
              json.dumps(result["find_fresh"]))
        return

    if args.advice_only:
        live = run_child("memguard").get("peak_live", 0)
        result = _advice(int(0.8 * live)) if live else {"skipped": "no memguard peak"}
        # The out-of-memory error at batch 256 under the same budget: its note, the retry at
        # its suggestion in the same process, find_batch_size.
        result["oom"] = run_child("oom", int(0.8 * live)) if live else None
        result["command"] = "bash benchmarks/gpu/run_keras_torch.sh --advice-only"
        write_result(args.out, "gpu_keras_torch_advice.json", result)
        print(json.dumps({k: result.get(k) for k in ("budget_bytes", "suggested", "suggested_trains",
                                                     "largest_that_trains", "ratio", "fits_by_size")}))
        return

    runs = {"caching": [], "memguard": [], "memguard_trim": []}
    for _ in range(args.rounds):
        runs["caching"].append(run_child("caching"))
        runs["memguard"].append(run_child("memguard"))
        if args.trim is not None:
            runs["memguard_trim"].append(run_child("memguard_trim", TF_MEMGUARD_TRIM_ABOVE_PEAK=str(args.trim)))
    # One more run under tf_memguard with the pool's trace on (not timed: the trace costs).
    skipped = {"skipped": "--timing-only"}
    traced = skipped if args.timing_only else run_child("memguard", TF_MEMGUARD_TRACE_CAPACITY=str(4 << 20),
                       TRACE_OUT=os.path.join(args.out, "keras_torch_trace.npz"))

    def steady(mode):
        return statistics.median(s for r in runs[mode] for s in r.get("epoch_seconds", [])[1:]) \
            if all(r.get("epoch_seconds") for r in runs[mode]) else None

    def ratio(mode):
        r = [x["peak_reserved"] / x["peak_live"] for x in runs[mode] if x.get("peak_live")]
        return max(r) if r else None

    t_cache, t_guard, t_trim = steady("caching"), steady("memguard"), steady("memguard_trim")
    # The spread: each round's ratio (memguard over the caching run just before it).
    def rounds(mode):
        return [statistics.median(g["epoch_seconds"][1:]) / statistics.median(c["epoch_seconds"][1:])
                for c, g in zip(runs["caching"], runs[mode]) if c.get("epoch_seconds") and g.get("epoch_seconds")]
    per_round = rounds("memguard")
    live = max((r.get("peak_live", 0) for r in runs["memguard"]), default=0)
    budget = int(0.8 * live)
    if args.timing_only:
        oom = naive = torch_only = skipped
        cublas = {}
    else:
        oom = run_child("oom", budget) if live else {"mode": "oom", "skipped": "no memguard peak"}
        naive = run_child("naive", budget, timeout=300) if live else {"mode": "naive", "skipped": "no memguard peak"}
        torch_only = run_child("torch_only")
        cublas = {m: run_child(m, timeout=300) for m in ("cublas_naive", "cublas_memguard")}
    retry_ok = bool(oom.get("is_torch_oom") and oom.get("notes") and oom.get("matmul_after")
                    and oom.get("weights_unchanged") and oom.get("retry_ok"))
    result = {
        "command": "bash benchmarks/gpu/run_keras_torch.sh  (python3 benchmarks/gpu/keras_torch.py --out $OUT"
                   + (f" --timing-only --rounds {args.rounds}" if args.timing_only else "") + ")",
        "model": {"inputs": [SIZE, SIZE, 3], "samples": SAMPLES, "batch_size": BATCH, "epochs": EPOCHS,
                  "rounds": args.rounds},
        "epoch_time_ratio": (t_guard / t_cache) if t_cache and t_guard else None,
        "epoch_time_ratio_per_round": per_round,
        "epoch_seconds_median_caching": t_cache,
        "epoch_seconds_median_memguard": t_guard,
        "peak_reserved_over_peak_live": ratio("memguard"),
        "caching_peak_reserved_over_peak_live": ratio("caching"),
        "retry_after_oom_ok": None if args.timing_only else retry_ok,
        # The same runs with TF_MEMGUARD_TRIM_ABOVE_PEAK=--trim (0: the pool holds what
        # its layout needs, with no trim line).
        "with_trim": {
            "trim_above_peak": args.trim,
            "epoch_time_ratio": (t_trim / t_cache) if t_cache and t_trim else None,
            "epoch_time_ratio_per_round": rounds("memguard_trim"),
            "epoch_seconds_median": t_trim,
            "peak_reserved_over_peak_live": ratio("memguard_trim"),
            "num_reclaims": [r.get("num_reclaims") for r in runs["memguard_trim"]],
            "bytes_reclaimed": [r.get("bytes_reclaimed") for r in runs["memguard_trim"]],
        } if args.trim is not None else None,
        "oom_budget_bytes": budget,
        "runs": runs, "oom": oom, "naive": naive, "torch_only": torch_only, "cublas": cublas,
        "traced_run": {k: traced.get(k) for k in ("trace_events", "peak_reserved", "peak_live", "returncode")},
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_keras_torch_timing.json" if args.timing_only else "gpu_keras_torch.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)

    def fmt(v, spec=".3f"):
        return format(v, spec) if isinstance(v, (int, float)) else str(v)

    print(f"\nKeras {SIZE}x{SIZE}x3 CNN, {SAMPLES} samples, batch {BATCH}, {EPOCHS} epochs, torch backend")
    print("| allocator | epoch s (median, epochs 2-3) | peak reserved / peak live |")
    print("|---|---|---|")
    print(f"| PyTorch caching | {fmt(t_cache)} | {fmt(ratio('caching'))} |")
    print(f"| tf_memguard | {fmt(t_guard)} | {fmt(ratio('memguard'))} |")
    if args.trim is not None:
        print(f"| tf_memguard, trim_above_peak {args.trim} | {fmt(t_trim)} | {fmt(ratio('memguard_trim'))} |")
        print(f"with trim: epoch_time_ratio {fmt(result['with_trim']['epoch_time_ratio'])} (per round: "
              f"{', '.join(format(r, '.3f') for r in result['with_trim']['epoch_time_ratio_per_round'])}); "
              f"reclaims per run {result['with_trim']['num_reclaims']}")
    print("tf_memguard's backing:", runs["memguard"][-1].get("backing") if runs["memguard"] else None)
    print(f"epoch_time_ratio {fmt(result['epoch_time_ratio'])} (per round: "
          f"{', '.join(format(r, '.3f') for r in per_round)}); retry_after_oom_ok {retry_ok}; "
          f"OOM budget {budget} B; suggested {oom.get('suggested')}; find_batch_size {oom.get('find_batch_size')}")
    print(f"naive allocator: raised {naive.get('raised')}, matmul after: {naive.get('matmul_after')} "
          f"{naive.get('matmul_error', '')[:200]}")
    print(f"torch only: refused {torch_only.get('refused')}, matmul after {torch_only.get('matmul_after')}")
    for m, r in cublas.items():
        print(f"{m}: first {r.get('first')}; after freeing {r.get('after_freeing')}")
    print("wrote", path)


if __name__ == "__main__":
    main()
