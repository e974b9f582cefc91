"""tf_keras (Keras 2, as tf.keras makes with TF_USE_LEGACY_KERAS=1): the budget holds for
its tensors, and MemGuardCallback and find_batch_size, which read Keras 3's fit(), say so
instead of failing inside Keras. Skipped without tf_keras; .ci/run installs it (without
its dependencies: the TensorFlow it needs is the one installed) and runs this file."""
import importlib.util

import pytest

from tfproc import HARD, run

pytestmark = [pytest.mark.tf,
              pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed")]


def test_a_tf_keras_model_is_budgeted_and_the_callback_says_it_is_keras_3s():
    # The callback failed inside tf_keras' CallbackList: "'MemGuardCallback' object has no
    # attribute '_implements_train_batch_hooks'".
    r = run("""
        import gc, tf_memguard
        tf_memguard.install(max_bytes="96MiB")
        import numpy as np, tensorflow as tf
        keras = tf.keras
        L = keras.layers
        rng = np.random.default_rng(0)
        x = rng.random((1024, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, 1024)
        m = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(32, 3, activation="relu"),
                              L.GlobalAveragePooling2D(), L.Dense(10)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        errors = []
        try:
            m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        except TypeError as e:
            errors.append(str(e))
        try:
            tf_memguard.find_batch_size(m, x, y)
        except TypeError as e:
            errors.append(str(e))
        loss = m.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"][-1]   # the model is as it was
        try:
            m.fit(x, y, batch_size=1024, epochs=1, verbose=0)   # 1024 x 30 x 30 x 32 floats: 112 MiB
            outcome = "trained"
        except tf.errors.ResourceExhaustedError:
            outcome = "oom"
        gc.collect()
        s = tf_memguard.stats()
        emit(module=type(m).__module__, errors=errors, loss=loss, outcome=outcome, text=str(tf_memguard.report()),
             peak_reserved=s["peak_bytes_reserved"], limit=s["bytes_limit"])
    """, env={**HARD, "TF_USE_LEGACY_KERAS": "1"})
    assert r.returncode == 0, r
    d = r.data
    assert d["module"].startswith("tf_keras"), d
    assert len(d["errors"]) == 2 and all("tf_keras (Keras 2) model" in e and "holds for it" in e
                                         for e in d["errors"]), d["errors"]
    assert d["errors"][0].startswith("tf_memguard: MemGuardCallback") and "find_batch_size" in d["errors"][1], d
    assert d["loss"] > 0 and d["outcome"] == "oom", d
    assert "out of memory: the last refused request" in d["text"], d["text"]
    assert d["peak_reserved"] <= d["limit"] == 96 << 20, d
