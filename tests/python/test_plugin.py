"""The TensorFlow plugin: TensorFlow's CPU tensors come from the pool; TF's memory API."""
import os
import shutil

import pytest

from tfproc import HARD, run

pytestmark = pytest.mark.tf


def test_tensorflow_takes_cpu_tensors_from_the_shared_pool():
    r = run("""
        import tensorflow as tf
        import tf_memguard
        from tf_memguard import _core
        before = tf_memguard.stats()
        x = tf.random.normal([256, 256])
        y = tf.matmul(x, x)
        after = tf_memguard.stats()
        emit(state=_core.plugin_state(), allocs=after["num_allocs"] - before["num_allocs"],
             in_use=after["bytes_in_use"], path=_core.plugin_path())
    """)
    assert r.returncode == 0, r
    from tf_memguard import _core
    assert r.data["state"] & _core.PLUGIN_REGISTERED and r.data["state"] & _core.PLUGIN_SERVING
    assert r.data["allocs"] >= 2
    assert r.data["in_use"] >= 2 * 256 * 256 * 4  # x and y are alive
    assert r.data["path"].endswith("tensorflow-plugins/libtf_memguard_plugin.so")


def test_get_memory_info_and_reset_memory_stats_speak_for_the_pool():
    r = run("""
        import tensorflow as tf
        import tf_memguard
        tf_memguard.install(max_bytes="256MiB")
        x = tf.zeros([1024, 1024])           # 4 MiB
        del x
        y = tf.ones([256, 256])              # 256 KiB, alive
        info = tf.config.experimental.get_memory_info("CPU:0")
        s = tf_memguard.stats()
        tf.config.experimental.reset_memory_stats("CPU:0")
        after_reset = tf.config.experimental.get_memory_info("CPU:0")
        s2 = tf_memguard.stats()
        emit(info=info, in_use=s["bytes_in_use"], peak=s["peak_bytes_in_use"], after_reset=after_reset,
             in_use2=s2["bytes_in_use"])
    """)
    assert r.returncode == 0, r
    assert r.data["info"] == {"current": r.data["in_use"], "peak": r.data["peak"]}
    assert r.data["peak"] >= 4 * 1024 * 1024  # x, freed before y
    assert r.data["after_reset"]["peak"] == r.data["after_reset"]["current"] == r.data["in_use2"]
    assert r.data["after_reset"]["peak"] < 4 * 1024 * 1024


def test_kernels_tensors_are_tagged_by_their_first_dimension_while_a_batch_size_is_profiled():
    # The batch tags the memory model goes by: first dimension the batch (TFMG_ALLOC_BATCH),
    # or a multiple of it (TFMG_ALLOC_BATCH_ROWS: a Dense layer on (batch, steps, features)
    # computes on (batch x steps, features)); neither when nothing is profiled.
    r = run("""
        import numpy as np
        import tensorflow as tf
        import tf_memguard
        from tf_memguard import _core, _install, _recording
        tf_memguard.install(max_bytes="256MiB")
        pool = _install.device_pool()
        w = tf.Variable(tf.ones([96, 160]))
        @tf.function
        def f(x):
            return tf.reduce_sum(tf.nn.relu(tf.matmul(tf.reshape(x, [-1, 96]), w)))
        x = tf.ones([24, 7, 96])
        f(x)
        def sizes_with(flag, profiled):
            _core.set_profile_batch(24 if profiled else 0)
            rec = _recording.StepRecorder(pool)
            rec.begin(24)
            f(x)
            t = rec.end()
            _core.set_profile_batch(0)
            return sorted({int(s) for s, g, o in zip(t.size, t.flags, t.op) if o != 1 and g & flag})
        emit(rows=sizes_with(_core.ALLOC_BATCH_ROWS, True), batch=sizes_with(_core.ALLOC_BATCH, True),
             off=sizes_with(_core.ALLOC_BATCH_ROWS | _core.ALLOC_BATCH, False))
    """)
    assert r.returncode == 0, r
    # (24 x 7, 160) floats: the matmul's output and relu's (unless it reuses the buffer).
    assert 24 * 7 * 160 * 4 in r.data["rows"], r.data
    assert not r.data["batch"] and not r.data["off"], r.data


def test_a_batch_by_batch_tensor_is_tagged_square_while_a_batch_size_is_profiled():
    # z @ z.T of a batch (a contrastive loss's similarities): (batch, batch), tagged
    # TFMG_ALLOC_BATCH and TFMG_ALLOC_BATCH_SQUARE; z itself (batch, 96) only the first.
    r = run("""
        import tensorflow as tf
        import tf_memguard
        from tf_memguard import _core, _install, _recording
        tf_memguard.install(max_bytes="256MiB")
        pool = _install.device_pool()
        @tf.function
        def f(x):
            z = tf.nn.relu(x * 2.0)
            return tf.reduce_sum(tf.nn.softmax(tf.matmul(z, z, transpose_b=True)))
        x = tf.ones([200, 96])
        f(x)
        _core.set_profile_batch(200)
        rec = _recording.StepRecorder(pool)
        rec.begin(200)
        f(x)
        t = rec.end()
        _core.set_profile_batch(0)
        got = [(int(s), int(g & _core.ALLOC_BATCH_SQUARE != 0)) for s, g, o in zip(t.size, t.flags, t.op)
               if o != 1 and g & _core.ALLOC_BATCH]
        emit(square=sorted({s for s, q in got if q}), line=sorted({s for s, q in got if not q}))
    """)
    assert r.returncode == 0, r
    assert 200 * 200 * 4 in r.data["square"], r.data
    assert 200 * 96 * 4 in r.data["line"] and 200 * 96 * 4 not in r.data["square"], r.data


def test_disable_variable_leaves_tensorflow_alone_and_install_says_why():
    r = run("""
        import tensorflow as tf
        import tf_memguard
        from tf_memguard import _core
        x = tf.ones([10]) * 2
        try:
            tf_memguard.install(max_bytes="1GB")
            emit(error=None)
        except RuntimeError as e:
            emit(error=str(e), state=_core.plugin_state(), value=float(x[0]))
    """, env={"TF_MEMGUARD_DISABLE": "1"})
    assert r.returncode == 0, r
    assert "TF_MEMGUARD_DISABLE=1" in r.data["error"]
    assert r.data["value"] == 2.0


def test_bfc_variable_makes_install_refuse_to_pretend():
    r = run("""
        import tf_memguard
        try:
            tf_memguard.install(max_bytes="1GB")
            emit(error=None)
        except RuntimeError as e:
            emit(error=str(e))
    """, env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert r.returncode == 0, r
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in r.data["error"]
    assert "Unset it" in r.data["error"]


def test_a_missing_core_warns_and_tensorflow_still_imports():
    r = run("""
        import tensorflow as tf
        from tensorflow.python.util import _pywrap_util_port
        emit(value=float(tf.reduce_sum(tf.ones([4]))))
    """, env={"TF_MEMGUARD_CORE": "/nonexistent/libtfmg_core.so"})
    assert r.returncode == 0, r
    assert r.data["value"] == 4.0
    assert "libtfmg_core.so was not found" in r.stderr
    assert "TensorFlow keeps its own allocator" in r.stderr


@pytest.fixture
def tensorflow_plugin_copy(tmp_path):
    from tf_memguard import _core  # noqa: F401
    import sysconfig
    src = os.path.join(sysconfig.get_paths()["platlib"], "tensorflow-plugins", "libtf_memguard_plugin.so")
    if not os.path.exists(src):
        pytest.skip("no installed plugin to copy")
    dst = tmp_path / "site-packages" / "tensorflow-plugins"
    dst.mkdir(parents=True)
    shutil.copy(src, dst / "libtf_memguard_plugin.so")
    return str(tmp_path / "site-packages")


def test_a_second_copy_of_the_plugin_does_not_register_again(tensorflow_plugin_copy):
    # TensorFlow scans every sys.path entry containing "site-packages": both copies load.
    r = run("""
        import tensorflow as tf
        import tf_memguard
        from tf_memguard import _core
        y = tf.ones([8]) + 1
        emit(state=_core.plugin_state(), value=float(y[0]))
    """, env={"PYTHONPATH": tensorflow_plugin_copy})
    assert r.returncode == 0, r
    from tf_memguard import _core
    assert r.data["state"] & _core.PLUGIN_DUPLICATE
    assert r.data["state"] & _core.PLUGIN_SERVING
    assert r.data["value"] == 2.0


def test_the_budget_holds_while_a_small_model_trains():
    r = run("""
        import numpy as np, tensorflow as tf, keras
        import tf_memguard
        budget = 96 << 20
        tf_memguard.install(max_bytes=budget)
        rng = np.random.default_rng(0)
        x = rng.random((1024, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, 1024)
        m = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, batch_size=64, epochs=2, verbose=0)
        s = tf_memguard.stats()
        emit(peak_reserved=s["peak_bytes_reserved"], peak=s["peak_bytes_in_use"], budget=budget,
             refusals=s["num_refusals"], overshoot=s["overshoot_bytes_by_kind"], allocs=s["num_allocs"])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["peak_reserved"] <= d["budget"]
    assert d["refusals"] == 0
    assert d["allocs"] > 1000
    # What went over the budget, if anything, is reported by kind (never by kernels here).
    assert d["overshoot"]["kernel"] == 0
