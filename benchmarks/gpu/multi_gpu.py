"""One budget per GPU on a machine with two (nvidia-h200-x2; issue 18). Not yet run: that
kind has not been lent. Each job is its own process:

  jax_dp      Keras on JAX, keras.distribution.DataParallel over both GPUs,
              install(max_bytes=CAP, device="gpu:0") (XLA's fraction holds on every GPU of
              the process): MemGuardCallback's per-device peaks against each device's
              memory_stats() (bytes_limit, peak_bytes_in_use).
  torch_0, torch_1
              Keras on PyTorch, one process per GPU at once, each with its own budget
              (install(device="cuda:<i>"), torch.cuda.set_device(i)): the pool's peak
              reserved against its budget.
  torch_both  one process with a pool on each GPU (install() for cuda:0 and for cuda:1,
              different budgets): the CNN trains on cuda:1 while matmuls run on cuda:0;
              each pool's peak reserved against its budget.

Usage (from the repository root, the glue built, Keras as wheels on PYTHONPATH):
    python3 benchmarks/gpu/multi_gpu.py --out DIR
Writes DIR/gpu_multi.json (then benchmarks/results/gpu_multi.json).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
CAP = 4 << 30
TORCH_BUDGETS = {"torch_0": 2 << 30, "torch_1": 3 << 30}
BOTH_BUDGETS = {"cuda:0": 1 << 30, "cuda:1": 3 << 30}
SAMPLES, EPOCHS, BATCH = 8192, 2, 256


def _data():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from _data import pattern_images
    return pattern_images(SAMPLES, size=64, classes=4, seed=0)


def _cnn():
    sys.path.insert(0, HERE)
    from keras_torch import _model
    return _model()


def jax_dp():
    import tf_memguard
    tf_memguard.install(max_bytes=CAP, device="gpu:0")
    import jax
    import keras
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    x, y = _data()
    model = _cnn()
    cb = tf_memguard.MemGuardCallback(verbose=0)
    h = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[cb])
    r = cb.report
    stats = [d.memory_stats() or {} for d in jax.devices()]
    return {"devices": r.devices, "loss": h.history["loss"], "suggested": r.suggested_batch_size,
            "bytes_limit": [s.get("bytes_limit") for s in stats],
            "xla_peak": [s.get("peak_bytes_in_use") for s in stats], "report": str(r),
            "ok": bool(r.devices) and all(s.get("bytes_limit", CAP + 1) <= CAP + (4 << 20) for s in stats)}


def torch_one(index, budget):
    import tf_memguard
    tf_memguard.install(max_bytes=budget, device=f"cuda:{index}")
    import torch
    torch.cuda.set_device(index)
    x, y = _data()
    model = _cnn()
    h = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[tf_memguard.MemGuardCallback(
        device=f"cuda:{index}", verbose=0)])
    s = tf_memguard.stats(f"cuda:{index}")
    return {"gpu": index, "budget": budget, "peak_bytes_reserved": s["peak_bytes_reserved"],
            "peak_bytes_in_use": s["peak_bytes_in_use"], "accuracy": h.history["accuracy"][-1],
            "ok": s["peak_bytes_reserved"] <= budget}


def torch_both():
    import tf_memguard
    for device, budget in BOTH_BUDGETS.items():
        tf_memguard.install(max_bytes=budget, device=device)
    import threading

    import torch
    stop = threading.Event()

    def matmuls():  # work on cuda:0 beside the training on cuda:1
        a = torch.randn(4096, 4096, device="cuda:0")
        while not stop.is_set():
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(0)
    t = threading.Thread(target=matmuls)
    t.start()
    torch.cuda.set_device(1)
    x, y = _data()
    model = _cnn()
    h = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    stop.set()
    t.join()
    out = {"accuracy": h.history["accuracy"][-1], "pools": {}}
    for device, budget in BOTH_BUDGETS.items():
        s = tf_memguard.stats(device)
        out["pools"][device] = {"budget": budget, "peak_bytes_reserved": s["peak_bytes_reserved"],
                                "peak_bytes_in_use": s["peak_bytes_in_use"]}
    out["ok"] = all(p["peak_bytes_reserved"] <= p["budget"] for p in out["pools"].values())
    return out


def child(job):
    if job == "jax_dp":
        return jax_dp()
    if job in TORCH_BUDGETS:
        return torch_one(int(job[-1]), TORCH_BUDGETS[job])
    return torch_both()


def start(job):
    env = dict(os.environ, KERAS_BACKEND="jax" if job == "jax_dp" else "torch", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", job], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(proc, timeout=500):
    sys.path.insert(0, HERE)
    from shared_gpu import collect as collect_child   # the same JSON-last-line protocol
    return collect_child(proc, timeout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu_out")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child), default=str))
        return 0
    t0 = time.time()
    results = {"jax_dp": collect(start("jax_dp"))}
    procs = {job: start(job) for job in TORCH_BUDGETS}
    results.update({job: collect(p) for job, p in procs.items()})
    results["torch_both"] = collect(start("torch_both"))
    results["all_ok"] = all(r.get("ok") and r.get("returncode") == 0 for r in results.values() if isinstance(r, dict))
    results["wall_seconds"] = round(time.time() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_multi.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    for job, r in results.items():
        if isinstance(r, dict):
            print(job, {k: v for k, v in r.items() if k not in ("report", "stderr_tail")})
    return 0 if results["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
