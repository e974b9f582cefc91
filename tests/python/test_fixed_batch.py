"""A model whose inputs fix the batch size (keras.Input(batch_shape=(32, ...)), as a
stateful LSTM needs) runs no other size: TensorFlow raises "Incompatible shapes" at any
other. The advice names that size or none, and says why; it runs no step at another size
(before, find_batch_size raised TensorFlow's InvalidArgumentError, and the callback's
report said its short runs at 125, 124 and 123 "were refused")."""
import pytest

from tfproc import run

pytestmark = pytest.mark.tf

MODEL = """
import tf_memguard
tf_memguard.install(max_bytes={budget} << 20)
import numpy as np, tensorflow as tf, keras
from keras import layers
rng = np.random.default_rng(0)
x = rng.random((256, 50, 8), dtype=np.float32)
y = rng.random((256, 1), dtype=np.float32)
i = keras.Input(batch_shape=(32, 50, 8))
h = layers.LSTM(64, stateful=True, return_sequences=True)(i)
h = layers.LSTM(64, stateful=True)(h)
m = keras.Model(i, layers.Dense(1)(h))
m.compile("adam", "mse")
before = [w.copy() for w in m.get_weights()]
def same():
    return all(np.array_equal(a, b) for a, b in zip(before, m.get_weights()))
"""


def test_a_fixed_batch_size_that_fits_is_the_answer_and_no_other_size_runs():
    r = run(MODEL.format(budget=48), """
        found = tf_memguard.find_batch_size(m, x, y)
        unchanged = same()
        m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False,
              callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        r = tf_memguard.report()
        emit(found=found, unchanged=unchanged, suggested=r.suggested_batch_size, advice=r.advice,
             method=r.suggestion_method)
    """)
    assert r.returncode == 0, r
    d = r.data
    assert d["found"] == 32 and d["unchanged"]
    assert d["suggested"] == 32
    assert "fix the batch size at 32" in d["advice"] and "refused" not in d["method"], d


def test_a_fixed_batch_size_that_does_not_fit_is_explained_and_the_model_stays_usable():
    r = run(MODEL.format(budget=6), """
        try:
            tf_memguard.find_batch_size(m, x, y)
            found = None
        except tf_memguard.OutOfBudgetError as e:
            found = str(e)
        unchanged = same()
        note = None
        try:
            m.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
                  callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        except tf.errors.ResourceExhaustedError as e:
            note = "\\n".join(getattr(e, "__notes__", []))
        gc.collect()
        r = tf_memguard.report()
        # Still usable: the weights are whole, and a forward pass at 32 runs.
        out = m.predict(x[:32], batch_size=32, verbose=0)
        emit(found=found, unchanged=unchanged, note=note, suggested=r.suggested_batch_size, advice=r.advice,
             predicted=list(out.shape))
    """)
    assert r.returncode == 0, r
    d = r.data
    assert d["found"] and "fix the batch size at 32" in d["found"], d
    assert d["unchanged"]
    assert d["note"] and "fix the batch size at 32" in d["note"] and "Reduce the batch size" not in d["note"], d
    assert d["suggested"] == 0 and "fix the batch size at 32" in d["advice"], d
    assert d["predicted"] == [32, 1]
