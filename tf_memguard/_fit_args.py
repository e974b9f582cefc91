"""What the running fit() was given: Keras does not hand callbacks the batch size or the
data, but fit()'s own frame has them."""
import inspect
import numbers


def fit_arguments():
    """The arguments of the Keras fit() call running now (its frame's locals), or {}."""
    return call_arguments("fit")


def call_arguments(name):
    """The arguments of the innermost Keras trainer method `name` running now ("fit",
    "evaluate", "predict": its frame's locals), or {}."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            code = frame.f_code
            if code.co_name == name and "keras" in code.co_filename.replace("\\", "/"):
                return dict(frame.f_locals)
            frame = frame.f_back
        return {}
    finally:
        del frame


def is_arrays(data):
    """True for arrays (numpy and the like) or a structure of them, as fit() takes them."""
    import keras
    if data is None:
        return False
    leaves = keras.tree.flatten(data)
    return bool(leaves) and all(hasattr(a, "shape") and hasattr(a, "nbytes") and not keras.ops.is_tensor(a)
                                and len(a.shape) > 0 for a in leaves)


def is_sliceable(data):
    """Arrays or tensors with a first dimension, or a structure of them: what fit() can
    batch at any size (unlike is_arrays(), tensors too; a tf.data dataset, though it has a
    length, is batches already)."""
    import keras
    if data is None or hasattr(data, "element_spec"):
        return False
    leaves = keras.tree.flatten(data)
    return bool(leaves) and all(getattr(a, "shape", None) is not None and len(a.shape) > 0 for a in leaves)


def num_samples(data):
    """How many samples arrays or tensors (or a structure of them) hold: the smallest
    first dimension. (A tf.SparseTensor, which Keras' fit() batches as it does arrays, has
    no len(): its dense shape's first dimension.)"""
    import keras
    return min(int(a.shape[0]) for a in keras.tree.flatten(data))


def first_samples(data, n):
    """The first `n` samples of arrays or tensors (or a structure of them); a
    tf.SparseTensor's through tf.sparse.slice, which its [:n] does not take."""
    import keras

    def head(a):
        if type(a).__name__ == "SparseTensor":
            import tensorflow as tf
            rank = len(a.shape)
            return tf.sparse.slice(a, [0] * rank, [n] + [int(d) for d in a.shape[1:]])
        return a[:n]
    return keras.tree.map_structure(head, data)


def fixed_batch_size(model):
    """The batch size the model's inputs fix (keras.Input(batch_shape=(B, ...)), as a
    stateful recurrent layer needs), or None: a model built so runs no other batch size
    (TensorFlow's "Incompatible shapes" at any other), so the advice names that size or
    none, and never runs steps at others."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a subclassed model: no symbolic inputs
        return None
    sizes = set()
    for t in inputs or []:
        shape = getattr(t, "shape", None)
        if shape is None or len(shape) == 0:
            return None
        sizes.add(shape[0])
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    return int(size) if isinstance(size, numbers.Integral) and size > 0 else None


def replicas(model):
    """The replicas each step's global batch is split over: num_replicas_in_sync of the
    tf.distribute strategy the model was built under (a MirroredStrategy over two logical
    CPUs: 2), else 1 (no strategy, or Keras on another backend)."""
    strategy = getattr(model, "_distribute_strategy", None)
    try:
        n = int(getattr(strategy, "num_replicas_in_sync", 1) or 1) if strategy is not None else 1
    except (TypeError, ValueError):
        return 1
    return max(1, n)


def round_down(size, multiple):
    """`size` rounded down to a multiple of `multiple` (a strategy's replicas, or the
    devices a Keras distribution shards a batch over: only such a batch can be split
    evenly, see runnable()); 0 where `size` is below `multiple`, which callers read as
    "none fits"."""
    multiple = max(1, int(multiple))
    return int(size) // multiple * multiple


def runnable(size, replicas):
    """`size` as a batch size the model can run: rounded down to a multiple of `replicas`
    (see replicas()), and at least `replicas`. Keras 3.15 on TensorFlow 2.21 runs no other
    under a MirroredStrategy: a global batch of 1,517 over two replicas fails at once with
    "Inputs to operation AddN ... must have the same size and shape" ([759, ...] != [758,
    ...]), and a last partial batch smaller than the replicas (3 samples at 2) with an
    empty replica's error; an odd size named by the advice would fail its retry so
    (benchmarks/NOTES.md, thirtieth session)."""
    return max(max(1, int(replicas)), round_down(size, replicas))


def is_dataset(data):
    """True for a tf.data dataset."""
    import sys
    tf = sys.modules.get("tensorflow")  # a dataset exists only if TensorFlow was imported
    return tf is not None and isinstance(data, tf.data.Dataset)


def is_py_dataset(data):
    """True for a keras.utils.PyDataset."""
    import sys
    keras = sys.modules.get("keras")  # a PyDataset exists only if Keras was imported
    return keras is not None and isinstance(data, keras.utils.PyDataset)


def batch_size(fit_args):
    """fit()'s batch size: its argument for arrays or tensors (Keras' default of 32 when None), else a
    tf.data dataset's static batch dimension, else the size its batch() was given, else a
    PyDataset's first batch's, else a generator's first batch's, else None."""
    import keras
    x = fit_args.get("x")
    if is_arrays(x) or is_sliceable(x):  # tensors are batched by fit() as arrays are
        return fit_args.get("batch_size") or 32
    spec = getattr(x, "element_spec", None)
    if spec is None:
        return py_dataset_batch_size(x) or generator_batch_size(fit_args)
    leaves = [leaf for leaf in keras.tree.flatten(spec) if getattr(leaf, "shape", None) is not None
              and leaf.shape.rank is not None and len(leaf.shape) > 0]
    dims = {leaf.shape[0] for leaf in leaves}
    if len(dims) == 1 and None not in dims:
        return int(dims.pop())
    # batch() without drop_remainder leaves the batch dimension unknown (the last batch
    # can be short), and that is how most pipelines batch: the size is batch()'s argument.
    size = dataset_batch_size(x)
    if size is not None and all(d is None or d == size for d in dims):
        return size
    return None


def run_batch_size(size, samples):
    """The batch size fit() runs: `size`, or `samples` where the arrays hold fewer (Keras
    then batches them all as one)."""
    return min(size, samples) if size and samples else size


def py_dataset_batch_size(x):
    """A keras.utils.PyDataset's batch size: its first batch's first dimension (Keras
    itself reads its first batches, x[0] on, for their specs before fit() runs), or None
    when it has none, or its inputs disagree."""
    import keras
    if not isinstance(x, keras.utils.PyDataset):
        return None
    try:
        first = x[0]
    except Exception:  # noqa: BLE001 - the user's __getitem__; the advice does without
        return None
    return _first_dimension(first[0] if isinstance(first, tuple) else first)


def generator_batch_size(fit_args):
    """A Python generator's batch size: the first dimension of the first batch Keras took
    from it (its GeneratorDataAdapter reads the first batches for their specs before fit()
    runs, and keeps them, `_first_batches`), or None when there is none, or its inputs
    disagree."""
    adapter = getattr(fit_args.get("epoch_iterator"), "data_adapter", None)
    first = getattr(adapter, "_first_batches", None)
    if not first or not isinstance(first[0], tuple):
        return None
    return _first_dimension(first[0][0])


def _first_dimension(inputs):
    """The first dimension all of a batch's inputs share, or None."""
    import keras
    dims = {int(a.shape[0]) for a in keras.tree.flatten(inputs)
            if getattr(a, "shape", None) is not None and len(a.shape) > 0 and a.shape[0] is not None}
    return dims.pop() if len(dims) == 1 else None


# tf.data transformations after batch() that keep its batch dimension (their elements are
# the batches), by class name (TensorFlow 2.21's tensorflow/python/data/ops/).
_KEEPS_BATCHES = frozenset({
    "_PrefetchDataset", "_MapDataset", "_ParallelMapDataset", "_RepeatDataset", "CacheDataset",
    "_CacheDataset", "_MemoryCacheDataset", "_ShuffleDataset", "_TakeDataset", "_SkipDataset", "_FilterDataset",
    "_OptionsDataset", "_ShardDataset", "_AssertCardinalityDataset", "_IgnoreErrorsDataset",
})
_BATCHES = frozenset({"_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset"})
# Transformations that join the elements of several pipelines (zip: one of each input's side
# by side; concatenate: one input's after the other's): where every input's elements are
# batches of one size, so are the join's (keras.io's MixUp zips two batched pipelines and
# mixes them in a map(): with a zip taken for the end of the walk, its fit() was told that
# the batch size could not be read, and no size was named after its OOM).
# sample_from_datasets() and choose_from_datasets() take one element of one input at a
# time (_DirectedInterleaveDataset): its data inputs, not the selector that picks them.
_JOINS_BATCHES = frozenset({"_ZipDataset", "_ConcatenateDataset", "_DirectedInterleaveDataset"})


def _last_batches(dataset, passes):
    """The pipeline's last batch() nodes, reached from `dataset` through transformations
    whose class names are in `passes`, and through every input of a join (zip,
    concatenate, sample_from_datasets): one per branch; None when another transformation
    comes first on any branch, or a branch has no batch()."""
    found, todo = [], [dataset]
    for _ in range(1024):  # a pipeline is a tree; the bound only guards against a cycle
        if not todo:
            return found or None
        node = todo.pop()
        name = type(node).__name__
        if name in _BATCHES:
            found.append(node)
        elif name in _JOINS_BATCHES:
            try:
                todo.extend(node._data_inputs if name == "_DirectedInterleaveDataset" else node._inputs())
            except Exception:  # noqa: BLE001 - a private method of tf.data's: without it, no size
                return None
        elif name in passes and getattr(node, "_input_dataset", None) is not None:
            todo.append(node._input_dataset)
        else:
            return None
    return None


def _last_batch(dataset, passes):
    """The pipeline's last batch() node, reached from `dataset` through transformations
    whose class names are in `passes`; None when another comes first, or none is found."""
    for _ in range(256):  # a pipeline is a chain; the bound only guards against a cycle
        name = type(dataset).__name__
        if name in _BATCHES:
            return dataset
        if name not in passes:
            return None
        dataset = getattr(dataset, "_input_dataset", None)
        if dataset is None:
            return None
    return None


def _given_size(node):
    """The batch size a batch() node was given (a positive int), or None."""
    size = getattr(node, "_batch_size", None)
    try:
        size = int(size.numpy()) if hasattr(size, "numpy") else int(size)
    except (TypeError, ValueError):
        return None
    return size if size > 0 else None


def dataset_batch_size(dataset):
    """The batch size a tf.data pipeline's last batch() was given, found by walking from
    `dataset` through transformations that keep batches (prefetch, map, shuffle, repeat,
    cache, take, ...) and into every input of a zip, a concatenate or a
    sample_from_datasets / choose_from_datasets, whose batch() calls must then all have
    been given one size; None when another transformation (unbatch, rebatch, window, ...)
    comes first, the sizes differ, or there is no batch()."""
    nodes = _last_batches(dataset, _KEEPS_BATCHES)
    if not nodes:
        return None
    sizes = {_given_size(node) for node in nodes}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def dataset_batch_method(dataset):
    """The name of the transformation that batches a tf.data pipeline ("batch", or
    "padded_batch" or "ragged_batch" where that is what every last batching one is), for
    the advice's "build it with ...": "batch" where it cannot tell."""
    nodes = _last_batches(dataset, _KEEPS_BATCHES) if dataset is not None else None
    names = {_batch_method(n) for n in nodes or ()}
    return names.pop() if len(names) == 1 else "batch"


def _batch_method(node):
    """The method that made batch node `node`: ragged_batch() is a map to ragged elements
    (_DenseToRaggedDataset) and a batch()."""
    if type(node).__name__ == "_PaddedBatchDataset":
        return "padded_batch"
    if type(getattr(node, "_input_dataset", None)).__name__ == "_DenseToRaggedDataset":
        return "ragged_batch"
    return "batch"


# Transformations after batch() that keep its batches and their order (shuffle, repeat,
# take, skip, filter and shard do not), so that every epoch ends with batch()'s last batch.
_KEEPS_ORDER = frozenset({"_PrefetchDataset", "_MapDataset", "_ParallelMapDataset", "CacheDataset", "_CacheDataset",
                          "_MemoryCacheDataset", "_OptionsDataset"})


def dataset_partial_batch(dataset):
    """The size of the partial batch that ends every epoch of a tf.data pipeline: where its
    last batch() keeps the remainder, takes a dataset of a known, finite length (n), and is
    reached through transformations that keep the batches and their order (prefetch, map,
    cache), n mod the batch size (None when that is 0, or anything is not known)."""
    import tensorflow as tf
    node = _last_batch(dataset, _KEEPS_ORDER)
    if node is None:
        return None
    try:
        size = int(tf.get_static_value(node._batch_size))
        drop = tf.get_static_value(node._drop_remainder)
        n = int(node._input_dataset.cardinality().numpy())
    except (AttributeError, TypeError, ValueError):
        return None
    if drop is None or bool(drop) or size <= 0 or n <= 0:
        return None
    return (n % size) or None


def training_samples(fit_args):
    """The samples fit() trains on, for arrays or tensors (after validation_split, as Keras
    splits: ceil(n * (1 - split))), else None."""
    import keras
    x = fit_args.get("x")
    if not (is_arrays(x) or is_sliceable(x)):
        return None
    firsts = [a.shape[0] for a in keras.tree.flatten(x)]
    if any(f is None for f in firsts):
        return None
    n = min(int(f) for f in firsts)
    split = fit_args.get("validation_split") or 0.0
    if split and fit_args.get("validation_data") is None:
        n = int(-(-n * (1.0 - split) // 1))
    return n


def fed_nbytes(array):
    """The bytes of `array` as Keras feeds it to the step: a float array not of Keras'
    floatx is cast to floatx first (keras/src/trainers/data_adapters/array_slicing.py,
    convert_to_sliceable: numpy's default float64 becomes float32, half its nbytes)."""
    import keras
    import numpy as np
    dtype = getattr(array, "dtype", None)
    try:
        floating = dtype is not None and np.issubdtype(np.dtype(dtype), np.floating)
    except TypeError:
        floating = False
    if floating and keras.backend.standardize_dtype(dtype) != keras.backend.floatx():
        return int(np.prod(array.shape, dtype=np.int64)) * np.dtype(keras.backend.floatx()).itemsize
    return int(array.nbytes)


def validation_arrays(fit_args):
    """fit()'s validation data when it is arrays (validation_data given as arrays, or
    split off by validation_split: by on_train_begin, fit()'s frame holds the split as
    validation_data), as a list of them, when fit() runs more than one epoch (the steps
    after the first evaluation meet them), else None."""
    import keras
    data = fit_args.get("validation_data")
    epochs = fit_args.get("epochs") or 1
    if data is None or not isinstance(epochs, int) or epochs - (fit_args.get("initial_epoch") or 0) < 2:
        return None
    leaves = [a for a in keras.tree.flatten(data) if a is not None]
    return leaves if leaves and all(is_arrays(a) for a in leaves) else None


def positive_int(name, value, none_ok=False):
    """`value` as an int, for an argument that must be a positive integer (numpy's too;
    never a bool)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive int" + (" or None" if none_ok else ""))
    return int(value)


def fraction(name, value):
    """`value` as a float in (0, 1] (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"{name}={value!r}: must be a fraction in (0, 1]")
    return float(value)
