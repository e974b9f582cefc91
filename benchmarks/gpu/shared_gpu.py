"""Three Keras-on-PyTorch trainings sharing one GPU, each in its own slice (the lent H200).

Three processes start at once, each with tf_memguard.install(max_bytes=SLICE,
device="cuda:0") and MemGuardCallback:

  a    the CNN at batch 128: fits its slice, trains EPOCHS epochs;
  b    the CNN at batch 256: fits, trains EPOCHS epochs;
  c    the CNN at batch 2048: does not fit; the OOM is explained (torch.OutOfMemoryError
       with tf_memguard's note), then, in the same process, after gc.collect(), fit()
       at report().suggested_batch_size trains EPOCHS epochs, while a and b go on.

Each process samples its pool (bytes reserved, at every step) and must never reserve more
than its slice. The parent samples nvidia-smi every 0.25 s (per process where the runtime
lists processes, and the device's total) for the GPU memory each holds, against its slice
plus the CUDA context, measured by a fourth process alone ("context": PyTorch, cuBLAS and
cuDNN initialized, a step of the CNN at batch 8 with PyTorch's caching allocator: what
nvidia-smi shows minus what PyTorch reserved). Then a and b run again, each alone: the
accuracy each reaches in the shared run is compared with its accuracy alone.

Usage (from the repository root, with the glue built): python3 benchmarks/gpu/shared_gpu.py --out DIR
Writes DIR/gpu_shared.json (then benchmarks/results/gpu_shared.json).
For a dry run on a machine without a GPU: TFMG_SHARED_DRY=1 (no install, CPU, few samples).
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRY = os.environ.get("TFMG_SHARED_DRY") == "1"
SIZE, CLASSES = 64, 4   # keras_torch.py's CNN
SAMPLES = 512 if DRY else 16384
EPOCHS = 2 if DRY else 4
SLICE = 2 << 30          # each process's budget: 2 GiB of the card
JOBS = {"a": 128, "b": 256, "c": 2048}
MIB = float(1 << 20)


# ----------------------------------------------------------------------------- child

def _model():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from keras_torch import _model as cnn   # the CNN of the Keras-on-PyTorch benchmark
    return cnn()


def _data():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from _data import pattern_images
    return pattern_images(SAMPLES, size=SIZE, classes=CLASSES, seed=0)


def _pool_sampler(out):
    """A callback that reads the pool's bytes reserved at every step's end."""
    import keras
    import tf_memguard

    class Sampler(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if DRY:
                return
            s = tf_memguard.stats("cuda:0")
            out["max_bytes_reserved"] = max(out.get("max_bytes_reserved", 0), s["bytes_reserved"])

        def on_epoch_end(self, epoch, logs=None):
            out.setdefault("epoch_ends", []).append(round(time.time(), 2))
    return Sampler()


def _fit(model, x, y, batch, out, key):
    import tf_memguard
    hist = model.fit(x, y, batch_size=batch, epochs=EPOCHS, verbose=0, validation_split=0.1,
                     callbacks=[tf_memguard.MemGuardCallback(verbose=0), _pool_sampler(out)])
    out[key] = {"batch_size": batch, "accuracy": [float(a) for a in hist.history["accuracy"]],
                "val_accuracy": [float(a) for a in hist.history["val_accuracy"]],
                "peak_mib": hist.history.get("memguard_peak_mib")}


def child(job, alone):
    import gc
    out = {"job": job, "alone": alone, "pid": os.getpid(), "start": round(time.time(), 2)}
    import tf_memguard
    if not DRY:
        out["budget_bytes"] = tf_memguard.install(max_bytes=SLICE, device="cuda:0").max_bytes
    import torch
    x, y = _data()
    model = _model()
    batch = JOBS[job]
    if job != "c":
        _fit(model, x, y, batch, out, "fit")
    else:
        try:
            _fit(model, x, y, batch, out, "fit")
            out["oom"] = None
        except torch.OutOfMemoryError as e:
            out["oom"] = {"time": round(time.time(), 2), "notes": [n[:1500] for n in getattr(e, "__notes__", [])]}
            del e
        gc.collect()
        rep = tf_memguard.report() if not DRY else None
        out["suggested"] = rep.suggested_batch_size if rep else None
        out["suggestion_method"] = rep.suggestion_method if rep else None
        out["retry_start"] = round(time.time(), 2)
        if out["suggested"]:
            try:
                _fit(model, x, y, out["suggested"], out, "retry")
            except torch.OutOfMemoryError as e:
                out["retry_error"] = str(e)[:800]
    if not DRY:
        s = tf_memguard.stats("cuda:0")
        out["peak_bytes_reserved"] = s["peak_bytes_reserved"]
        out["peak_bytes_in_use"] = s["peak_bytes_in_use"]
        out["num_refusals"] = s["num_refusals"]
    out["end"] = round(time.time(), 2)
    return out


def context_child():
    """What a process holds on the GPU beyond its allocator: nvidia-smi's figure for it
    minus what PyTorch's caching allocator reserved, after a step of the CNN."""
    out = {"job": "context", "pid": os.getpid()}
    if DRY:
        return out
    import torch
    x, y = _data()
    model = _model()
    model.fit(x[:64], y[:64], batch_size=8, epochs=1, verbose=0)
    torch.cuda.synchronize()
    out["torch_reserved"] = torch.cuda.memory_reserved()
    time.sleep(1.0)
    used = _smi_apps().get(os.getpid())
    out["smi_used_bytes"] = used
    total = _smi_total()
    out["device_used_bytes"] = total
    out["context_bytes"] = (used - out["torch_reserved"]) if used is not None else None
    return out


# ----------------------------------------------------------------------------- nvidia-smi

def _smi(args):
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _smi_apps():
    """{pid: bytes used} of the processes nvidia-smi lists (none where the runtime hides them)."""
    apps = {}
    for line in _smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]).splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[int(parts[0])] = int(parts[1]) << 20
    return apps


def _smi_total():
    text = _smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits"]).strip().splitlines()
    return int(text[0]) << 20 if text and text[0].strip().isdigit() else None


class SmiSampler(threading.Thread):
    def __init__(self, interval=0.25):
        super().__init__(daemon=True)
        self.interval, self.samples, self._halt = interval, [], threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.samples.append((round(time.time(), 2), _smi_apps(), _smi_total()))
            self._halt.wait(self.interval)

    def stop(self):
        self._halt.set()
        self.join()


# ----------------------------------------------------------------------------- parent

def start(job, alone=False):
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if DRY:
        env["CUDA_VISIBLE_DEVICES"] = ""
    args = [sys.executable, os.path.abspath(__file__), "--child", job] + (["--alone"] if alone else [])
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    result["returncode"] = proc.returncode
    if proc.returncode != 0 or not lines:
        result["stderr_tail"] = err[-3000:]
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu_out")
    ap.add_argument("--child", default=None)
    ap.add_argument("--alone", action="store_true")
    ap.add_argument("--timeout", type=float, default=400)
    args = ap.parse_args()
    if args.child == "context":
        print(json.dumps(context_child()))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.alone)))
        return 0

    t0 = time.time()
    context = collect(start("context"), args.timeout)
    print(f"context: {context}", flush=True)
    sampler = SmiSampler()
    sampler.start()
    procs = {job: start(job) for job in JOBS}
    results = {}
    threads = [threading.Thread(target=lambda j=j: results.__setitem__(j, collect(procs[j], args.timeout)))
               for j in JOBS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sampler.stop()
    alone = {job: collect(start(job, alone=True), args.timeout) for job in ("a", "b")}

    # GPU memory per process, by nvidia-smi, over the shared run.
    pids = {results[j].get("pid"): j for j in JOBS}
    smi_max = {j: 0 for j in JOBS}
    for _, apps, _ in sampler.samples:
        for pid, used in apps.items():
            if pid in pids:
                smi_max[pids[pid]] = max(smi_max[pids[pid]], used)
    device_max = max((t for _, _, t in sampler.samples if t is not None), default=None)
    ctx = context.get("context_bytes")
    rows, ok = [], True
    for j in JOBS:
        r = results[j]
        final = r.get("retry", r.get("fit")) or {}
        acc = final.get("val_accuracy", [None])[-1]
        acc_alone = (alone.get(j, {}).get("fit") or {}).get("val_accuracy", [None])[-1] if j in alone else None
        within_slice = r.get("max_bytes_reserved", 0) <= SLICE and r.get("peak_bytes_reserved", 0) <= SLICE
        within_smi = (smi_max[j] <= SLICE + ctx) if (smi_max[j] and ctx is not None) else None
        trained = acc is not None and r.get("returncode") == 0
        row = {"job": j, "batch_size": JOBS[j], "slice_bytes": SLICE, "returncode": r.get("returncode"),
               "peak_bytes_reserved": r.get("peak_bytes_reserved"), "max_bytes_reserved_sampled":
               r.get("max_bytes_reserved"), "within_slice": within_slice, "smi_max_bytes": smi_max[j] or None,
               "within_slice_plus_context": within_smi, "val_accuracy": acc, "val_accuracy_alone": acc_alone,
               "oom_explained": bool(r.get("oom") and any("tf_memguard" in n for n in r["oom"]["notes"])),
               "suggested": r.get("suggested"), "retry_trained": "retry" in r}
        if j == "c":
            others_end = min(results[k].get("end", 0) for k in ("a", "b"))
            row["retried_while_others_ran"] = bool(r.get("oom") and r["oom"]["time"] < others_end)
            ok &= row["oom_explained"] and row["retry_trained"]
        else:
            ok &= trained and acc_alone is not None and abs(acc - acc_alone) <= 0.02
        ok &= within_slice and within_smi is not False
        rows.append(row)
    result = {"command": "python3 benchmarks/gpu/shared_gpu.py", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "dry": DRY, "samples": SAMPLES, "epochs": EPOCHS, "slice_bytes": SLICE, "context": context,
              "device_max_used_bytes": device_max, "smi_samples": len(sampler.samples),
              "smi_lists_processes": any(apps for _, apps, _ in sampler.samples),
              "rows": rows, "all_ok": bool(ok), "children": results, "alone": alone,
              "wall_seconds": round(time.time() - t0, 1)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_shared.json"), "w") as f:
        json.dump(result, f, indent=2)

    def mib(v):
        return f"{v / MIB:,.0f}" if isinstance(v, (int, float)) and v else "-"
    print(f"\nthree processes on one GPU, slices of {mib(SLICE)} MiB; CUDA context {mib(ctx)} MiB")
    print(f"{'job':>4} {'batch':>6} {'pool peak MiB':>14} {'smi max MiB':>12} {'in slice':>9} {'val acc':>8} "
          f"{'alone':>6} {'OOM explained':>14} {'retry at':>9}")
    for r in rows:
        acc = f"{r['val_accuracy']:.3f}" if r["val_accuracy"] is not None else "-"
        alone_acc = f"{r['val_accuracy_alone']:.3f}" if r["val_accuracy_alone"] is not None else "-"
        print(f"{r['job']:>4} {r['batch_size']:>6} {mib(r['peak_bytes_reserved']):>14} {mib(r['smi_max_bytes']):>12} "
              f"{str(r['within_slice']):>9} {acc:>8} {alone_acc:>6} {str(r['oom_explained']):>14} "
              f"{str(r['suggested'] or '-'):>9}")
    print(f"device max used {mib(device_max)} MiB; nvidia-smi lists processes: {result['smi_lists_processes']}; "
          f"all ok: {ok}; {result['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
