"""Snapshot: a model's state before tf_memguard's own short training steps, put back after.

The advice runs steps of fit() of its own (find_batch_size, the callback's second batch
size, the short runs after an out-of-memory error), and the user's model must come out of
them as it went in: its variables (weights, and the seeds of its random layers, so that
the run's dropout masks are the ones it would have drawn) and the state of every optimizer
it holds: ``model.optimizer``, and any set as an attribute (a GAN's ``d_optimizer`` and
``g_optimizer``, applied by its own ``train_step``).

An optimizer that is not built yet already has variables (``iterations``, and
``learning_rate`` when it is a number); the steps would build the rest (Adam's moments,
Adagrad's accumulators starting at ``initial_accumulator_value``, Nadam's ``u_product``
at 1) inside the traced train function, where their first values cannot be read (tf.function
initializes them at its first run). So the model's own optimizer is built first, as Keras'
trainer builds it (``optimizer.build(model.trainable_variables)``, under the model's
distribution strategy), and its state is then saved like a built one's. (Setting every
variable the steps made to zero instead set Keras' ``learning_rate`` variable to 0: after
``find_batch_size`` on a freshly compiled model, ``fit()`` did not learn.) An optimizer that
cannot be built so (one a custom ``train_step`` applies to variables of its own choosing,
before it ever ran) keeps ``iterations`` and ``learning_rate`` as they were, and the
variables the steps made go to zero (the first state of Adam, SGD's momentum, RMSprop).
"""
import contextlib
import gc


def _numpy(v):
    return v.numpy().copy()


def _optimizers(model):
    """Every optimizer the model holds (a LossScaleOptimizer's variables include its
    inner optimizer's, which is then not listed on its own)."""
    import keras
    found = []
    for value in [getattr(model, "optimizer", None)] + list(vars(model).values()):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found):
            found.append(value)
    inner = [getattr(o, "inner_optimizer", None) for o in found]
    return [o for o in found if all(o is not i for i in inner)]


def _model_variables(model):
    """The model's variables: its weights, and the states of its random generators
    (model.variables; metrics' too, which the steps' caller resets afterwards)."""
    try:
        return list(model.variables)
    except (AttributeError, ValueError):
        return list(model.weights)


def _build(model, opt):
    """Builds the model's optimizer as Keras' trainer does at the first fit(), if the
    model has its variables (a subclassed model not yet called has none)."""
    if getattr(opt, "built", False) or not getattr(model, "built", False):
        return
    variables = list(model.trainable_variables)
    if not variables:
        return
    strategy = getattr(model, "distribute_strategy", None)
    with strategy.scope() if strategy is not None and hasattr(strategy, "scope") else contextlib.nullcontext():
        opt.build(variables)


class Snapshot:
    """The model's variables and its optimizers' state, restored exactly after lone steps."""

    def __init__(self, model):
        self.model = model
        self.values = [(v, _numpy(v)) for v in _model_variables(model)]
        self.optimizers = []
        for opt in _optimizers(model):
            if opt is getattr(model, "optimizer", None):
                _build(model, opt)
            saved = [(v, _numpy(v)) for v in opt.variables]
            self.optimizers.append((opt, saved, bool(getattr(opt, "built", False))))

    def restore(self):
        collected = []  # the cycle collector runs at most once a restore (_in_pool)
        for v, value in self.values:
            v.assign(_in_pool(value, collected))
        for opt, saved, was_built in self.optimizers:
            if not was_built and getattr(opt, "built", False):  # built by the steps
                known = [v for v, _ in saved]
                for v in opt.variables:
                    if all(v is not k for k in known):
                        v.assign(_in_pool(_numpy(v) * 0, collected))
            for v, value in saved:
                v.assign(_in_pool(value, collected))


def _in_pool(value, collected=None):
    """`value` (a numpy array) as a tensor in the pool, for a variable to take over. On
    TensorFlow a numpy array aligned to 64 bytes becomes a tensor on numpy's own memory,
    and a variable assigned it keeps that memory, outside the pool and the budget (after
    a restore, 4 of the zoo's wide MLP's 18.5 MiB of weights and optimizer state were);
    DeepCopy's output is the allocator's. Keras on PyTorch copies into the variable.
    Where the pool refuses the copy even after the cycle collector ran (at most once a
    restore: `collected`), the weights and optimizer state alone being near the budget (a
    variable's old buffer and its copy are live at once): a copy TensorFlow makes as it
    makes numpy values into tensors, which the pool grants over the budget (kind "input",
    never refused): the value from a buffer numpy placed off TensorFlow's 64-byte alignment,
    which TensorFlow cannot take over and copies. The state comes back whole, and mostly
    in the pool: in one CI run one 4 MiB variable restored so was not in the pool's account
    afterwards (not understood; benchmarks/NOTES.md). (A stateful LSTM of 3.2 M weights with Adam under 40 MiB: find_batch_size's
    restore was refused, and the error left the model half restored; the numpy array itself
    would have put 4 MiB of the zoo's wide MLP's state outside the pool.)"""
    from tf_memguard import _backend
    if _backend.framework() != "tensorflow":
        return value
    import tensorflow as tf
    for attempt in range(2):
        try:
            return tf.raw_ops.DeepCopy(x=tf.convert_to_tensor(value))
        except tf.errors.ResourceExhaustedError:
            if attempt or (collected is not None and collected):
                break
            # Tensors a failed step left to the cycle collector hold the room: after an
            # XLA step stopped over the budget (the zoo's wide MLP with jit_compile), the
            # copy fitted once they were collected.
            gc.collect()
            if collected is not None:
                collected.append(True)
    return tf.convert_to_tensor(_unaligned(value))


def _unaligned(value):
    """A copy of the numpy array `value` at an address that is not a multiple of 64 (nor
    of 16: off by 8 bytes, enough for any dtype's own alignment)."""
    import numpy as np
    value = np.asarray(value)
    buf = np.empty(value.nbytes + 72, dtype=np.uint8)
    start = (-buf.ctypes.data) % 64 + 8
    out = np.frombuffer(buf[start:start + value.nbytes].data, dtype=value.dtype).reshape(value.shape)
    out[...] = value
    return out
