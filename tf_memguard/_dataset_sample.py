"""After an out-of-memory error in a fit() on a tf.data dataset or a keras.utils.PyDataset: a
sample of its batches as arrays, for the short fit() runs that work out the batch size
that fits. (A PyDataset's batches are taken by index, from the first: fit()'s shuffle of
their order is its own.)

The short runs need data they can batch at any size, and a dataset fixes its own
batches. Its first batches, taken through the whole pipeline (every map, before and
after batch(), applied as in training), are what the model is fed, so they are sampled
as numpy arrays (host memory, outside the pool), but strings, which Keras does not take
as numpy arrays (an object array: "Invalid dtype: object"), as string tensors (a model
with TextVectorization inside takes its text so). What the short runs on those arrays do
not meet is the pipeline itself: its buffers that do not grow with the batch size
(shuffle buffers, elements made by maps), which pipeline_buffers() measures in the failed
step, and the batches it prepares ahead, which the models take from the failed step as
they do for arrays (_recording.unmet_prepared).

Where the dataset's batches vary in shape beyond the batch dimension (padded_batch() of
sequences of many lengths), a step's memory is not a function of the batch size alone:
the sample is padded to the longest shape of a pass over the dataset (longest_shapes),
which some batch of any batch size holds, so that the short runs take the worst batch.
"""
import numpy as np

from tf_memguard import _core, _fit_args
from tf_memguard._step_trace import _ALLOC, _FREE, _OVERSHOOT, kind_of

# Samples taken, in batches of the failed size: the short runs after the OOM go up to
# just under it, and a run that confirms a size takes four of its batches
# (_after_oom.CONFIRM_STEPS).
BATCHES = 4
# Batches a pass for the longest shapes reads where neither the dataset nor fit() says how
# many an epoch has (an endless dataset without steps_per_epoch): the shapes of the first
# that many are what the sample is padded to.
SCAN_BATCHES = 1000


def sample_arrays(dataset, samples, longest=None):
    """(x, y) of the first `samples` samples of `dataset`'s batches (a fresh iterator), as
    numpy arrays or structures of them (y None when its elements have no targets); None
    when it yields none, or not arrays with a batch dimension. `longest`: the shapes beyond
    the batch dimension to pad each leaf to at least (longest_shapes), or None."""
    import keras
    got, n = [], 0
    if isinstance(dataset, keras.utils.PyDataset):
        count = dataset.num_batches
        batches = (dataset[i] for i in range(samples if count is None else min(count, samples)))
    else:
        batches = dataset.take(samples)  # a batch has a sample at least
    for batch in batches:
        arrays = keras.tree.map_structure(_host, batch)
        leaves = keras.tree.flatten(arrays)
        if not leaves or any(a.ndim == 0 for a in leaves):
            return None
        got.append(arrays)
        n += min(len(a) for a in leaves)
        if n >= samples:
            break
    if not got:
        return None
    leaves = list(zip(*(keras.tree.flatten(b) for b in got)))
    if longest is not None and len(longest) != len(leaves):
        longest = None
    joined = keras.tree.pack_sequence_as(got[0], [_concatenate(parts, longest[i] if longest else None)[:samples]
                                                  for i, parts in enumerate(leaves)])
    x, y, _ = keras.utils.unpack_x_y_sample_weight(tuple(joined) if isinstance(joined, list) else joined)
    return x, y


def varying_shapes(dataset):
    """True when `dataset` (tf.data) says that its batches' shapes beyond the batch
    dimension are not fixed (an unknown dimension in its element_spec, as padded_batch()
    of sequences of many lengths makes)."""
    import tensorflow as tf
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return False
    for leaf in tf.nest.flatten(spec):
        shape = getattr(leaf, "shape", None)
        if shape is not None and (shape.rank is None or any(d is None for d in shape.as_list()[1:])):
            return True
    return False


def longest_shapes(dataset, batches=None):
    """The largest size of each dimension beyond the batch dimension over a pass of
    `dataset`'s batches (a fresh iterator: its whole pipeline runs, its batches are not
    kept), leaf by leaf in keras.tree.flatten's order, as a list of tuples; at most
    `batches` batches (default: an epoch where the dataset knows its size, else
    SCAN_BATCHES). None where the shapes cannot be read (ragged or sparse leaves)."""
    import tensorflow as tf
    if batches is None:
        count = int(dataset.cardinality())
        batches = count if count >= 0 else SCAN_BATCHES
    shapes = dataset.take(batches).map(lambda *e: [tf.shape(t)[1:] for t in tf.nest.flatten(e)])
    top = None
    for got in shapes.as_numpy_iterator():
        got = [np.asarray(v) for v in got]
        top = got if top is None else [np.maximum(a, b) if a.shape == b.shape else a for a, b in zip(top, got)]
    return [tuple(int(d) for d in t) for t in top] if top is not None else None


def pipeline_buffers(trace):
    """The most bytes of tf.data's blocks not shaped by the batch live at once in `trace`
    (its start, then its events): the pipeline's buffers whatever its batch size
    (shuffle buffers, elements of maps), which short runs on arrays do not meet."""
    data = _core.KINDS.index("data")

    def pipeline_owned(flags):
        return kind_of(flags) == data and not int(flags) & _core.ALLOC_BATCH
    live = {int(a): int(s) for a, s, f in zip(trace.start_address.tolist(), trace.start_size.tolist(),
                                             trace.start_flags.tolist()) if pipeline_owned(f)}
    now = most = sum(live.values())
    for op, addr, size, flags in zip(trace.op.tolist(), trace.address.tolist(), trace.size.tolist(),
                                     trace.flags.tolist()):
        if op == _FREE:
            now -= live.pop(addr, 0)
        elif op in (_ALLOC, _OVERSHOOT) and pipeline_owned(flags):
            live[addr] = size
            now += size
            most = max(most, now)
    return most


def pipeline_extra(trace, dataset=None):
    """What the pipeline holds beside a step whatever its batch size, as one more block
    live at the step's start ((sizes, flags) for StepModel.build's extra_start: not
    batch-shaped, so fixed), or None: the larger of pipeline_buffers(trace), measured, and
    pipeline_fills(dataset), what its caches and shuffle buffers hold once filled."""
    size = max(pipeline_buffers(trace) if trace is not None else 0,
               pipeline_fills(dataset) if dataset is not None else 0)
    if size <= 0:
        return None
    return [size], [_core.KINDS.index("data") << _core.ALLOC_KIND_SHIFT]


# Transformations that hold elements whatever the batch size (TensorFlow 2.21's
# tensorflow/python/data/ops/ class names): an in-memory cache() holds every element of
# its input from the end of the first epoch on, and shuffle() fills its buffer at each
# epoch's start. A failed step early in the first epoch meets the cache partly filled (a
# CNN on 4,000 images through map(), cache(), shuffle(1000) under 256 MiB, refused in its
# first step at 305: the short runs on arrays completed at 196, and the retry at 185 ran
# out as the cache filled, where 191 is the most that trains).
_CACHES = frozenset({"CacheDataset", "_CacheDataset", "_MemoryCacheDataset"})


def pipeline_fills(dataset):
    """The bytes `dataset`'s in-memory caches and shuffle buffers hold once filled: each
    cache() every element of its input, each shuffle() buffer_size of its input's elements
    (fewer where the input has fewer), by the elements' static shapes and dtypes, each
    tensor rounded up to the pool's 64-byte granule. Elements of unknown size (strings,
    an unknown dimension, as batches have) and inputs of unknown length count 0: those
    the failed step's measurement covers as far as it met them (pipeline_buffers)."""
    total, todo, seen = 0, [dataset], set()
    for _ in range(1024):  # a pipeline is a tree; the bound only guards against a cycle
        if not todo:
            break
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        source = getattr(node, "_input_dataset", None)
        if source is not None and name in _CACHES and _static(getattr(node, "_filename", None)) in (b"", ""):
            # A cache after batch() holds every batch: the samples batch() is given, whatever
            # the size (the last batch partial: not counted as a whole one).
            batch, samples = _fit_args.dataset_batch_size(source), _batched_samples(source)
            if batch and samples >= 0 and _element_bytes(source) == 0:
                total += _element_bytes(source, _origin(source), batch) * samples // batch
            else:
                total += _element_bytes(source, _origin(source), batch) * max(0, _cardinality(source))
        elif source is not None and name == "_ShuffleDataset":
            n, buffer = _cardinality(source), _static(getattr(node, "_buffer_size", None))
            if isinstance(buffer, (int, np.integer)) and buffer > 0:
                total += _element_bytes(source, _origin(source)) * (min(int(buffer), n) if n >= 0 else int(buffer))
        try:
            todo.extend(node._inputs())
        except Exception:  # noqa: BLE001 - a private method of tf.data's: the walk ends here
            pass
    return int(total)


def _static(value):
    """A tf.data node's scalar argument as a Python value, or None."""
    import tensorflow as tf
    try:
        got = tf.get_static_value(value)
    except Exception:  # noqa: BLE001
        return None
    return got.item() if isinstance(got, np.ndarray) and got.ndim == 0 else got


def _batched_samples(dataset):
    """The samples the last batch() of `dataset`'s pipeline is given in an epoch (one
    such node, through transformations that keep batches), or -1 where unknown."""
    nodes = _fit_args._last_batches(dataset, _fit_args._KEEPS_BATCHES)
    if not nodes or len(nodes) != 1 or getattr(nodes[0], "_input_dataset", None) is None:
        return -1
    return _cardinality(nodes[0]._input_dataset)


def _cardinality(dataset):
    """The elements `dataset` yields in an epoch; negative where infinite or unknown."""
    try:
        return int(dataset.cardinality())
    except Exception:  # noqa: BLE001
        return -2


# Transformations whose elements are their input's tensors, not new ones.
_SAME_TENSORS = frozenset({"_TakeDataset", "_SkipDataset", "_ShardDataset", "_FilterDataset", "_OptionsDataset",
                           "_PrefetchDataset", "_ShuffleDataset", "_RepeatDataset", "_AssertCardinalityDataset"})


def _origin(dataset):
    """Where `dataset`'s element tensors come from, through transformations that pass
    tensors on as they are: "cache" (an in-memory cache() holds them, and is counted as
    such), "slices" (from_tensor_slices: a slice whose bytes are a multiple of the
    alignment is a view of the source tensor, no new block; a shuffle buffer of all 4,000
    32x32x3 float32 images of from_tensor_slices added 0.21 MiB to the pool, their
    labels' copies; after a map(), 47 MiB), else "new" (made per element: map, decoding,
    generators)."""
    for _ in range(256):
        name = type(dataset).__name__
        if name == "_TensorSliceDataset":
            return "slices"
        if name in _CACHES:
            return "cache"
        if name not in _SAME_TENSORS:
            return "new"
        dataset = getattr(dataset, "_input_dataset", None)
        if dataset is None:
            return "new"
    return "new"


def _element_bytes(dataset, origin="new", batch=None):
    """The new bytes one element of `dataset` puts in the pool by its element_spec (each
    tensor rounded up to 64 bytes; none where a cache holds them, nor for slices of the
    source tensor that are 64-byte multiples; see _origin), or 0 where a shape is not
    fully known or a dtype has no fixed size (strings). `batch`: the size of an unknown
    first dimension (the batch() a cache of batches follows), else unknown."""
    import tensorflow as tf
    if origin == "cache":
        return 0
    total = 0
    for spec in tf.nest.flatten(getattr(dataset, "element_spec", None)):
        shape, dtype = getattr(spec, "shape", None), getattr(spec, "dtype", None)
        if shape is not None and batch and shape.rank and shape[0] is None:
            shape = tf.TensorShape([batch]).concatenate(shape[1:])
        if shape is None or dtype is None or not shape.is_fully_defined() or dtype == tf.string or \
                not isinstance(spec, tf.TensorSpec):
            return 0
        nbytes = shape.num_elements() * dtype.size
        if not (origin == "slices" and nbytes and nbytes % 64 == 0):
            total += -(-max(1, nbytes) // 64) * 64
    return total


def _host(t):
    """A batch's tensor as a numpy array, or a string tensor as itself (see the module)."""
    if getattr(getattr(t, "dtype", None), "name", None) == "string":
        return t
    return np.array(t, copy=True)


def _concatenate(parts, longest=None):
    """The batches `parts` of one leaf as one array. Batches of padded_batch() are padded to
    their own longest element: each is padded (with zeros, padded_batch()'s default) to
    the longest of them, so that the short runs take the sample's longest, as the
    pipeline's longest batches are (a GRU on sequences of 1 to 300 tokens: its
    confirmation's sample failed on batches of 295 and 187 tokens), and to `longest`
    (the dataset's longest shape, longest_shapes) where that is longer still."""
    if isinstance(parts[0], np.ndarray):
        shapes = {p.shape[1:] for p in parts}
        if longest is not None:
            shapes.add(tuple(longest))
        if len(shapes) > 1 and len({len(s) for s in shapes}) == 1:
            top = tuple(max(d) for d in zip(*shapes))
            parts = [np.pad(p, [(0, 0)] + [(0, t - d) for t, d in zip(top, p.shape[1:])]) for p in parts]
        return np.concatenate(parts)
    import tensorflow as tf
    return tf.concat(list(parts), axis=0)
