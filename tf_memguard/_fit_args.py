"""What the running fit() was given: Keras does not hand callbacks the batch size or the
data, but fit()'s own frame has them."""
import inspect
import numbers


def fit_arguments():
    """The arguments of the Keras fit() call running now (its frame's locals), or {}."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            code = frame.f_code
            if code.co_name == "fit" and "keras" in code.co_filename.replace("\\", "/"):
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


def batch_size(fit_args):
    """fit()'s batch size: its argument for arrays (Keras' default of 32 when None), else a
    tf.data dataset's static batch dimension, else None."""
    import keras
    x = fit_args.get("x")
    if is_arrays(x):
        return fit_args.get("batch_size") or 32
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        dims = {leaf.shape[0] for leaf in keras.tree.flatten(spec) if getattr(leaf, "shape", None) is not None
                and len(leaf.shape) > 0 and leaf.shape[0] is not None}
        if len(dims) == 1:
            return int(dims.pop())
    return None


def training_samples(fit_args):
    """The samples fit() trains on, for arrays (after validation_split, as Keras splits:
    ceil(n * (1 - split))), else None."""
    import keras
    x = fit_args.get("x")
    if not is_arrays(x):
        return None
    n = min(len(a) for a in keras.tree.flatten(x))
    split = fit_args.get("validation_split") or 0.0
    if split and fit_args.get("validation_data") is None:
        n = int(-(-n * (1.0 - split) // 1))
    return n


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
