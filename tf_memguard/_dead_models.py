"""What TensorFlow keeps of a model that is gone, let go when it goes.

Keras' optimizers on TensorFlow sum the gradients through tf.distribute's all_reduce
(keras/src/backend/tensorflow/optimizer.py, _all_reduce_sum_gradients), whose gradient
is a tf.custom_gradient. Traced into a train function, a custom gradient registers its
gradient function in TensorFlow's global gradient registry as "CustomGradient-<n>" and
never removes it (tensorflow/python/ops/custom_gradient.py, _graph_mode_decorator; two
entries per trace with TensorFlow 2.21). That function holds the traced graph, and the
graph's captures hold the model's variables: the weights and the optimizer's slots of
every model that was fit stayed in the pool after `del model`, gc.collect() and
keras.backend.clear_session() (15.2 MiB per model of a 1.3 M-parameter MLP with Adam; a
tuner's loop under 160 MiB ran out at its third model, 131.8 MiB held by the dead ones).
The entries a fit() added are dropped when it ends (MemGuardCallback's run, and the short
runs of find_batch_size and of the advice): the model's memory then goes with the model
(at the next gc.collect()). An entry is looked up only while a gradient through its op
is built, and in Keras' train step that is never (the gradients are taken before the
optimizer sums them): the traced function runs on without it, and every later trace
registers entries of its own. Waiting for the model's death instead left the graph to
a second gc.collect() (the model is freed in the first, and the graph, a reference cycle
the registry held, only then becomes garbage): a tuner's `del model; gc.collect()` kept it.
"""
from tf_memguard import _backend

_PREFIX = "CustomGradient-"


def _registry():
    """TensorFlow's gradient registry's dict (name -> entry), or None where it is not there
    (another framework, or a TensorFlow whose private layout differs: nothing is dropped)."""
    if _backend.framework() != "tensorflow":
        return None
    try:
        from tensorflow.python.framework import ops
        entries = ops._gradient_registry._registry
    except (ImportError, AttributeError):
        return None
    return entries if isinstance(entries, dict) else None


class Watch:
    """Registry entries added from its making to end(), dropped then."""

    def __init__(self):
        entries = _registry()
        self._before = None if entries is None else set(entries)

    def end(self):
        entries, before = _registry(), self._before
        self._before = None
        if entries is None or before is None:
            return
        for key in [k for k in list(entries) if isinstance(k, str) and k.startswith(_PREFIX) and k not in before]:
            entries.pop(key, None)
