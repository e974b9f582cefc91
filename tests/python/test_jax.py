"""Keras' JAX backend on the CPU: what XLA's CPU client allows without a GPU.

XLA's CPU client has no cap, so here the budget is tf_memguard's check of each compiled
step before it runs; the GPU cap (XLA_CLIENT_MEM_FRACTION) runs on the lent H200
(benchmarks/gpu/run_keras_jax.sh, results/gpu_keras_jax.json). Each scenario is a fresh
process with KERAS_BACKEND=jax. Skipped where jax is not installed (CI installs jax's CPU
wheel for these; see .ci/run).
"""
import pytest

from tfproc import run

pytest.importorskip("jax")

JAX = {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}

MODEL = """
import numpy as np, keras, tf_memguard
from keras import layers
def cnn():
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 3)); x = inp
    for f in (16, 32):
        x = layers.Conv2D(f, 3, padding="same", activation="relu")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    m = keras.Model(inp, layers.Dense(10)(x))
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m
rng = np.random.default_rng(0)
X = rng.random((2000, 32, 32, 3), dtype=np.float32); Y = rng.integers(0, 10, 2000)
def trained_a_little():
    tf_memguard.install(max_bytes="300MiB", device="CPU:0")
    m = cnn()
    m.fit(X[:64], Y[:64], batch_size=32, epochs=1, verbose=0)
    return m, [np.array(v.value) for v in m.variables]
def unchanged(m, w0):
    return all(np.array_equal(a, np.array(v.value)) for a, v in zip(w0, m.variables))
"""


def test_install_on_cpu_says_there_is_no_cap_and_sets_no_xla_variable():
    r = run("""
        import os, warnings
        import keras, tf_memguard
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cfg = tf_memguard.install(max_bytes="300MiB", device="CPU:0")
        try:
            tf_memguard.stats()
            stats = "no error"
        except RuntimeError as e:
            stats = str(e)
        emit(framework=cfg.framework, enforced=cfg.enforced, max_bytes=cfg.max_bytes,
             warned=[str(x.message) for x in w], fraction=os.environ.get("XLA_CLIENT_MEM_FRACTION"), stats=stats)
    """, env=JAX)
    assert r.returncode == 0, r
    d = r.data
    assert d["framework"] == "jax" and d["enforced"] is False and d["max_bytes"] == 300 << 20
    assert any("no memory cap" in m for m in d["warned"]), d
    assert d["fraction"] is None
    assert "keeps no memory statistics" in d["stats"]


def test_a_gpu_cap_is_refused_once_jax_has_started_and_a_bad_allocator_is_refused():
    r = run("""
        import os
        import keras, tf_memguard
        from tf_memguard import _xla
        import jax
        jax.devices()  # the backend starts: XLA has read its settings
        try:
            _xla.set_cap("GPU:0", 1 << 30, 8 << 30)
            started = "no error"
        except RuntimeError as e:
            started = str(e)
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
        try:
            _xla.set_cap("GPU:0", 1 << 30, 8 << 30)
            platform = "no error"
        except RuntimeError as e:
            platform = str(e)
        emit(started=started, platform=platform)
    """, env=JAX)
    assert r.returncode == 0, r
    assert "already started its backend" in r.data["started"] and "XLA_CLIENT_MEM_FRACTION" in r.data["started"]
    assert "without its memory cap" in r.data["platform"]


def test_the_cap_goes_into_xla_s_variables_before_jax_starts():
    r = run("""
        import os
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.9"  # jaxlib refuses both names at once
        from tf_memguard import _xla
        _xla.set_cap("GPU:0", 2 << 30, 8 << 30)
        emit(new=os.environ.get("XLA_CLIENT_MEM_FRACTION"), old=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
             prealloc=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"), started=_xla.backend_started())
    """, env=JAX)
    assert r.returncode == 0, r
    assert float(r.data["new"]) == 0.25 and r.data["old"] is None
    assert r.data["prealloc"] == "true" and r.data["started"] is False


def test_fit_logs_peaks_from_the_compiled_step_and_suggests_a_size_that_trains():
    r = run(MODEL, """
        tf_memguard.install(max_bytes="300MiB", device="CPU:0")
        cb = tf_memguard.MemGuardCallback(verbose=0)
        h = cnn().fit(X, Y, batch_size=128, epochs=2, verbose=0, callbacks=[cb])
        rep = cb.report
        s = rep.suggested_batch_size
        model = rep.model()
        m2 = cnn()
        h2 = m2.fit(X, Y, batch_size=s, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        emit(peaks=h.history["memguard_peak_mib"], fraction=h.history["memguard_budget_fraction"], s=s,
             need_s=model.need(s)["peak_account"], need_next=model.need(s + 8)["peak_account"],
             source=rep.peak_source, kind=rep.budget_kind, text=str(rep), trained=h2.history["loss"],
             retry_peak=h2.history["memguard_peak_mib"])
    """, env=JAX)
    assert r.returncode == 0, r
    d = r.data
    assert len(d["peaks"]) == 2 and d["peaks"][0] > 1 and d["source"] == "compiled"
    assert d["kind"] == "checked against the compiled step"
    # The suggestion is the largest the model says fits: its step within the budget, a bit larger not.
    assert d["s"] > 128 and d["need_s"] <= 300 << 20 < d["need_next"], d
    assert d["retry_peak"][0] <= 300, d
    assert "batch size that fits the budget" in d["text"]


def test_a_step_over_the_budget_is_refused_before_it_runs_and_the_retry_trains():
    r = run(MODEL, """
        import gc
        m, w0 = trained_a_little()
        try:
            m.fit(X, Y, batch_size=1500, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            err = None
        except Exception as e:
            err, oom_type = str(e), isinstance(e, tf_memguard.BudgetExceededError)
            import jax
            xla_type = isinstance(e, jax.errors.JaxRuntimeError)
        same = unchanged(m, w0)
        s = tf_memguard.report().suggested_batch_size
        gc.collect()
        h = m.fit(X, Y, batch_size=s, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        emit(err=err, oom_type=oom_type, xla_type=xla_type, same=same, s=s, loss=h.history["loss"],
             peak=h.history["memguard_peak_mib"])
    """, env=JAX)
    assert r.returncode == 0, r
    d = r.data
    assert d["err"].startswith("RESOURCE_EXHAUSTED: tf_memguard: CPU:0: the training step at batch 1500"), d
    assert "it was not run and the model is unchanged" in d["err"] and "Reduce the batch size to" in d["err"]
    assert d["oom_type"] and d["xla_type"] and d["same"]
    assert 128 < d["s"] < 1500 and d["peak"][0] <= 300 and d["loss"][0] == d["loss"][0]


def test_after_a_step_that_fails_inside_fit_the_guard_puts_the_weights_back_and_a_retry_trains():
    # fit() takes the values out of the variables for the epoch; a step that raises (here
    # while it is traced: XLA's CPU client has no cap to run out of) leaves them empty, and
    # the next fit() fails inside Keras. With MemGuardCallback the state goes back.
    r = run(MODEL, """
        fail = [True]
        class Flaky(keras.Model):
            def train_step(self, state, data):
                if fail[0]:
                    raise RuntimeError("a step that fails")
                return super().train_step(state, data)
        def flaky():
            m = cnn()
            f = Flaky(m.inputs, m.outputs)
            f.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            f.fit(X[:64], Y[:64], batch_size=32, epochs=1, verbose=0) if not fail.__setitem__(0, False) else None
            fail[0] = True
            return f
        out = {}
        for guarded in (False, True):
            f = flaky()
            w0 = [np.array(v.value) for v in f.variables]
            cbs = [tf_memguard.MemGuardCallback(verbose=0)] if guarded else []
            try:
                f.fit(X[:256], Y[:256], batch_size=64, epochs=1, verbose=0, callbacks=cbs)
            except RuntimeError as e:
                assert "a step that fails" in str(e), e
            empty = sum(v._value is None for v in f.variables)
            fail[0] = False
            try:
                h = f.fit(X[:256], Y[:256], batch_size=64, epochs=1, verbose=0, callbacks=cbs)
                retry = h.history["loss"][0] == h.history["loss"][0]
            except Exception as e:
                retry = type(e).__name__
            out[str(guarded)] = dict(empty=empty, retry=retry)
        emit(**out)
    """, env=JAX)
    assert r.returncode == 0, r
    assert r.data["True"] == {"empty": 0, "retry": True}, r.data
    # Without the guard: Keras' own state after the failure (what the guard repairs).
    assert r.data["False"]["empty"] > 0 and r.data["False"]["retry"] == "TypeError", r.data


def test_find_batch_size_from_the_compiled_step_matches_the_callback_and_runs_nothing():
    r = run(MODEL, """
        m, w0 = trained_a_little()
        size = tf_memguard.find_batch_size(m, X, Y)
        small = tf_memguard.find_batch_size(m, X, Y, max_bytes="60MiB")
        same = unchanged(m, w0)
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(X, Y, batch_size=size, epochs=1, verbose=0, callbacks=[cb])
        try:
            tf_memguard.find_batch_size(m, X, Y, max_bytes="100KiB")
            none = "no error"
        except tf_memguard.OutOfBudgetError as e:
            none = str(e)
        emit(size=size, small=small, same=same, peak=cb.report.peak_bytes, none=none)
    """, env=JAX)
    assert r.returncode == 0, r
    d = r.data
    assert d["same"] and 0 < d["small"] < d["size"], d
    assert d["peak"] <= 300 << 20
    assert "not even a batch of 1 fits" in d["none"]


def test_what_if_reads_a_jax_report():
    r = run(MODEL, """
        import subprocess, sys, tempfile, os
        tf_memguard.install(max_bytes="300MiB", device="CPU:0")
        cb = tf_memguard.MemGuardCallback(verbose=0)
        cnn().fit(X[:512], Y[:512], batch_size=64, epochs=1, verbose=0, callbacks=[cb])
        path = os.path.join(tempfile.mkdtemp(), "r.json")
        cb.report.to_json(path)
        p = subprocess.run([sys.executable, "-m", "tf_memguard", "what-if", path, "--budget", "1GiB"],
                           capture_output=True, text=True)
        emit(rc=p.returncode, out=p.stdout, err=p.stderr[-500:])
    """, env=JAX)
    assert r.returncode == 0, r
    assert r.data["rc"] == 0, r.data
    assert "largest batch size that fits" in r.data["out"] and "fits 1.00 GiB" in r.data["out"]


def test_the_recompile_margin_is_one_matmul_workspace_and_the_advice_keeps_it():
    from tf_memguard._xla_step import DEFAULT_WORKSPACE, HOPPER_WORKSPACE, XlaStepModel, matmul_workspace

    class Device:
        def __init__(self, platform, cc):
            self.platform, self.compute_capability = platform, cc
    gemm = 'custom-call(...), custom_call_target="__cublas$gemm"'
    assert matmul_workspace(Device("gpu", "9.0"), gemm) == HOPPER_WORKSPACE == 32 << 20
    assert matmul_workspace(Device("gpu", "8.6"), gemm.replace("gemm", "lt$matmul")) == DEFAULT_WORKSPACE
    assert matmul_workspace(Device("gpu", "9.0"), "convolution only") == 0
    assert matmul_workspace(Device("cpu", ""), gemm) == 0
    mib = 1 << 20
    m = XlaStepModel(points=[(10, 100 * mib, mib, 80 * mib), (20, 200 * mib, 2 * mib, 160 * mib)], fixed=0)
    without = m.largest_fitting(150 * mib)
    m.margin = 32 * mib
    assert m.largest_fitting(150 * mib) < without and m.need(10)["peak_account"] == 132 * mib
    assert XlaStepModel.from_dict(m.to_dict()).margin == 32 * mib
    # The step about to run is checked as compiled: the margin is for advice only.
    m.largest_free = 100 * mib
    assert m.contiguous_fits(80 * mib, margin=False) and not m.contiguous_fits(80 * mib)


DATA_PARALLEL = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import warnings; warnings.simplefilter("ignore")
import numpy as np, keras, jax, tf_memguard
tf_memguard.install(max_bytes="60MiB", device="CPU:0")
if DISTRIBUTED:
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
keras.utils.set_random_seed(0)
m = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
                      keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
X = rng.random((1000, 32, 32, 3), dtype=np.float32); Y = rng.integers(0, 4, 1000)
cb = tf_memguard.MemGuardCallback(verbose=0)
m.fit(X, Y, batch_size=64, epochs=2, verbose=0, callbacks=[cb])
r = cb.report
s = r.suggested_batch_size
h = m.fit(X, Y, batch_size=s, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
emit(peak=r.peak_bytes, devices=r.devices, suggestion=s, text=str(r), retrained=bool(np.isfinite(h.history["loss"][-1])))
"""


def test_data_parallel_over_two_devices_reports_each_device_and_advises_a_size_that_shards():
    alone = run("DISTRIBUTED = False", DATA_PARALLEL, env=JAX, timeout=900).data
    r = run("DISTRIBUTED = True", DATA_PARALLEL, env=JAX, timeout=900)
    d = r.data
    assert d is not None and alone is not None, r
    assert alone["devices"] is None
    dev = d["devices"]
    assert dev["devices"] == ["CPU:0", "CPU:1"] and len(dev["epochs"]) == 2
    for e in dev["epochs"]:
        assert e["budget_bytes"] == [60 << 20] * 2 and e["source"] == ["compiled"] * 2
        assert abs(e["peak_bytes"][0] - d["peak"]) < 4096  # the same compiled step (what was live beside it moves)
    # Each device runs half the batch: its compiled step is about half the single device's.
    assert 0.4 * alone["peak"] < d["peak"] < 0.6 * alone["peak"], (d["peak"], alone["peak"])
    # The suggestion divides over the 2 devices, and trains under the check.
    assert d["suggestion"] and d["suggestion"] % 2 == 0 and d["retrained"], d
    assert "per device (2 devices of Keras' distribution" in d["text"]


def test_a_model_whose_inputs_fix_the_batch_size_is_advised_that_size_or_none():
    # keras.Input(batch_shape=(32, ...)) with a stateful LSTM: Keras raises at any other
    # batch size (before, find_batch_size raised that error and the callback gave no advice).
    r = run("""
        import numpy as np, keras, tf_memguard
        from keras import layers
        rng = np.random.default_rng(0)
        x = rng.random((256, 50, 8), dtype=np.float32); y = rng.random((256, 1), dtype=np.float32)
        def model():
            i = keras.Input(batch_shape=(32, 50, 8))
            m = keras.Model(i, layers.Dense(1)(layers.LSTM(64, stateful=True)(i)))
            m.compile("adam", "mse")
            return m
        tf_memguard.install(max_bytes="64MiB", device="CPU:0")
        m = model()
        found = tf_memguard.find_batch_size(m, x, y)
        m.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
              callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        advice = tf_memguard.report().advice
        try:
            tf_memguard.find_batch_size(m, x, y, max_bytes="1MiB")
            small = None
        except tf_memguard.OutOfBudgetError as e:
            small = str(e)
        emit(found=found, advice=advice, small=small)
    """, env=JAX)
    assert r.returncode == 0, r
    assert r.data["found"] == 32
    assert "fix the batch size at 32" in r.data["advice"], r.data
    assert r.data["small"] and "fix the batch size at 32" in r.data["small"], r.data
