"""Models made, fit and dropped one after another in one process (a tuner's loop, cross
validation) under one budget: what TensorFlow kept of each dead model (its weights and
optimizer slots, held through the gradient registry's entries for tf.distribute's
all_reduce in the traced train step) is let go. tf_memguard/_dead_models.py."""
import pytest

from tfproc import run

pytestmark = pytest.mark.tf

LOOP = """
import tf_memguard
tf_memguard.install(max_bytes=160 << 20)
import numpy as np, keras, tensorflow as tf
rng = np.random.default_rng(0)
x = rng.random((2048, 256), dtype=np.float32)
y = rng.integers(0, 10, 2048)

def make():
    m = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                          keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m
start = tf_memguard.stats()["bytes_in_use"]
held = []
"""


def test_a_dead_model_that_was_fit_with_the_callback_leaves_nothing_in_the_pool():
    # 15.2 MiB per model stayed before (its 1.3 M weights and Adam's two slots), after
    # `del m`, gc.collect() and keras.backend.clear_session().
    r = run(LOOP, """
        for _ in range(3):
            m = make()
            m.fit(x, y, batch_size=256, epochs=1, verbose=0, validation_split=0.1,
                  callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            del m
            gc.collect()
            held.append(tf_memguard.stats()["bytes_in_use"] - start)
        emit(held=held)
    """)
    assert r.returncode == 0, r
    assert max(r.data["held"]) <= 1 << 20, r.data


def test_a_dead_model_that_find_batch_size_ran_leaves_nothing_in_the_pool():
    r = run(LOOP, """
        for _ in range(2):
            m = make()
            size = tf_memguard.find_batch_size(m, x, y)
            del m
            gc.collect()
            held.append(tf_memguard.stats()["bytes_in_use"] - start)
        emit(held=held, size=size)
    """)
    assert r.returncode == 0, r
    assert r.data["size"] >= 1 and max(r.data["held"]) <= 1 << 20, r.data
