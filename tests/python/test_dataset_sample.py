"""_dataset_sample: a tf.data dataset's first batches as arrays, and what its pipeline holds
beside a step (the after-OOM advice on a dataset)."""
import numpy as np
import pytest

import tf_memguard
from tf_memguard import _dataset_sample as ds_sample
from tf_memguard import _step_trace

MiB = 1 << 20


def test_pipeline_buffers_are_the_most_untagged_tf_data_bytes_live_at_once():
    pool = tf_memguard.Pool(max_bytes=1 << 30, upstream="host_lazy")
    pool.allocate(4 * MiB, kind="kernel")                 # weights: not the pipeline's
    shuffle = pool.allocate(6 * MiB, kind="data")         # a shuffle buffer, live at the start
    pool.allocate(2 * MiB, kind="data", batch=True)       # a prepared batch: grows with the batch
    live = pool.live_blocks()
    pool.trace_start(1 << 12)
    element = pool.allocate(3 * MiB, kind="data")         # a map's element: 6 + 3 live
    act = pool.allocate(8 * MiB, kind="kernel", batch=True)
    pool.free(shuffle)                                    # 3 live
    pool.free(element)
    pool.allocate(1 * MiB, kind="data")                   # 1 live
    pool.free(act)
    pool.trace_start(0)
    trace = _step_trace.StepTrace.from_pool(pool, live, 16)
    assert ds_sample.pipeline_buffers(trace) == 9 * MiB
    sizes, flags = ds_sample.pipeline_extra(trace)
    assert sizes == [9 * MiB] and not flags[0] & tf_memguard._core.ALLOC_BATCH
    assert ds_sample.pipeline_extra(None) is None


@pytest.mark.tf
def test_a_sample_of_a_datasets_batches_is_arrays_of_what_the_model_is_fed():
    tf = pytest.importorskip("tensorflow")
    x = np.arange(100 * 3, dtype=np.float32).reshape(100, 3)
    y = np.arange(100)
    w = np.ones(100, np.float32)
    # Through a map after batch(), and an infinite repeat: the first 40 samples, as fed.
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda a, b: (a * 2, b)).repeat()
    sx, sy = ds_sample.sample_arrays(ds, 40)
    assert isinstance(sx, np.ndarray) and sx.shape == (40, 3) and sy.shape == (40,)
    np.testing.assert_array_equal(sx, 2 * x[:40])
    np.testing.assert_array_equal(sy, y[:40])
    # Inputs by name, and sample weights (left out: the short runs weigh nothing).
    ds = tf.data.Dataset.from_tensor_slices(({"a": x, "b": x[:, :1]}, y, w)).batch(32)
    sx, sy = ds_sample.sample_arrays(ds, 50)
    assert set(sx) == {"a", "b"} and sx["a"].shape == (50, 3) and sx["b"].shape == (50, 1)
    assert sy.shape == (50,)
    # Fewer samples than asked: all of them. No batches: None.
    sx, sy = ds_sample.sample_arrays(tf.data.Dataset.from_tensor_slices((x[:10], y[:10])).batch(4), 40)
    assert sx.shape == (10, 3)
    assert ds_sample.sample_arrays(tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0), 40) is None


@pytest.mark.tf
def test_a_sample_of_padded_batches_is_padded_to_their_longest():
    # padded_batch() pads each batch to its own longest element: the sample's batches are
    # padded to the longest of them (its confirmation's sample failed: "all the input array
    # dimensions except for the concatenation axis must match").
    tf = pytest.importorskip("tensorflow")
    seqs = [np.arange(1, k + 1, dtype=np.int32) for k in (3, 9, 2, 5, 4, 1)]
    ds = tf.data.Dataset.from_generator(lambda: iter(seqs), output_signature=tf.TensorSpec([None], tf.int32))
    x, y = ds_sample.sample_arrays(ds.padded_batch(2), 6)
    assert y is None and x.shape == (6, 9)
    assert x[1].tolist() == list(range(1, 10)) and x[2].tolist() == [1, 2] + [0] * 7
    assert tf_memguard._fit_args.dataset_batch_method(ds.padded_batch(2).prefetch(1)) == "padded_batch"
    assert tf_memguard._fit_args.dataset_batch_method(ds.batch(1).map(lambda v: v)) == "batch"
