"""The model comes out of tf_memguard's own short steps as it went in (_snapshot)."""
import os

from tfproc import HARD, run

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")

SETUP = f"""
import sys
sys.path.insert(0, {EXAMPLES!r})
import numpy as np, tensorflow as tf, keras, tf_memguard
from _data import pattern_images, small_cnn
x, y = pattern_images(1024)
"""


def test_find_batch_size_on_a_freshly_compiled_model_keeps_its_learning_rate_and_first_optimizer_state():
    # Every variable the short steps made was set to zero, Keras' learning_rate variable
    # among them: after find_batch_size on a freshly compiled model, fit() learned nothing
    # (loss 1.3477 in each of three epochs, accuracy at chance), and Adagrad's
    # accumulators started at 0 instead of their initial 0.1.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        out = {}
        for name, opt in (("adam", keras.optimizers.Adam(1e-3)), ("adagrad", keras.optimizers.Adagrad(0.05))):
            keras.utils.set_random_seed(0)
            m = small_cnn()
            m.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            size = tf_memguard.find_batch_size(m, x, y)
            lr = float(keras.ops.convert_to_numpy(m.optimizer.learning_rate))
            it = int(keras.ops.convert_to_numpy(m.optimizer.iterations))
            acc = [float(v.numpy().min()) for v in m.optimizer.variables if v.path.endswith("_accumulator")]
            h = m.fit(x, y, batch_size=min(size, 128), epochs=2, verbose=0)
            out[name] = dict(lr=lr, iterations=it, accumulators=[min(acc), max(acc)] if acc else None,
                             loss=h.history["loss"])
        emit(**out)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert abs(d["adam"]["lr"] - 1e-3) < 1e-9 and d["adam"]["iterations"] == 0, d
    assert abs(d["adagrad"]["lr"] - 0.05) < 1e-9 and d["adagrad"]["iterations"] == 0, d
    assert d["adagrad"]["accumulators"] == [0.10000000149011612, 0.10000000149011612], d
    for name in ("adam", "adagrad"):
        first, last = d[name]["loss"]
        assert last < 0.9 * first, f"{name}: fit() after find_batch_size did not learn: {d[name]}"


def test_the_callbacks_second_size_leaves_every_optimizer_of_a_custom_train_step_alone():
    # keras.io's GAN pattern: a train_step applying two optimizers of its own. The
    # callback's short fit() at half the batch size (64 divides the samples) ran two more
    # steps of each, which stayed in their moments and iteration counts (18 after an
    # epoch of 16 steps).
    r = run(SETUP, """
        from keras import layers, ops
        tf_memguard.install(max_bytes="256MiB")
        keras.utils.set_random_seed(0)
        disc = keras.Sequential([keras.Input((32, 32, 3)), layers.Conv2D(16, 3, strides=2), layers.LeakyReLU(0.2),
                                 layers.GlobalMaxPooling2D(), layers.Dense(1)])
        gen = keras.Sequential([keras.Input((16,)), layers.Dense(8 * 8 * 16), layers.Reshape((8, 8, 16)),
                                layers.Conv2DTranspose(16, 4, strides=4, padding="same"),
                                layers.Conv2D(3, 3, padding="same", activation="sigmoid")])

        class GAN(keras.Model):
            def __init__(self):
                super().__init__()
                self.disc, self.gen = disc, gen
                self.seeds = keras.random.SeedGenerator(1337)

            def compile(self, d_optimizer, g_optimizer):
                super().compile()
                self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
                self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

            def train_step(self, real):
                n = ops.shape(real)[0]
                fake = self.gen(keras.random.normal((n, 16), seed=self.seeds))
                labels = ops.concatenate([ops.ones((n, 1)), ops.zeros((n, 1))], axis=0)
                with tf.GradientTape() as tape:
                    d_loss = self.bce(labels, self.disc(ops.concatenate([fake, real], axis=0)))
                g = tape.gradient(d_loss, self.disc.trainable_weights)
                self.d_optimizer.apply_gradients(zip(g, self.disc.trainable_weights))
                with tf.GradientTape() as tape:
                    g_loss = self.bce(ops.zeros((n, 1)), self.disc(self.gen(keras.random.normal((n, 16), seed=self.seeds))))
                g = tape.gradient(g_loss, self.gen.trainable_weights)
                self.g_optimizer.apply_gradients(zip(g, self.gen.trainable_weights))
                return {"d_loss": d_loss, "g_loss": g_loss}

        gan = GAN()
        gan.compile(keras.optimizers.Adam(3e-4), keras.optimizers.Adam(3e-4))
        gan.fit(x, batch_size=64, epochs=1, verbose=0,
                callbacks=[tf_memguard.MemGuardCallback(verbose=0, batch_size=64)])
        rep = tf_memguard.report()
        emit(d=int(gan.d_optimizer.iterations.numpy()), g=int(gan.g_optimizer.iterations.numpy()),
             method=rep.suggestion_method, suggested=rep.suggested_batch_size)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert "steps at 64 and 32" in d["method"], d   # the short fit() at 32 ran
    assert d["d"] == 16 and d["g"] == 16, d


def test_a_restore_the_pool_cannot_copy_into_still_puts_every_value_back():
    # Near the budget a variable's old buffer and the copy it takes over are live at once:
    # the copy was refused (a stateful LSTM with Adam under 40 MiB), the error left the
    # model half restored, and find_batch_size raised TensorFlow's error.
    r = run("""
        import numpy as np, tensorflow as tf, keras, tf_memguard
        from tf_memguard._snapshot import Snapshot
        tf_memguard.install(max_bytes="32MiB")
        m = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024), keras.layers.Dense(1024)])
        m.compile("adam", "mse")
        snap = Snapshot(m)
        saved = [w.copy() for w in m.get_weights()]
        m.set_weights([w + 1 for w in saved])
        s = tf_memguard.stats()
        fill_bytes = (s["bytes_limit"] - s["bytes_in_use"] - (1 << 20)) // 4 * 4
        fill = tf.ones([fill_bytes // 4])   # 1 MiB left: a 4 MiB copy cannot fit
        refusals = tf_memguard.stats()["num_refusals"]
        in_use = tf_memguard.stats()["bytes_in_use"]
        snap.restore()
        del fill
        # (The copies the variables took over stay in the pool: the state in the budget's account.)
        emit(restored=all(np.array_equal(a, b) for a, b in zip(saved, m.get_weights())),
             refused=tf_memguard.stats()["num_refusals"] - refusals,
             moved=tf_memguard.stats()["bytes_in_use"] - (in_use - int(fill_bytes)))
    """, env=HARD)
    assert r.returncode == 0, r
    assert r.data["restored"] and r.data["refused"] >= 1, r.data
    # Not asserted: that all of the state stays in the pool's account. The copies are made
    # as numpy values are (granted as "input"), and in CI one of the two 4 MiB kernels
    # restored so did not show in the account afterwards (moved -4 MiB; locally 0), which
    # is not understood (benchmarks/NOTES.md); the cycle collector run first makes this path
    # rare in practice.
