"""What MemGuardCallback does when a run fails: an out-of-memory error explained (the
suggestion worked out from steps of its own once the failed fit()'s data is out of the
pool), a constant the pool refused turned into that error, a run over the budget through
requests that cannot be refused stopped, and anything left switched on put back."""
import gc
import warnings
import weakref

from tf_memguard import _advice, _after_oom, _backend, _core, _fit_args, _guard, _oom, _overshoot_check, _workers
from tf_memguard._errors import budget_exceeded_error
from tf_memguard._units import format_bytes

# After a failure and gc.collect(), the pool is back to what was in use before fit() to
# within this (the budget-integrity tests' bound): more means the failed fit()'s data is
# still held.
HELD_AFTER_FAILURE = 1 << 20
# Whether a run ended by an exception since the last collect_after_failure().
_failed = [False]


def collect_after_failure():
    """gc.collect() where a run ended by an exception since the last call: the failed
    fit()'s data (Keras' copy of the arrays, its prepared batches) stays in the pool until
    the exception's frames, a reference cycle, are collected, and a retry would hold both
    (the README's CNN with jit_compile=True under 48 MiB, stopped at 512: the first retry
    at 26 peaked at 37.3 and 49.9 MB in two processes without this, the failed run's
    12 MiB copy held beside its own in the second; 32.4, 19.9 and 32.4 MB in three with
    it; one at 27 in CI went 245 KiB over)."""
    if _failed[0]:
        _failed[0] = False
        gc.collect()


def _after_oom_resolver(callback):
    """The report's pending suggestion, worked out by `callback` on its model if the model
    still exists. The callback is held: one made inline (`callbacks=[MemGuardCallback()]`)
    has no other reference once fit() has raised, and with a weak one the report had no
    suggestion. The model is not: a report kept must not keep it alive, so the callback
    lets go of it too (Keras gives it the model again at its next fit())."""
    model, sampler = weakref.ref(callback.model), callback._sampler

    def resolve(report):
        m = model()
        if m is not None and callback._sampler is sampler:  # not a later run's
            callback._resolve_after_oom(report, m)
    return resolve



class FailureHandling:
    """MemGuardCallback's failure half (a mixin: it uses the callback's run state, _pool,
    _sampler, _start, _budget, _run_batch, _suggest() and _finish())."""

    def _unwrap_train_function(self):
        _guard.unwrap(self.model, getattr(self, "_wrapped", None))
        _guard.unwrap_calls(self.model)
        self._wrapped = None
        self._run_token = None

    def _end_abruptly(self):
        """A run ended by an exception (KeyboardInterrupt too): nothing stays switched on."""
        _failed[0] = True
        if self._sampler:
            self._sampler.train_end()
        _core.set_profile_batch(0)
        self._unwrap_train_function()

    def _constant_refused(self, error, refusals_before):
        """The note when TensorFlow could not build the step because the pool refused a
        constant ('Cannot parse tensor from proto'), else None."""
        if _backend.framework() != "tensorflow" or "Cannot parse tensor from proto" not in str(error):
            return None
        refusal = self._pool.last_refusal()
        if refusal is None or refusal["kind"] != "constant" or self._pool.stats()["num_refusals"] <= refusals_before:
            return None
        self._oom = _oom.constant_refused(self._device, refusal, self._suggestion, self._run_batch)
        self._tell_cluster()
        self._finish()
        return self._oom

    def _drop_traced_constants(self):
        """Drops the model's traced train function when constants were made for it during
        the run. With static shapes (train_on_batch, or a dataset batched with
        drop_remainder=True) Grappler folds batch-shaped zeros and ones into constants, which
        the trace holds for as long as it is cached: after an out-of-memory error at a large
        batch they would stay in the pool (117 MB of a 420 MiB budget on the zoo's resnet at
        888), taking memory from the retry. fit() traces the function again."""
        if _backend.framework() != "tensorflow" or self.model is None:
            return
        grew = self._pool.stats()["bytes_in_use_by_kind"]["constant"] - self._start["bytes_in_use_by_kind"]["constant"]
        if grew > 0 and getattr(self.model, "train_function", None) is not None:
            self.model.train_function = None

    def _tell_cluster(self):
        """In a multi-worker run, this worker's failure (self._oom) ends the others' steps."""
        if self._cluster is not None:
            if self._oom.endswith(_oom.RETRY):  # no retry in these processes
                self._oom = self._oom[:-len(_oom.RETRY)]
            self._cluster.tell_others(self._oom)
            self._oom += (" The other workers were told and stopped; TensorFlow's collectives cannot be used "
                          "again in these processes: restart the workers.")

    @staticmethod
    def _add_note(error, message):
        note = "tf_memguard: " + message
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # Python < 3.11
            error._message = f"{error.message}\n\n{note}"

    def _explain_told(self, error, refused_here=False, oom=False):
        """True, with the note, when `error` is another worker's failure told to this one
        (in its message, or, when this worker refused nothing, in the cluster's store)."""
        other = _workers.told(error)
        if other is None and self._cluster is not None and not refused_here and (
                oom or "ollective" in str(error)):  # not a Ctrl-C: that must not wait
            other = self._cluster.cluster.told_elsewhere()
        if other is None:
            return False
        self._end_abruptly()
        me = self._cluster.cluster.name if self._cluster is not None else "this worker"
        self._oom = f"{me} stopped because another worker ran out of memory: " + other[len("tf_memguard: "):]
        self._add_note(error, self._oom)
        self._finish()
        return True

    def _explain_oom(self, error):
        _failed[0] = True
        self._failed_error = _weak(error)
        refusal_now = self._pool.stats()["num_refusals"] > self._start["num_refusals"]
        if self._explain_told(error, refused_here=refusal_now, oom=True):  # another worker ran out first
            return
        if self._sampler:
            self._sampler.failed_step()
        _core.set_profile_batch(0)
        self._unwrap_train_function()
        self._drop_traced_constants()
        refusal = self._pool.last_refusal()
        ours = refusal is not None and self._start["num_refusals"] < self._pool.stats()["num_refusals"]
        suggestion = pending = None
        if not ours:
            message = _oom.not_in_the_pool(self._device, _backend.framework_name())
        else:
            if self._sampler and self._budget:
                # In a multi-worker run no step can run after the failure (its collectives
                # are aborted): the advice is what the steps recorded before it give.
                # (A model whose inputs fix the batch size runs no other: no steps.)
                if _after_oom.needs_steps(self._sampler) and self._cluster is None \
                        and _fit_args.fixed_batch_size(self.model) is None:
                    # Steps run now would meet the failed fit()'s data and batches, which
                    # the retry will not: the size is worked out when first read.
                    pending = _after_oom_resolver(self)
                elif self._cluster is None and _fit_args.fixed_batch_size(self.model) is None:
                    # No short runs: the recorded steps' model, the failed step beside it,
                    # RUN_SPREAD below the failed size; or no size (_after_oom.without_runs).
                    model = _after_oom.without_runs(self._sampler)
                    if model is not None:
                        suggestion = self._suggest(model, below=self._sampler.advice_cap() + 1)
                    if suggestion is not None and suggestion.fits_none and \
                            (self._sampler.template or self._sampler.first) is not None:
                        suggestion = None   # a step at the failed size completed: see without_runs
                else:
                    suggestion = self._suggest(below=self._sampler.advice_cap() + 1)
            if suggestion is not None or pending is None:
                # (None: no size is named now, and none stays from before the failure: an
                # earlier epoch's suggestion, at least the size that ran it, named the
                # size that was just refused.)
                self._suggestion = suggestion
            message = _oom.explain(self._device, refusal, suggestion, self._run_batch, deferred=pending is not None,
                                   dataset=self._sampler is not None and self._sampler.data.x is None,
                                   granted=_oom.granted_over(self._pool.stats(), self._start))
        self._oom = message
        self._tell_cluster()
        self._add_note(error, self._oom)
        self._finish(pending)
        if ours and pending is None and suggestion is None and self._sampler and self._budget and \
                self._report is not None:
            _no_size(self._report, self._run_batch)
        if pending is not None:
            self._model = None   # see _after_oom_resolver

    def _resolve_after_oom(self, report, keras_model):
        """Works out the suggestion after an out-of-memory error (report's pending fields)."""
        # Read after the except block, the failed fit()'s data is garbage in a reference
        # cycle (its frames) until a collection: its short runs must not meet it.
        gc.collect()
        held = self._pool.stats()["bytes_in_use"] - self._start["bytes_in_use"]
        # The failed fit()'s data is held while its error is: the error's traceback holds
        # fit()'s frames (inside the except block, or with the error kept in a variable).
        # The bytes alone say too much: the optimizer's slots can be made in the failed
        # step itself (Keras builds Adam's slots of zeros sharing one buffer until the first
        # update writes them; a model of 80 MiB of weights under 256 MiB held 94 MiB more
        # after the except block and gc.collect(), all of it the slots), and they stay.
        ref = getattr(self, "_failed_error", None)   # (None: the error took no weak reference)
        if held > HELD_AFTER_FAILURE and (ref is None or ref() is not None):
            warnings.warn(f"tf_memguard: the suggestion is read while the failed fit()'s error, and with it its data, "
                          f"is still held ({format_bytes(held)} more in use than before it: inside the except block, "
                          "or with the error kept in a variable): it is worked out with that memory taken, and may "
                          "be smaller than what fits; read it after the except block", stacklevel=4)
        suggestion = None
        try:
            model = self._sampler.model_after_oom(keras_model)
            if model is not None:
                suggestion = self._suggest(model, below=self._sampler.advice_cap() + 1,
                                           at_least=self._sampler.advice_floor())
        except Exception as e:  # noqa: BLE001 - reading the report must not fail
            warnings.warn(f"tf_memguard: no batch size could be worked out after the out-of-memory error "
                          f"({type(e).__name__}: {e})", stacklevel=4)
            model = None
        finally:
            self._sampler.train_end()
        if suggestion is not None and self._sampler.data.from_dataset:
            # A dataset made again from the same arrays while this one is referenced holds them twice.
            source = self._pool.stats().get("bytes_in_use_by_kind", {}).get("input", 0)
            suggestion = _advice.held_twice(suggestion, model, source)
        if suggestion is not None:
            self._suggestion = suggestion
        report.suggested_batch_size = suggestion.batch_size if suggestion else None
        report.suggestion_method = suggestion.method if suggestion else ""
        report.advice = _advice.advice_sentence(suggestion, self._run_batch) if suggestion else ""
        if report.advice and self._sampler.data.from_dataset and not suggestion.fits_none:
            dataset = self._sampler.data.dataset()
            report.advice += _advice.dataset_sentence(suggestion, dataset)
            del dataset
        elif suggestion is None and self._sampler.data.dataset_gone():
            report.advice = ("No batch size was worked out: the dataset given to fit() is gone (nothing kept a "
                             "reference to it), and its batches are what the short runs are made of. Keep it in a "
                             "variable for the suggestion.")
        elif suggestion is None:
            # (A generator, or runs that failed: the warnings say which.) The report must say why it names nothing.
            _no_size(report, self._run_batch)
        report.memory_model = model.to_dict() if model is not None else report.memory_model

    def _stop_for_overshoot(self, kind, stats):
        granted = stats["overshoot_bytes_by_kind"][kind] - self._start["overshoot_bytes_by_kind"][kind]
        steps = self._monitor.steps
        peak = steps[-1][1] if steps else 0   # the step's account at its peak
        self._over_counts[kind] = stats["overshoots_by_kind"][kind]
        self._end_abruptly()
        if self._sampler and self.model is not None:
            # Stopped after its first step, the run showed no second size: one step at half
            # the size, so that the blocks no batch tag marks (XLA's buffers) get their
            # slopes, rather than being taken as fixed below the size that ran. A dataset's
            # first batches are sampled for it first (else, with no arrays, no step ran, and
            # the README's CNN with jit_compile=True on a tf.data dataset under 48 MiB was
            # told that even a batch of 1 needs 354 MiB, where 27 trains).
            self._sampler.data.sample_dataset(self._sampler.b0)
            self._sampler.second_size(self.model)
        suggestion = self._suggest()
        if suggestion is not None and self.model is not None:
            suggestion = _overshoot_check.checked_below(self, suggestion, kind)
        if suggestion is not None:
            # The report names it too (report().suggested_batch_size), as the message does.
            self._suggestion = suggestion
        self._oom = _oom.overshoot_stop(self._device, kind, granted, peak, self._budget, self._monitor.global_step,
                                        suggestion, self._run_batch)
        self._tell_cluster()
        self._finish()
        raise budget_exceeded_error()("tf_memguard: " + self._oom)


def _weak(error):
    """A weak reference to `error`, or None where its type takes none."""
    try:
        return weakref.ref(error)
    except TypeError:
        return None


def _no_size(report, running):
    """`report` says that no batch size was worked out after the out-of-memory error, and why."""
    report.advice = (f"No batch size was worked out after the out-of-memory error: no short run of fit() at a smaller "
                     f"size completed on this data (arrays or tensors, or a sample of a tf.data dataset's or a "
                     f"PyDataset's batches, can be run at other sizes; a generator cannot), and the steps recorded at "
                     f"one size do not tell which smaller size fits. Reduce the batch size (now {running}).")
    report.suggestion_method = "none: no short run of fit() completed after the out-of-memory error"
