"""The wrapper MemGuardCallback puts on model.train_function: an out-of-memory error of a
step, and TensorFlow's error for a constant the pool refused, get the callback's
explanation; any exception (Ctrl-C too) leaves nothing switched on. A wrapper left by a
run that ended without on_train_end is replaced, whichever callback made it. The running
fit()'s CallbackList is guarded too, so that an exception raised by another callback
(Ctrl-C landing in one, a callback's error) leaves nothing switched on either."""
import weakref

from tf_memguard import _recording
from tf_memguard._errors import budget_exceeded_error


def original(function):
    """The train function under any wrappers of ours."""
    while getattr(function, "_tf_memguard_original", None) is not None:
        function = function._tf_memguard_original
    return function


def wrap(model, callback):
    """Puts the wrapper on model.train_function for `callback`'s run; returns the function
    it wraps (None when the model has none yet)."""
    current = original(getattr(model, "train_function", None))
    if current is None:
        return None
    owner = weakref.ref(callback)
    run = callback._run_token

    def guarded(*args, **kwargs):
        cb = owner()
        if cb is None or cb._run_token is not run or _recording.in_own_steps():
            return current(*args, **kwargs)
        refusals = cb._pool.stats()["num_refusals"]
        try:
            return current(*args, **kwargs)
        except cb._oom_types as e:
            if not isinstance(e, budget_exceeded_error()):
                # The failed step's frames are done: drop their locals, which on PyTorch
                # hold its activations, so that the steps the advice runs, and the retry,
                # find the pool as a new step will.
                _recording.clear_chain(e)
                cb._explain_oom(e)
            raise
        except BaseException as e:
            if cb._explain_told(e, refused_here=cb._pool.stats()["num_refusals"] > refusals):
                # another worker's failure, arriving as another error
                raise
            cb._end_abruptly()
            message = cb._constant_refused(e, refusals)
            if message:
                raise budget_exceeded_error()("tf_memguard: " + message) from e
            raise

    guarded._tf_memguard_original = current
    model.train_function = guarded
    return current


# The CallbackList hooks fit() calls between steps (Keras 3's trainers).
_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_batch_begin", "on_train_batch_end")


def guard_callbacks(callback_list, callback):
    """Wraps the hooks of fit()'s CallbackList (an instance made for the one fit() call)
    so that any exception out of them ends `callback`'s run cleanly before it goes on."""
    if callback_list is None or not all(hasattr(callback_list, h) for h in _HOOKS):
        return
    owner = weakref.ref(callback)
    run = callback._run_token
    for name in _HOOKS:
        hook = getattr(callback_list, name)
        if getattr(hook, "_tf_memguard_guarded", False):
            continue

        def guarded(*args, _hook=hook, **kwargs):
            try:
                return _hook(*args, **kwargs)
            except BaseException:
                cb = owner()
                if cb is not None and cb._run_token is run:
                    cb._end_abruptly()
                raise

        guarded._tf_memguard_guarded = True
        setattr(callback_list, name, guarded)


def unwrap(model, wrapped):
    if wrapped is not None and getattr(model, "train_function", None) is not wrapped:
        model.train_function = wrapped
