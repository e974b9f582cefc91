"""The wrapper MemGuardCallback puts on model.train_function: an out-of-memory error of a
step, and TensorFlow's error for a constant the pool refused, get the callback's
explanation; any exception (Ctrl-C too) leaves nothing switched on. A wrapper left by a
run that ended without on_train_end is replaced, whichever callback made it. The running
fit()'s CallbackList is guarded too, so that an exception raised by another callback
(Ctrl-C landing in one, a callback's error) leaves nothing switched on either; and the
evaluate() and predict() a callback calls inside fit() get the callback's evaluation guard."""
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
            # The call returned: the refused step has unwound. Without this, requests that
            # do not fit are refused at once (the pool's failed episode, free_wait.h) until
            # none was refused for the wait time, and a retry begun within it runs without
            # waits: keras.io's timeseries autoencoder under 48 MiB, retried right after
            # its OOM at the report's 101-104, ran out 3 of 3 with no request waiting, and
            # trained 2 of 2 three seconds later (benchmarks/NOTES.md).
            cb._pool.end_failed_wait()
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


# evaluate() and predict() called inside fit() by a callback (a test set evaluated at each
# epoch's end, images predicted for a log): their CallbackLists do not hold
# MemGuardCallback, so its evaluation guard (_inference) would not see their steps, and an
# out-of-memory error of theirs left fit() with no note, no report and no size (a CNN's
# evaluate(batch_size=512) in on_epoch_end under 128 MiB). During the run the model's
# evaluate and predict give such a call a forwarder to the callback's hooks. fit()'s own
# validation passes _use_cached_eval_dataset=True, and its CallbackList holds the callback.
_CALLBACKS_POSITION = {"evaluate": 6, "predict": 4}   # the index of `callbacks` among the arguments


def wrap_calls(model, callback):
    owner = weakref.ref(callback)
    run = callback._run_token
    for name in _CALLBACKS_POSITION:
        current = getattr(model, name, None)
        if current is None or getattr(current, "_tf_memguard_nested", False):
            continue

        def nested_call(*args, _call=current, _name=name, **kwargs):
            cb = owner()
            given = kwargs.get("callbacks")
            if cb is None or cb._run_token is not run or kwargs.get("_use_cached_eval_dataset") or \
                    _recording.in_own_steps() or len(args) > _CALLBACKS_POSITION[_name] or \
                    not isinstance(given, (list, tuple, type(None))):
                return _call(*args, **kwargs)
            kwargs["callbacks"] = list(given or []) + [_forwarder(cb)]
            return _call(*args, **kwargs)

        nested_call._tf_memguard_nested = True
        setattr(model, name, nested_call)


def unwrap_calls(model):
    for name in _CALLBACKS_POSITION:
        if model is not None and getattr(vars(model).get(name), "_tf_memguard_nested", False):
            delattr(model, name)


def _forwarder(callback):
    """A Keras callback that passes a nested call's begin and end to `callback`."""
    import keras

    class NestedCall(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            callback._nested_begin("test")

        def on_test_end(self, logs=None):
            callback._nested_end("test")

        def on_predict_begin(self, logs=None):
            callback._nested_begin("predict")

        def on_predict_end(self, logs=None):
            callback._nested_end("predict")

    return NestedCall()
