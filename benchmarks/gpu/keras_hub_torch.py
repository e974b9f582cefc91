"""Models from keras_hub (not in this repository) under tf_memguard on Keras' torch backend.

A new user's check of the budget and the advice on models the project never tuned for:
keras_hub's Qwen3 backbone (grouped-query attention, RMSNorm, rotary embeddings; Keras on
PyTorch runs its attention through torch's scaled_dot_product_attention) with a language
model head, and its Swin Transformer backbone (windowed attention) with a classifier head,
each with random weights (no presets: the lent machines reach nothing outside).

For each model, every run its own process (PyTorch's allocator is chosen once per process):
  advice   two epochs at START with MemGuardCallback; its suggestion
  verify   two epochs at the suggestion, in two fresh processes
  limit    the largest size that trains two epochs in 2 of 2 fresh processes (bisection
           from LO, which trains, to HI, which does not)
  half     advice and verify again from half the limit (issue 14's reading)
  oom      two epochs at 1.6x the limit: the error, then in the same process after the
           except block a retry at report().suggested_batch_size
  find     find_batch_size(model, x, y) in a fresh process, and two epochs at its answer
(--diag MODEL SIZE: one process's pool state before fit(), after an OOM at SIZE and gc, and
after the report's answer and each of DIAG_SIZES trained in that process)
and each run's peak bytes reserved against the budget (the budget never passed).

Usage on the lent GPU (keras, keras_hub and their pure-Python dependencies as wheels in .whl):
  KERAS_BACKEND=torch python3 benchmarks/gpu/keras_hub_torch.py --out DIR [--models qwen3,swin]
      [--limits qwen3=111,swin=457]   (limits of an earlier bisection: no bisection)
Here, to try the flow on the CPU with TensorFlow's allocator:
  python benchmarks/gpu/keras_hub_torch.py --device cpu --models qwen3 --out /tmp/x
Writes DIR/gpu_keras_hub_torch.json (then benchmarks/results/gpu_keras_hub_torch.json).
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

# Each model: its budget and the sizes the search starts from, per device. The budgets
# are set so that the largest size that trains is about 100-300 samples.
MODELS = {
    "qwen3": {"cuda": dict(budget=4 << 30, start=64, lo=8, hi=1024),
              "cpu": dict(budget=384 << 20, start=48, lo=16, hi=160)},
    "swin": {"cuda": dict(budget=3 << 29, start=64, lo=8, hi=1024),
             "cpu": dict(budget=768 << 20, start=48, lo=16, hi=192)},
}
SAMPLES = 2048
EPOCHS = 2


def build(name):
    import keras
    import keras_hub
    keras.utils.set_random_seed(int(os.environ.get("SEED", 0)))
    if name == "qwen3":
        bb = keras_hub.models.Qwen3Backbone(vocabulary_size=8000, num_layers=4, num_query_heads=8,
                                            num_key_value_heads=2, hidden_dim=256, intermediate_dim=768,
                                            head_dim=32)
        model = keras.Model(bb.input, keras.layers.Dense(8000)(bb.output))
        model.compile(optimizer=keras.optimizers.AdamW(3e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        bb = keras_hub.models.SwinTransformerBackbone(image_shape=(64, 64, 3), patch_size=4, embed_dim=48,
                                                      depths=[2, 2, 2], num_heads=[3, 6, 12], window_size=4)
        pooled = keras.layers.GlobalAveragePooling1D()(bb.output) if len(bb.output.shape) == 3 \
            else keras.layers.GlobalAveragePooling2D()(bb.output)
        model = keras.Model(bb.input, keras.layers.Dense(10)(pooled))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def data(name):
    import numpy as np
    r = np.random.default_rng(0)
    if name == "qwen3":
        tok = r.integers(1, 8000, (SAMPLES, 129)).astype("int32")
        return {"token_ids": tok[:, :-1], "padding_mask": np.ones((SAMPLES, 128), "int32")}, tok[:, 1:]
    return r.random((SAMPLES, 64, 64, 3), dtype="float32"), r.integers(0, 10, SAMPLES)


def child(name, mode, size, budget, device):
    import tf_memguard
    if device == "cuda":
        tf_memguard.install(max_bytes=budget, device="cuda:0")
    else:
        tf_memguard.install(max_bytes=budget)
    model = build(name)
    x, y = data(name)
    out = {"model": name, "mode": mode, "batch": size}
    t0 = time.time()

    def fit(b, callbacks=()):
        model.fit(x, y, batch_size=b, epochs=EPOCHS, verbose=0, callbacks=list(callbacks))

    def trains(b, key="trained", error="error"):
        """Two epochs at b without the callback: whether they trained, into `out`."""
        try:
            fit(b)
            out[key] = True
        except Exception as e:  # noqa: BLE001 - the run's answer is whether it trained
            out[key] = False
            out[error] = f"{type(e).__name__}: {str(e)[:300]}"

    if mode == "train":
        trains(size)
    elif mode == "advice":
        try:
            fit(size, [tf_memguard.MemGuardCallback(verbose=0)])
        except Exception as e:  # noqa: BLE001 - the start was too large: the report still answers
            out["raised"] = f"{type(e).__name__}: {str(e)[:300]}"
        gc.collect()
        r = tf_memguard.report()
        out["suggested"] = r.suggested_batch_size
        out["method"] = r.suggestion_method[:400]
        if os.environ.get("REPORT_DIR"):  # for python -m tf_memguard what-if
            r.to_json(os.path.join(os.environ["REPORT_DIR"], f"{name}_advice_at_{size}.json"))
    elif mode == "oom":
        raised = None
        try:
            fit(size, [tf_memguard.MemGuardCallback(verbose=0)])
        except Exception as e:  # noqa: BLE001 - the run records which error came
            raised = f"{type(e).__name__}: {str(e)[:600]}"
        gc.collect()
        out["raised"] = raised
        if raised:
            r = tf_memguard.report()
            out["suggested"] = s = r.suggested_batch_size
            out["method"] = r.suggestion_method[:400]
            if s:
                trains(s, "retry_trained", "retry_error")
    elif mode == "oomdiag":
        # Why an answer after an OOM lies below the fresh process's limit: the pool's
        # state before fit(), after the failed fit() and gc, and sizes tried in this
        # process (DIAG_SIZES) after the report's answer.
        def snap():
            st = tf_memguard.stats()
            return {k: st[k] for k in ("bytes_in_use", "bytes_reserved", "largest_free_block_bytes",
                                       "blocks_in_use", "num_regions")}
        out["before_fit"] = snap()
        # Each short fit() the advice runs: whether its step completed, its peaks, and
        # what a model of it with room for the batches Keras' torch backend may hold
        # (as _after_oom's ran() asks) says of its own size; the traces pickled.
        import pickle
        from tf_memguard import _recording, _steps
        from tf_memguard._memory_model import StepModel
        real_short_fit, fits_log = _steps.StepSampler.short_fit, out.setdefault("short_fits", [])

        def logged(self, model_, b, *args, **kw):
            t = real_short_fit(self, model_, b, *args, **kw)
            row = {"size": b, "args": [str(v) for v in args], "kw": {k: str(v) for k, v in kw.items()},
                   "complete": None if t is None else bool(t.complete)}
            if t is not None:
                row.update(observed_peak=int(t.observed_peak), step_peaks=[int(v) for v in t.step_peaks])
                if t.complete:
                    m = StepModel.build(t, None, extra_start=_recording.stale_batches(x, y, t.batch_size, model))
                    rp = m.replay(t.batch_size, budget)
                    row["stale_model"] = {k: (int(v) if not isinstance(v, bool) else v) for k, v in rp.items()
                                          if isinstance(v, (int, bool, float))}
                    row["spread"] = int(m.spread(t.batch_size))
                if os.environ.get("REPORT_DIR"):
                    with open(os.path.join(os.environ["REPORT_DIR"], f"trace_{len(fits_log)}_{b}.pkl"), "wb") as f:
                        pickle.dump(t, f)
            fits_log.append(row)
            return t
        _steps.StepSampler.short_fit = logged
        try:
            fit(size, [tf_memguard.MemGuardCallback(verbose=0)])
        except Exception as e:  # noqa: BLE001 - the run records which error came
            out["raised"] = f"{type(e).__name__}: {str(e)[:300]}"
        gc.collect()
        out["after_oom_gc"] = snap()
        r = tf_memguard.report()
        out["suggested"] = s = r.suggested_batch_size
        out["method"] = r.suggestion_method[:1000]
        out["after_report"] = snap()
        if os.environ.get("REPORT_DIR"):
            r.to_json(os.path.join(os.environ["REPORT_DIR"], f"{name}_after_oom_at_{size}.json"))
        for b in [s] + [int(v) for v in os.environ.get("DIAG_SIZES", "").split(",") if v]:
            trains(b, f"trained_{b}", f"error_{b}")
            gc.collect()
            out[f"after_{b}"] = snap()
    elif mode == "find":
        out["find"] = tf_memguard.find_batch_size(model, x, y)
        trains(out["find"])
    st = tf_memguard.stats()
    out.update(s=round(time.time() - t0, 1), budget=budget, peak_reserved=st["peak_bytes_reserved"],
               peak_in_use=st["peak_bytes_in_use"], within_budget=st["peak_bytes_reserved"] <= budget)
    print("RESULT " + json.dumps(out), flush=True)


def run(name, mode, size, budget, device, seed=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, mode, str(size), str(budget),
           "--device", device]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))  # the package built in place
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, SEED=str(seed), PYTHONPATH=path))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            print(json.dumps(res)[:400], flush=True)
            return res
    tail = (p.stdout + p.stderr)[-1500:]
    print(f"{name} {mode} {size}: no result (rc {p.returncode}): {tail}", flush=True)
    return {"model": name, "mode": mode, "batch": size, "no_result": tail, "rc": p.returncode}


def trains_twice(name, size, budget, device, runs):
    for seed in (0, 1):
        r = run(name, "train", size, budget, device, seed)
        runs.append(r)
        if not r.get("trained"):
            return False
    return True


def one_model(name, device, known=None):
    cfg = MODELS[name][device]
    budget, runs = cfg["budget"], []
    adv = run(name, "advice", cfg["start"], budget, device)
    runs.append(adv)
    suggested = adv.get("suggested") or 0
    verified = [run(name, "train", suggested, budget, device, seed) for seed in (0, 1)] if suggested else []
    runs.extend(verified)
    if known:
        # The limit of an earlier bisection (--limits), checked on this card: it trains and
        # one more does not, each in one fresh process.
        at, above = run(name, "train", known, budget, device), run(name, "train", known + 1, budget, device)
        runs.extend([at, above])
        limit_check = {"limit_trained": at.get("trained"), "above_trained": above.get("trained")}
        return finish(name, device, cfg, budget, runs, known, suggested, verified, limit_check)
    # The limit: bisection, its first probe at the suggestion (which both verify runs trained).
    lo, hi = cfg["lo"], cfg["hi"]
    if verified and all(v.get("trained") for v in verified):
        lo = suggested
        # Up from the suggestion by half of it each time until a size fails.
        while True:
            probe = min(hi, lo + max(1, lo // 2))
            if probe >= hi or not trains_twice(name, probe, budget, device, runs):
                hi = probe if probe < hi else hi
                break
            lo = probe
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trains_twice(name, mid, budget, device, runs):
            lo = mid
        else:
            hi = mid
    return finish(name, device, cfg, budget, runs, lo, suggested, verified, None)


def finish(name, device, cfg, budget, runs, limit, suggested, verified, limit_check):
    # Issue 14's reading: the advice after two epochs at about half the limit, its answer
    # trained in two fresh processes.
    half = run(name, "advice", max(1, limit // 2), budget, device)
    half_s = half.get("suggested") or 0
    half_v = [run(name, "train", half_s, budget, device, seed) for seed in (0, 1)] if half_s else []
    runs.extend([half] + half_v)
    oom = run(name, "oom", int(limit * 1.6), budget, device)
    find = run(name, "find", 0, budget, device)
    runs.extend([oom, find])
    summary = {
        "budget": budget, "limit_2_of_2": limit,
        "advice_from": cfg["start"], "advice": suggested,
        "advice_trained_2_of_2": bool(verified) and all(v.get("trained") for v in verified),
        "advice_share": round(suggested / limit, 3) if limit else None,
        "half_from": max(1, limit // 2), "half_advice": half_s,
        "half_trained_2_of_2": bool(half_v) and all(v.get("trained") for v in half_v),
        "half_share": round(half_s / limit, 3) if limit else None,
        "oom_at": int(limit * 1.6), "after_oom": oom.get("suggested"), "retry_trained": oom.get("retry_trained"),
        "after_oom_share": round((oom.get("suggested") or 0) / limit, 3) if limit else None,
        "find": find.get("find"), "find_trained": find.get("trained"),
        "find_share": round((find.get("find") or 0) / limit, 3) if limit else None,
        "budget_passed_in_runs": sum(1 for r in runs if r.get("within_budget") is False),
        "runs_without_result": sum(1 for r in runs if "no_result" in r),
    }
    if limit_check is not None:
        summary["limit_from"] = "--limits (an earlier bisection)"
        summary.update(limit_check)
    print(name, json.dumps(summary), flush=True)
    return {"summary": summary, "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "MODE", "SIZE", "BUDGET"))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--models", default="qwen3,swin")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    ap.add_argument("--limits", default="",
                    help="MODEL=LIMIT,...: limits of an earlier bisection, each checked by one run at it and one "
                         "above it instead of bisecting again")
    ap.add_argument("--diag", nargs=2, metavar=("MODEL", "SIZE"),
                    help="one oomdiag run (the pool's state around an OOM at SIZE, then DIAG_SIZES tried)")
    a = ap.parse_args()
    if a.diag:
        name, size = a.diag
        print(json.dumps(run(name, "oomdiag", int(size), MODELS[name][a.device]["budget"], a.device)))
        return
    if a.child:
        name, mode, size, budget = a.child
        child(name, mode, int(size), int(budget), a.device)
        return
    os.makedirs(a.out, exist_ok=True)
    import keras  # noqa: F401 - the versions, for the record
    import keras_hub
    result = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": a.device,
              "backend": os.environ.get("KERAS_BACKEND", "tensorflow"), "keras": keras.__version__,
              "keras_hub": keras_hub.__version__, "samples": SAMPLES, "epochs": EPOCHS, "models": {}}
    if a.device == "cuda":
        import torch
        result["torch"] = torch.__version__
        result["gpu"] = torch.cuda.get_device_name(0)
    path = os.path.join(a.out, "gpu_keras_hub_torch.json")
    for name in a.models.split(","):
        known = dict(kv.split("=") for kv in a.limits.split(",") if kv)
        result["models"][name] = one_model(name, a.device, int(known[name]) if name in known else None)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
