"""Facts about XLA's GPU allocator that tf_memguard's JAX path rests on, re-checked on the H200.

Each question runs in its own process (XLA reads its allocator settings once, when the
backend starts). Prints one JSON line per question and writes them all to --out.

  cap        XLA_PYTHON_CLIENT_MEM_FRACTION = 2 GiB / the card's total (cuDeviceTotalMem),
             preallocation on and off: bytes_limit against the 2 GiB asked; the error a
             request over the cap raises; memory_stats() keys; whether a peak reset exists.
  predict    a Keras CNN and a small transformer on KERAS_BACKEND=jax: the train step
             lowered at batch B with ShapeDtypeStructs and compiled (autotuning off), its
             memory_analysis() against the peak that memory_stats() sees over real steps
             at B (one fresh process per B, so the peak since process start is the step's).
  oom        under a 1 GiB cap, fit() at a batch whose step cannot fit: the exception, the
             donated state after it (deleted or not), the variables' values, and a retry at
             a small batch with and without reattaching the state.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys

GIB = 1 << 30


def total_memory(device=0):
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), device) == 0
    total = ctypes.c_size_t()
    assert cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev) == 0
    return total.value


def q_cap(prealloc):
    total = total_memory()
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = repr(2 * GIB / total)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = prealloc
    import jax
    import jax.numpy as jnp
    d = jax.devices()[0]
    s0 = d.memory_stats()
    out = {"q": "cap", "prealloc": prealloc, "total": total, "asked": 2 * GIB,
           "fraction": 2 * GIB / total, "stats_keys": sorted(s0), "stats0": s0,
           "device_attrs": [a for a in dir(d) if "mem" in a or "peak" in a or "reset" in a]}
    a = jnp.ones((GIB // 4,), jnp.float32)  # 1 GiB
    a.block_until_ready()
    out["after_1gib"] = d.memory_stats()
    try:
        b = jnp.ones((GIB // 4 + (256 << 20),), jnp.float32)  # 2 GiB: over the cap
        b.block_until_ready()
        out["over"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is what is measured
        out["over"] = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:600]}"
    out["after_over"] = d.memory_stats()
    c = jnp.ones((GIB // 8,), jnp.float32) * 2
    out["after_small_ok"] = float(c[0])
    return out


def keras_model(kind):
    import keras
    from keras import layers
    if kind == "cnn":
        inp = keras.Input((64, 64, 3))
        x = inp
        for f in (32, 64, 128):
            x = layers.Conv2D(f, 3, padding="same", activation="relu")(x)
            x = layers.BatchNormalization()(x)
            x = layers.MaxPooling2D()(x)
        x = layers.GlobalAveragePooling2D()(x)
        out = layers.Dense(10)(x)
        shape = (64, 64, 3)
    else:
        inp = keras.Input((128,), dtype="int32")
        x = layers.Embedding(8000, 256)(inp)
        for _ in range(4):
            h = layers.MultiHeadAttention(4, 64)(x, x)
            x = layers.LayerNormalization()(x + h)
            h = layers.Dense(1024, activation="relu")(x)
            x = layers.LayerNormalization()(x + layers.Dense(256)(h))
        x = layers.GlobalAveragePooling1D()(x)
        out = layers.Dense(10)(x)
        shape = (128,)
    m = keras.Model(inp, out)
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m, shape


def data(kind, shape, n):
    import numpy as np
    rng = np.random.default_rng(0)
    if kind == "cnn":
        x = rng.random((n,) + shape, dtype=np.float32)
    else:
        x = rng.integers(0, 8000, (n,) + shape).astype("int32")
    return x, rng.integers(0, 10, (n,)).astype("int32")


def q_predict(kind, batch, cap):
    if cap:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = repr(cap / total_memory())
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    m, shape = keras_model(kind)
    x, y = data(kind, shape, batch * 4)
    d = jax.devices()[0]
    m.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # builds optimizer
    before = d.memory_stats() or {}
    state = m._get_jax_state(True, True, True, True, purge_model_variables=False)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    st = jax.tree_util.tree_map(spec, state)
    dat = (jax.ShapeDtypeStruct((batch,) + shape, x.dtype), jax.ShapeDtypeStruct((batch,), y.dtype))
    import time
    t = time.perf_counter()
    comp = jax.jit(m.train_step, donate_argnums=0).lower(st, dat).compile()
    t = time.perf_counter() - t
    ma = comp.memory_analysis()
    live = sum(a.nbytes for a in jax.live_arrays())
    m.fit(x, y, batch_size=batch, epochs=2, verbose=0)
    after = d.memory_stats() or {}
    return {"q": "predict", "kind": kind, "batch": batch, "cap": cap, "compile_s": t,
            "argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
            "temp": ma.temp_size_in_bytes, "alias": ma.alias_size_in_bytes,
            "generated_code": ma.generated_code_size_in_bytes,
            "predicted": ma.argument_size_in_bytes + ma.output_size_in_bytes
            + ma.temp_size_in_bytes - ma.alias_size_in_bytes,
            "live_arrays": live, "in_use_before": before.get("bytes_in_use"),
            "peak_before": before.get("peak_bytes_in_use"),
            "peak_after": after.get("peak_bytes_in_use"), "limit": after.get("bytes_limit")}


def q_oom():
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = repr(GIB / total_memory())
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import numpy as np
    m, shape = keras_model("cnn")
    x, y = data("cnn", shape, 8192)
    out = {"q": "oom"}
    m.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    w0 = np.array(m.trainable_variables[0].value)
    refs = [v.value for v in m.trainable_variables]

    class Keep:  # what a callback can hold: the state after each step
        pass
    try:
        m.fit(x, y, batch_size=4096, epochs=1, verbose=0)
        out["fit_4096"] = "trained"
    except Exception as e:  # noqa: BLE001
        out["fit_4096"] = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:800]}"
    out["values_none"] = sum(v._value is None for v in m.variables)
    out["variables"] = len(m.variables)
    out["refs_deleted"] = sum(r.is_deleted() for r in refs)
    js = getattr(m, "_jax_state", None)
    out["jax_state"] = None if js is None else {
        k: sum(a.is_deleted() for a in v) for k, v in js.items() if v}
    out["stats_after"] = jax.devices()[0].memory_stats()
    try:
        m.fit(x[:256], y[:256], batch_size=32, epochs=1, verbose=0)
        out["retry_plain"] = "trained"
    except Exception as e:  # noqa: BLE001
        out["retry_plain"] = f"{type(e).__name__}: {str(e)[:300]}"
        for v, r in zip(m.trainable_variables, refs):
            if v._value is None and not r.is_deleted():
                v._value = r
        for v in m.variables:
            if v._value is None:
                out.setdefault("still_none", []).append(v.path)
        try:
            if "still_none" not in out:
                m.fit(x[:256], y[:256], batch_size=32, epochs=1, verbose=0)
                out["retry_reattached"] = "trained"
        except Exception as e:  # noqa: BLE001
            out["retry_reattached"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["w_unchanged_before_retry"] = bool(np.array_equal(w0, np.array(refs[0]))) if not refs[0].is_deleted() else "deleted"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", nargs="*")
    a = ap.parse_args()
    if a.one:
        q = a.one[0]
        if q == "cap":
            r = q_cap(a.one[1])
        elif q == "predict":
            r = q_predict(a.one[1], int(a.one[2]), int(a.one[3]))
        else:
            r = q_oom()
        print("RESULT " + json.dumps(r, default=str), flush=True)
        return
    jobs = [["cap", "true"], ["cap", "false"]]
    for kind, sizes in (("cnn", (64, 256, 1024, 2048)), ("transformer", (32, 128, 512))):
        jobs += [["predict", kind, str(b), "0"] for b in sizes]
    jobs += [["predict", "cnn", "2048", str(3 * GIB)], ["predict", "cnn", "4096", str(3 * GIB)]]
    jobs += [["oom"]]
    results = []
    for j in jobs:
        p = subprocess.run([sys.executable, __file__, "--out", a.out, "--one"] + j,
                           capture_output=True, text=True, timeout=240)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        r = json.loads(line[0][7:]) if line else {"job": j, "rc": p.returncode,
                                                   "stderr": p.stderr[-1500:]}
        print(json.dumps(r, default=str), flush=True)
        results.append(r)
    with open(os.path.join(a.out, "probe_jax.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
