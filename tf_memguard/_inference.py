"""Out-of-memory errors in evaluation steps: fit()'s validation, evaluate() and predict()
with MemGuardCallback among their callbacks.

The error gets the note a training step's gets (the request, the budget, what holds it,
the largest free block), which step ran out and at which batch size argument, and the
largest batch size of that step that fits. That size is found by evaluation steps of
its own (test_on_batch / predict_on_batch on the first samples of the same arrays), run
before the error leaves the call, with Keras' copies of the data still in the pool as the
retry will hold them; a step's peak counts with room for what such a step does not meet
(the batches the pipeline prepares ahead) and for the kernels' orders; where the failed
call's own batches left no room for larger steps, the largest that completed, scaled,
names the size for the retry (largest_that_fits). A fit() whose validation failed ends as after a failed training
step (nothing left switched on, its report made), and the model's cached validation
iterator, which held the failed step's batch until the next fit(), is dropped
(drop_validation_iterator)."""
import gc
import weakref

from tf_memguard import _backend, _fit_args, _install, _oom, _recording
from tf_memguard._errors import budget_exceeded_error
from tf_memguard._failures import HELD_AFTER_FAILURE, FailureHandling
from tf_memguard._memory_model import LAYOUT_SLACK, RUN_SPREAD
from tf_memguard._monitor import account, step_growth
from tf_memguard._units import format_bytes

# Evaluation steps run at most to find a size that fits. From the failed size, halving
# reaches one that fits within log2(failed / fitting) steps (two for a quarter), and the
# rest bisect upwards: each bisection step halves the distance to the largest size that
# fits, so four of them end within 1/16 of the first size that completed.
CHECK_STEPS = 6

# Batches Keras' pipeline for arrays can hold beyond the one a step is given: it maps the
# slicing of batches with num_parallel_calls=AUTOTUNE (up to one batch in flight per core,
# TensorFlow's MaxParallelism) and prefetches with AUTOTUNE. Measured on 2 cores, predict()
# on a model whose step takes no time (global pooling): 4.0-4.1 batches beyond the
# current one at 32, 128 and 311 of 2,048 samples, all 4 of the epoch at 512. With 3 (the
# count fit()'s steps met on the README's CNN, _step_data), a predict() at the 311 named
# ran out in 1 of 8 runs. Two per core, bounded by the batches the call has left.
def prepared_batches(left):
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(2 * cores, left))


# Keras' trainer method of each phase, the function it calls per step, the callback hooks.
_PHASES = {"test": ("evaluate", "test_function"), "predict": ("predict", "predict_function")}


class EvaluationGuard:
    """MemGuardCallback's evaluation half (a mixin: it uses the callback's device, and
    during fit() its run state, _active, _run_token, _end_abruptly(), _finish())."""

    def on_test_begin(self, logs=None):
        self._evaluation_begin("test")

    def on_test_end(self, logs=None):
        self._evaluation_end("test")

    def on_predict_begin(self, logs=None):
        self._evaluation_begin("predict")

    def on_predict_end(self, logs=None):
        self._evaluation_end("predict")

    def _nested_begin(self, phase):
        """An evaluate() or predict() a callback called inside fit() (_guard.wrap_calls)."""
        self._nested_phase = phase
        self._evaluation_begin(phase)

    def _nested_end(self, phase):
        self._evaluation_end(phase)
        self._nested_phase = None

    def _evaluation_begin(self, phase):
        if _backend.framework() == "jax" or self.model is None:
            return   # (Keras' JAX backend: XLA's cap, no pool to ask)
        device = _install.resolve_device(self.device)
        if _install.not_serving(device) is not None:
            return
        attribute = _PHASES[phase][1]
        current = getattr(self.model, attribute, None)
        if current is None or getattr(current, "_tf_memguard_original", None) is not None:
            return
        owner, pool, oom_types = weakref.ref(self), _install.device_pool(device), _backend.oom_errors()
        checking = []   # truthy while this guard's own steps run
        start = account(pool.stats())   # Keras' copies of the data are made before this hook

        def explained(call, *args, **kwargs):
            """call(*args, **kwargs), its error explained where the pool refused a request."""
            cb = owner()
            if cb is None or checking:
                return call(*args, **kwargs)
            refusals = pool.stats()["num_refusals"]
            try:
                return call(*args, **kwargs)
            except BaseException as e:
                refusal = pool.last_refusal() if pool.stats()["num_refusals"] > refusals else None
                constant = refusal is not None and refusal["kind"] == "constant" and \
                    "Cannot parse tensor from proto" in str(e)
                if refusal is None or not (isinstance(e, oom_types) or constant):
                    raise   # (not the budget's refusal)
                pool.end_failed_wait()   # the call returned: its step has unwound (_guard)
                _recording.clear_chain(e)
                checking.append(True)
                try:
                    note = cb._explain_evaluation_oom(e, phase, device, pool, start)
                finally:
                    checking.clear()
                if constant:
                    # TensorFlow could not build the step: a constant the pool refused.
                    raise budget_exceeded_error()("tf_memguard: " + note) from e
                raise

        def guarded(*args, **kwargs):
            return explained(current, *args, **kwargs)

        guarded._tf_memguard_original = current
        setattr(self.model, attribute, guarded)
        # Keras makes the call's iterator over its batches in Python, outside the step's
        # function: where the budget was full its creation was refused ("OOM when allocating
        # tensor with shape[] and type resource", AnonymousIteratorV3), and the error left
        # without a note (an evaluate() a callback called inside fit(), beside fit()'s copy
        # of its arrays). The iterator is made through `explained`.
        # predict() also takes each batch from tf.data in Python, outside predict_function:
        # a batch the pool refuses is refused there (at 2,048 64x64 images under 384 MiB,
        # the gather that slices it). After a failure the wrapper lets go of tf.data's
        # iterator, and with it the batches prepared ahead (two of the three batches of
        # 1,057 64x64 images held while the size was looked for, 99 of 149 MiB).
        epochs = _fit_args.call_arguments(_PHASES[phase][0]).get("epoch_iterator")
        batches = getattr(epochs, "_get_iterator", None)
        if batches is not None and "_get_iterator" not in vars(epochs):
            if phase == "predict":
                def wrapped():
                    iterator = _Explained(batches(), explained)
                    made.append(weakref.ref(iterator))
                    return iterator
                made = []
                self._predict_batches = made
            else:   # (the test function takes the iterator itself, and its batches in its graph)
                def wrapped():
                    return _MadeExplained(batches(), explained)
            epochs._get_iterator = wrapped

    def _evaluation_end(self, phase):
        if self.model is None:
            return
        epochs = _fit_args.call_arguments(_PHASES[phase][0]).get("epoch_iterator")
        if epochs is not None and "_get_iterator" in vars(epochs):
            del epochs._get_iterator
        attribute = _PHASES[phase][1]
        current = getattr(self.model, attribute, None)
        original = getattr(current, "_tf_memguard_original", None)
        if original is not None:
            setattr(self.model, attribute, original)

    def _explain_evaluation_oom(self, error, phase, device, pool, start):
        """Adds the note to `error`, raised by an evaluation step (`start`: the bytes in use
        when the call's steps began), and returns it; in fit(), ends its run."""
        refusal = pool.last_refusal()
        method_name = _PHASES[phase][0]
        args = _fit_args.call_arguments(method_name)
        running_fit = bool(_fit_args.fit_arguments()) and getattr(self, "_run_token", None) is not None and \
            getattr(self, "_active", False)
        nested = running_fit and getattr(self, "_nested_phase", None) == phase
        in_fit = phase == "test" and running_fit and not nested   # fit()'s own validation
        if in_fit:
            call, argument = "fit()'s validation", "validation_batch_size"
        elif nested:
            call, argument = f"the {method_name}() a callback called inside fit()", "batch_size"
        else:
            call, argument = f"{method_name}()", "batch_size"
        x, y, weights = args.get("x"), args.get("y"), args.get("sample_weight")
        arrays = _fit_args.is_arrays(x) or _fit_args.is_sliceable(x)
        if arrays:
            n = _fit_args.num_samples(x)
            running = min(args.get("batch_size") or 32, n)   # Keras' default of 32
        else:
            running = _fit_args.dataset_batch_size(x) if _fit_args.is_dataset(x) else None
        self._evaluation_end(phase)
        if phase == "predict":
            for ref in getattr(self, "_predict_batches", None) or []:
                if ref() is not None:
                    ref().release()
        if in_fit or nested:
            self._monitor.hold_window()   # the validation's peak is the run's
        if arrays and running:
            try:
                size, method = largest_that_fits(self.model, phase, (x, y, weights), running, pool, start)
            except Exception as e:  # noqa: BLE001 - the explanation must not replace the error
                size, method = None, f"no size could be worked out: {type(e).__name__}: {e}"
        elif _fit_args.is_dataset(x):
            argument = "." + _fit_args.dataset_batch_method(x)
            size, method = None, "no step of another size can be taken from a dataset's batches"
        else:
            size, method = None, ("no step of another size can be taken from a generator or PyDataset: make its "
                                  "batches smaller")
        note = _oom.evaluation(device, refusal, call, argument, running, size, method, by_callback=nested)
        if in_fit or nested:   # the fit() ends with this error
            self._end_abruptly()
            drop_validation_iterator(self.model)
            self._oom = note
            self._finish()
        FailureHandling._add_note(error, note)
        return note


class _Explained:
    """An iterator of batches whose next() goes through `explained` (see above)."""

    def __init__(self, batches, explained):
        self._batches, self._explained = explained(iter, batches), explained

    def __iter__(self):
        return self

    def __next__(self):
        if self._batches is None:
            raise StopIteration
        return self._explained(next, self._batches)

    def release(self):
        """Lets go of the iterator (after its call failed: nothing takes from it again)."""
        self._batches = None


class _MadeExplained:
    """Batches whose iterator is made through `explained` (see above)."""

    def __init__(self, batches, explained):
        self._batches, self._explained = batches, explained

    def __iter__(self):
        return self._explained(iter, self._batches)


def drop_validation_iterator(model):
    """Drops the validation iterator Keras keeps on the model from a fit()'s first
    evaluation until the next fit() starts: after fit()'s validation failed, it held the
    failed step's batch (24 MiB of a 160 MiB budget: 2,048 32x32 images)."""
    if model is not None and getattr(model, "_eval_epoch_iterator", None) is not None:
        model._eval_epoch_iterator = None


def largest_that_fits(model, phase, data, failed, pool, start):
    """(size, method): the largest batch size below `failed` (a size whose step was
    refused) whose evaluation step, on the first samples of `data` (x, y, sample_weight),
    completed here and fits the call as it runs (0 when none of those tried did), and how
    it was found. `start`: the bytes in use when the failed call's steps began. Where
    steps ran out beside what the failed call still holds (more than HELD_AFTER_FAILURE),
    the size is the one its largest completed step, scaled, fits once that is freed, as
    the retry after the except block meets it (_after_release): on a 64x64 CNN under 384
    MiB whose validation failed at 2,048 with 96 MiB held, 20 completed beside it, 120 was
    named, and 135 trains.

    The steps run while the failed call still holds what it made beyond `start` (its
    failed batch, the batches prepared ahead at its size, predict()'s outputs so far: the
    retry will not, and the step's peak is taken without them), and a step's peak counts
    with what the call holds beside it that such a step does not meet:
    - the batches Keras' pipeline prepares ahead (prepared_batches), at most as many as
      the call has after the current one, on TensorFlow, where they are in the pool
      (fit()'s CNN validated on 2,048 32x32 images under 160 MiB at
      validation_batch_size=2048: a step of its own at 668 completed, and the retry's
      validation at 668 ran out, 20.9 MiB refused at 145 MiB in use);
    - predict()'s outputs of the batches before it, which Keras keeps in the pool until its
      end (TensorFlow then concatenates them there, into as much again);
    - RUN_SPREAD of what the step grew by: its peak moves with the order its kernels run
      in by up to that share from step to step, and one step is one draw of it
      (_memory_model.RUN_SPREAD), and LAYOUT_SLACK of the budget, for the layout;
    and a size is tried at most RUN_SPREAD below one that ran out, for the same reason."""
    x, y, weights = data
    oom_types = _backend.oom_errors()
    # On Keras' torch backend the batches are prepared on the host and moved to the GPU in
    # the step, and predict()'s outputs are concatenated on the host.
    torch = _backend.framework() == "torch"
    n = _fit_args.num_samples(x)
    leaves = [a for d in (x, y, weights) if d is not None for a in keras_leaves(d)]
    per_sample = sum(_fit_args.fed_nbytes(a) / max(1, int(a.shape[0])) for a in leaves)
    budget = pool.stats()["bytes_limit"] * (1 - LAYOUT_SLACK)

    per_output = [0.0]   # predict()'s output bytes per sample, once a step has shown them

    def completes(size):
        head = [None if d is None else _fit_args.first_samples(d, size) for d in (x, y, weights)]

        def step():
            if phase == "test":
                model.test_on_batch(*head)
                return 0
            out = model.predict_on_batch(head[0])
            return sum(int(getattr(a, "nbytes", 0)) for a in keras_leaves(out)) / size
        ran_out_from[size] = account(pool.stats())
        try:
            outputs, grew[size], took[size] = step_growth(pool, step)
        except Exception as e:  # noqa: BLE001
            if not (isinstance(e, oom_types) or "Cannot parse tensor from proto" in str(e)):  # (a constant refused)
                raise
            # The step returned: the next size's requests wait again at once, not refused
            # within this one's failed episode (free_wait.h).
            pool.end_failed_wait()
            _recording.clear_chain(e)
            del e
            # What the step made before it ran out can sit in reference cycles with the
            # error's frames; collected later, during the next step, it would hide part
            # of that step's growth (step_growth counts it, the collection frees it now).
            gc.collect()
            return False
        del ran_out_from[size]
        per_output[0] = outputs
        if need_at(size, grew[size]):
            return True
        no_room.append(size)
        return False

    def need_at(size, growth):
        """True when a step at `size` that grows by `growth` bytes fits the call as it
        runs once only what was in use at its start is: the step, RUN_SPREAD of its
        growth, the batches prepared ahead, predict()'s outputs."""
        prepared = 0 if torch else prepared_batches(-(-n // size) - 1) * size * per_sample
        outputs = per_output[0]
        need = start + growth * (1 + RUN_SPREAD) + prepared + (n - size) * outputs
        return need <= budget and start + (1 if torch else 2) * n * outputs <= budget

    fits, refused, grew, took, no_room, ran_out_from = 0, [failed], {}, {}, [], {}
    split = _fit_args.replicas(model)   # a strategy's replicas: only their multiples run (_fit_args.runnable)
    for _ in range(CHECK_STEPS):
        below = int(min(refused) / (1 + RUN_SPREAD))
        size = below // 2 if not fits else (fits + below + 1) // 2
        size = min(size, below)
        size = _fit_args.round_down(size, split)
        if size <= fits or size < 1:
            break
        if completes(size):
            fits = size
        else:
            refused.append(size)
    held = max(0, account(pool.stats()) - start)
    pool.reset_peak()
    if phase == "test":
        model.reset_metrics()
    tried = ", ".join(str(s) for s in sorted(refused[1:], reverse=True))
    predicted = 0
    # Not from a step that completed only after refusals (above): scaled, it would name
    # too large a size.
    # Nor where a step that ran out beside the held data would have fitted beside it by
    # the same line: the line is then too low (a step at a new batch shape does more than
    # its tensors: steps of a convolutional autoencoder at 2 to 1,911 all ran out near 60
    # of 64 MiB, the step at 1 grew by 349 KiB, and 96, scaled from it, ran out).
    limit = pool.stats()["bytes_limit"]
    line_fails = any(before + grew[fits] * s / fits <= limit for s, before in ran_out_from.items()) if fits else True
    if fits and tried and held > HELD_AFTER_FAILURE and not took[fits] and not line_fails:
        # (below a size whose step completed and left no room: it is measured, not scaled)
        predicted = _after_release(fits, grew[fits], need_at, min([int(failed / (1 + RUN_SPREAD))] +
                                                                  [s - 1 for s in no_room]))
        predicted = _fit_args.round_down(predicted, split)
    if predicted > fits:
        return predicted, (f"the step at {fits} (it grew by {format_bytes(grew[fits])}), which completed here with "
                           "the failed call's data still in the pool "
                           f"({format_bytes(held)}), taken as proportional to the batch size, with room for the "
                           f"batches prepared ahead and the kernels' orders, once that data is freed (steps at {tried} "
                           "ran out or left no such room beside it)")
    if fits:
        return fits, (f"a step at {fits} completed here with the failed call's data still in the pool, with room "
                      "for the batches prepared ahead and the kernels' orders" +
                      (f" (steps at {tried} ran out or left no such room" +
                       ("; some of them may fit once that data is freed)" if held > HELD_AFTER_FAILURE else ")")
                       if tried else "") +
                      (f"; {took[fits]} of its requests were refused and the framework fell back to kernels that "
                       "need less, so it is not scaled" if took[fits] else ""))
    return 0, (f"steps at {tried or 'smaller sizes'} ran out too or left no room for the batches prepared ahead, "
               "with the failed call's data still in the pool; after the except block and gc.collect() a smaller "
               "size may fit")


def _after_release(size, grew, need_at, below):
    """The largest batch size up to `below` whose step fits once the failed call's data is
    freed, by the step at `size` that completed beside it, which grew by `grew` bytes: each
    block of that step taken as proportional to the batch size (the bound of the two a
    step at one size allows that needs more above it: a block of fixed size, as a kernel's
    workspace, scaled with the rest), `need_at(b, grew_b)` the room a step at b needs with
    it. 0 when none above `size` fits so."""
    lo, hi = size, below + 1   # need_at(lo) fits; find the largest b < hi that does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need_at(mid, grew * mid / size):
            lo = mid
        else:
            hi = mid
    return lo if lo > size else 0


def keras_leaves(data):
    import keras
    return [a for a in keras.tree.flatten(data) if a is not None]
