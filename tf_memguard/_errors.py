"""BudgetExceededError: made on first use as a subclass of the backend's out-of-memory error,
so that importing tf_memguard imports neither TensorFlow nor PyTorch."""
from tf_memguard import _backend

_made = {}

DOC = """A step went over the budget without the framework raising: requests that cannot be
    refused (XLA's buffers, oneDNN's kernels) were granted over it, so MemGuardCallback
    stopped the run after that step; or TensorFlow could not build the step because a
    constant did not fit. A subclass of the backend's out-of-memory error
    (tf.errors.ResourceExhaustedError, torch.OutOfMemoryError, jax.errors.JaxRuntimeError), so
    its handlers catch it. On JAX also: a step whose compiled size is over the budget, refused
    before it ran."""


def budget_exceeded_error():
    framework = _backend.framework()
    if framework not in _made:
        base = _backend.oom_errors()[0]

        def __init__(self, message):
            if framework in ("torch", "jax"):
                base.__init__(self, message)
            else:
                base.__init__(self, None, None, message)

        _made[framework] = type("BudgetExceededError", (base,),
                                {"__init__": __init__, "__module__": "tf_memguard", "__doc__": DOC})
    return _made[framework]
