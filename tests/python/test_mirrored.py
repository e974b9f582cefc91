"""A model built under tf.distribute.MirroredStrategy over two logical CPUs: every batch
size the advice names, and every size its own short runs take, is a multiple of the
replicas (_fit_args.runnable), the only sizes Keras runs there."""
import pytest

from tfproc import run

MiB = 1 << 20


@pytest.mark.tf
def test_under_a_mirrored_strategy_every_size_named_is_a_multiple_of_the_replicas_and_trains():
    # Before: the advice's short runs at odd sizes (3183, 1517) failed with TensorFlow's
    # "Inputs to operation AddN ... must have the same size and shape", and the report
    # named the running size, under a budget where 2,846 trains.
    r = run("""
        import gc, warnings, numpy as np
        import tf_memguard
        tf_memguard.install(max_bytes="96MiB")
        import keras, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        L = keras.layers
        rng = np.random.default_rng(0)
        x = rng.random((1536, 24, 24, 3), dtype=np.float32)
        y = rng.integers(0, 10, 1536)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            m = keras.Sequential([keras.Input((24, 24, 3)), L.Conv2D(32, 3, activation="relu"),
                                  L.Conv2D(48, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
            m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        def trains(size):
            try:
                m.fit(x, y, batch_size=size, epochs=1, verbose=0)
                return True
            except tf.errors.ResourceExhaustedError:
                return False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cb = tf_memguard.MemGuardCallback(verbose=0)
            m.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[cb])
            advised, method = cb.report.suggested_batch_size, cb.report.suggestion_method
            advised_trains = trains(advised)
            try:
                m.fit(x, y, batch_size=1536, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
                outcome = "trained"
            except tf.errors.ResourceExhaustedError as e:
                outcome = type(e).__name__
                del e
            gc.collect()
            after = tf_memguard.report().suggested_batch_size
            after_trains = trains(after) if after else None
            found = tf_memguard.find_batch_size(m, x, y)
            found_trains = trains(found)
        failed = [str(w.message)[:300] for w in caught if "failed" in str(w.message)]
        emit(advised=advised, method=method, advised_trains=advised_trains, outcome=outcome, after=after,
             after_trains=after_trains, found=found, found_trains=found_trains, failed=failed,
             peak_reserved=tf_memguard.stats()["peak_bytes_reserved"])
    """, timeout=900)
    assert r.returncode == 0, r
    d = r.data
    assert not d["failed"], d
    assert d["advised"] > 32 and d["advised"] % 2 == 0 and d["advised_trains"], d
    assert d["outcome"] == "ResourceExhaustedError", d
    assert d["after"] and d["after"] % 2 == 0 and d["after_trains"], d
    assert d["found"] % 2 == 0 and d["found_trains"], d
    assert d["peak_reserved"] <= 96 * MiB, d


def test_a_runnable_size_is_the_largest_multiple_of_the_replicas_and_at_least_one_of_each():
    from tf_memguard._fit_args import runnable
    assert runnable(1517, 2) == 1516 and runnable(1516, 2) == 1516
    assert runnable(1, 2) == 2 and runnable(0, 4) == 4     # the least a step of every replica takes
    assert runnable(37, 8) == 32 and runnable(37, 1) == 37


def test_a_size_named_is_rounded_down_to_the_replicas_and_may_round_to_none():
    """The answers (advice, find, after an OOM, the workers' smallest) round with round_down:
    below one of each replica nothing fits, which they report as 0, not as a runnable size."""
    from tf_memguard._fit_args import round_down
    assert round_down(1517, 2) == 1516 and round_down(1516, 2) == 1516
    assert round_down(1, 2) == 0 and round_down(7, 8) == 0
    assert round_down(37, 1) == 37 and round_down(37, 0) == 37   # no strategy: one replica


@pytest.mark.tf
def test_a_model_built_without_a_strategy_has_one_replica():
    keras = pytest.importorskip("keras")
    from tf_memguard._fit_args import replicas
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert replicas(m) == 1
    assert replicas(object()) == 1       # a model of another framework (no strategy)
