"""Which training steps the memory model is made from, and the model they make.

In a run of fit() at batch size b0 (see MemGuardCallback):
- the template: of the full steps of the first two epochs, the one that peaked highest
  (the first step, which traces the function, is one: a run at another batch size traces
  it again), recorded whole (the blocks live at its start, its events). Which
  of fit()'s prepared batches meet a step's peak, and in which order TensorFlow's threads
  run the step's kernels, differ from step to step; the highest of them is what the model
  must hold, each of its blocks then scaled on its own line. The batch size is profiled
  from each epoch's start, so that the batches tf.data prepares ahead are tagged too. The
  second epoch counts because it can run another trace of the step (TensorFlow traces it
  again for the epoch's partial last batch, with an unknown batch dimension) and holds
  what the first epoch's end made (the validation data's copy);
- the second size: the first epoch's partial last batch when there is one of a useful
  size (a step fit() runs anyway), else a short fit() of its own at b0 // 2 on the first
  samples of the arrays (its second step recorded, the model restored exactly). It tells
  which untagged blocks change with the batch, and which tagged ones stop growing
  (workspaces TensorFlow caps). With b0 dividing the samples, the run's steps have a
  known batch dimension; the short fit()'s last batch is partial, so its steps stand for
  the sizes that do not divide them (another trace, an unknown batch dimension).
After an out-of-memory error: the failed step up to its refusal (the first step of the
retry must fit too), and, once the failed fit()'s data is out of the pool, short fit()
runs of its own on all the samples at smaller sizes (down by DESCENT to one that
completes, then at most ASCENT_RUNS up).
"""
import warnings

from tf_memguard import _backend, _core, _recording
from tf_memguard._memory_model import StepModel, StepModels

# The smallest partial last batch used as the second size, as a share of b0: below that,
# block sizes are too near the granule (and TensorFlow's kernels pick other algorithms
# for tiny batches) for a line through two points to be worth more than the bounds.
MIN_PARTIAL = 1 / 8
# Epochs whose steps are candidates for the template.
RECORDED_EPOCHS = 2
# Batches of data a short fit() of its own is given: tf.data's autotuned map and prefetch
# held three prepared batches at every step's start in the runs measured (the README's
# CNN, 2 cores), and the recorded step must find the pipeline as full as a long run's
# (with four, the README's CNN's step was recorded with fewer, and 237 was suggested
# where 233 ran out; with eight, 223-229).
NESTED_BATCHES = 8
# Short fit() runs of its own per run for the second size (after an OOM: DESCENT and
# ASCENT_RUNS).
MAX_NESTED_RUNS = 4
# After an OOM at b0 the runs go down from b0 // 2 by this factor until one completes:
# each refused one costs a step up to its refusal, and the largest that completes is then
# within this factor of the limit, close enough for the model of its step to say where the
# limit is (from a batch of 1, the old last resort below b0 // 8, EfficientNetB0's model
# named 9 where 32 trained).
DESCENT = 4
# Runs after an OOM that go up from the size that completed, the model's size then halfway.
ASCENT_RUNS = 3


class StepSampler:
    """Records the steps of one fit() run and makes the StepModel of its training step."""

    def __init__(self, pool, batch_size, n_samples=None, steps_per_epoch=None, x=None, y=None, own_epochs=True):
        self.pool = pool
        self.b0 = int(batch_size)
        self.n = n_samples
        self.x, self.y = x, y
        self.steps = steps_per_epoch
        self.recorder = _recording.StepRecorder(pool)
        self.tf = _backend.framework() == "tensorflow"
        # What bounds the batches tf.data prepares ahead: the epoch over the arrays, when
        # fit() makes one of its own per epoch (no steps_per_epoch given).
        self.epoch = _recording.epoch_of(x, y, n_samples) if self.tf and own_epochs and x is not None else None
        # Keras' pipeline has batches of a known size only when b0 divides the samples: then
        # the recorded steps run the trace with a known batch dimension ("static"), and a
        # lone step (whose new size makes TensorFlow trace the step again, relaxed to an
        # unknown batch dimension) stands for the sizes that do not divide them.
        self.static = self.tf and bool(n_samples) and n_samples % self.b0 == 0
        self.lone = None
        self.template = None      # the steady steps' (the highest of them)
        self.template_peak = -1
        self.first = None         # the run's first step (it traces the step's function)
        self.other = None
        self.prefix = None        # the step refused partway, if one was
        self.partial = None
        if n_samples and steps_per_epoch and n_samples % self.b0:
            last = n_samples - (steps_per_epoch - 1) * self.b0
            if 0 < last < self.b0:
                self.partial = last
        self._recording = None    # "first", "template" or "other", while a step is recorded
        self._nested_runs = 0
        self._model = None
        self.too_large = 1 << 62  # the smallest batch size known not to fit
        self.cap = 1 << 62        # the largest the advice may name (model_after_oom)
        self.after_oom = []       # the sizes of the short fit() runs after an OOM that completed
        self.prepared = 0         # the most batch-tagged bytes live at a step's start at b0

    # -- fit()'s hooks -----------------------------------------------------------------

    def epoch_begin(self, epoch):
        if epoch < RECORDED_EPOCHS:
            self._profile(self.b0)

    def _last_step(self, step):
        return self.steps is not None and step == self.steps - 1

    def step_begin(self, epoch, step):
        if epoch >= RECORDED_EPOCHS:
            return
        which = None
        if self.partial and self._last_step(step):
            if epoch == 0 and self.other is None and self.partial >= max(2, MIN_PARTIAL * self.b0):
                which = "other"
        elif epoch == 0 and step == 0:
            which = "first"
        else:
            which = "template"
        if which is None:
            return
        if which != "other":
            # What tf.data has prepared ahead (batch-tagged bytes live as a step begins at
            # b0): its autotuned buffers fill as they can, so the template may have met
            # fewer prepared batches than the pipeline holds at other steps.
            self.prepared = max(self.prepared, int(self.pool.stats()["batch_bytes_in_use"]))
        size = self.partial if which == "other" else self.b0
        self._profile(size)
        self._recording = which
        self.recorder.begin(size)

    def step_end(self, epoch, step):
        if self._recording is None:
            return
        which, self._recording = self._recording, None
        if which == "template":
            peak = self.pool.stats()["window_peak_bytes_in_use"]
            if peak <= self.template_peak:
                self.recorder.abort()
                return
            trace = self.recorder.end(True)
            if trace is not None:
                self.template, self.template_peak = trace, peak
                self._model = None
        elif which == "other":
            trace = self.recorder.end(True)
            if trace is not None:
                self.other = trace
                self._model = None
            self._profile(self.b0)
        else:
            trace = self.recorder.end(True)
            if trace is not None:
                self.first = trace
                self._model = None

    def epoch_end(self, epoch, model):
        """After the first epoch: the second size, if fit() ran none and it matters."""
        self._profile(0)
        self.recorder.abort()
        if epoch == 0 and (self.template or self.first) is not None and self.other is None and self.b0 > 1:
            self.lone = self._nested(model, max(1, self.b0 // 2))
            self.other = self.lone if self.lone is not None and self.lone.complete else None
            self._model = None

    def train_end(self):
        self.recorder.abort()
        self._recording = None
        self._profile(0)

    def failed_step(self):
        """The step being recorded when an out-of-memory error ended it (a prefix), or None.
        The running batch size is known not to fit from now on."""
        self.too_large = min(self.too_large, self.b0)
        if self._recording is None:
            return None
        trace = self.recorder.end(False)
        self._recording = None
        self._profile(0)
        if trace is not None:
            self.prefix = trace
            self._model = None
        return trace

    def _profile(self, size):
        if self.tf:
            _core.set_profile_batch(size)

    def _nested(self, model, size, all_samples=False):
        """A short fit() of its own at `size` (its second step recorded). By default on
        enough of the first samples for its pipeline to fill (NESTED_BATCHES batches and
        one sample more, so that the last batch is partial and the step runs the trace for
        an unknown batch dimension), its own copy of them left out of the blocks live at
        the start (the run's full copy stands for the retry's). With `all_samples`, on all
        of them, as a retry would run: its copy is the retry's (model_after_oom's runs, which
        its own loops bound, not MAX_NESTED_RUNS). None when it could not be recorded."""
        if self.x is None or (not all_samples and self._nested_runs >= MAX_NESTED_RUNS):
            return None
        self._nested_runs += 1
        samples = None if all_samples else min(self.n or NESTED_BATCHES * size + 1, NESTED_BATCHES * size + 1)
        try:
            trace = _recording.fit_steps(model, self.x, self.y, size, self.recorder, samples=samples)
        except Exception as e:  # noqa: BLE001 - the model of the step must never stop the training
            warnings.warn(f"tf_memguard: steps at batch size {size} for the memory model failed "
                          f"({type(e).__name__}: {e}); the advice uses what was recorded", stacklevel=3)
            return None
        finally:
            self.pool.reset_peak()
        if trace is None or all_samples:
            return trace
        align = int(trace.layout.get("alignment", 64))
        return _recording.without_blocks(trace, self._batch_sizes(samples, align), kind="input")

    # -- the model ---------------------------------------------------------------------

    def model(self, observed_peak=0):
        """The StepModel from the steps recorded (None before a complete step), with the
        spread from `observed_peak` (the highest step peak fit() showed at b0)."""
        if self._model is None and (self.template is not None or self.first is not None):
            steady = StepModel.build(self.template, self.other, observed_peak=observed_peak or None,
                                     extra_start=self._unmet_prepared(self.template), epoch=self.epoch) \
                if self.template is not None else None
            # (Not the first step's: a run's first step meets the pipeline as it starts.)
            first = StepModel.build(self.first, self.other, first=True, epoch=self.epoch) \
                if self.first is not None else None
            domain = "static" if self.static else "all"
            models, domains = [steady, first], [domain, domain]
            start = self.template or self.first
            if self.static and self.lone is not None and self.lone.complete:
                # The other trace: the short fit()'s step, for the sizes that do not divide
                # the samples.
                models.append(StepModel.build(self.lone, start, epoch=self.epoch))
                domains.append("dynamic")
            self._model = StepModels(models, domains, samples=self.n if self.tf else None)
        return self._model

    def _unmet_prepared(self, trace):
        """The batches prepared ahead that other steps at b0 met and `trace` did not (see
        _recording.unmet_prepared), or None. On the zoo's wide MLP the step that peaked
        highest once began with none of the three prepared batches (2 MiB at 340) other
        steps began with, and its model named 369 where 350 ran out; the same run's steps
        with them named 336."""
        if trace is None or trace.batch_size != self.b0:
            return None
        return _recording.unmet_prepared(trace, self.prepared)

    def _copy_sizes(self):
        """The blocks of Keras' copy of the arrays, on TensorFlow (one per array)."""
        import keras
        if not self.tf or self.x is None:
            return []
        align = int(self.pool.layout().get("alignment", 64) or 64)
        return [-(-int(a.nbytes) // align) * align for a in keras.tree.flatten((self.x, self.y))
                if a is not None and hasattr(a, "nbytes") and a.nbytes > 0]

    def _batch_sizes(self, batch_size, align):
        import keras
        out = []
        for a in keras.tree.flatten((self.x, self.y)):
            if a is not None and len(a):
                out.append(-(-(int(a.nbytes) // len(a)) * batch_size // align) * align)
        return out

    def method(self):
        if self.after_oom:
            what = ("the memory model of short fit() runs after the out-of-memory error at " +
                    ", ".join(str(b) for b in self.after_oom) + f" (refused at {self.b0})")
            return what + "; the largest that completed" + (f", {self.too_large} having been refused"
                                                             if self.too_large < self.b0 else "")
        sizes = [t.batch_size for t in (self.template or self.first, self.other) if t is not None]
        what = "the memory model of steps at " + " and ".join(str(b) for b in sizes)
        return what + (f" (kept free for other steps' peaks: {self._model.spread_bytes >> 20} MiB)"
                       if self._model is not None and self._model.spread_bytes >= 1 << 20 else "")

    def after_oom_needs_steps(self):
        """True when the advice after the refused step needs steps of its own (array data,
        and no complete step recorded at the failed size); else model_after_oom() is the
        recorded steps' model."""
        return self.x is not None and self.prefix is not None and self.template is None

    def model_after_oom(self, model):
        """After a refused step: the StepModel, from short fit() runs of its own on all the
        samples at smaller sizes, run once the failed fit()'s data is out of the pool (its
        exception released): at b0 // 2, then down by DESCENT until one completes, then at the
        size the model of the step that completed says fits, each completed step becoming
        the model's new template. A run that is refused there shows the model wrong near
        that size: the next is halfway between the largest size that completed and it. The
        advice names the largest size that completed (advice_cap). The failed
        step up to its refusal is the retry's first step, and must fit too. None when no
        complete step could be had."""
        if not self.after_oom_needs_steps():
            return self.model()
        budget = self.pool.stats()["bytes_limit"]
        copies = self._copy_sizes()
        room = budget - sum(copies)

        def has_copy(trace):
            bare = _recording.without_blocks(trace, copies, kind="input")
            return len(bare.start_size) == len(trace.start_size) - len(copies)

        # Keras' copy of the arrays is in the pool in some short fit() runs and not in
        # others (benchmarks/NOTES.md, "Keras' copy of the arrays comes and goes"); a line
        # through a step with it and one without would make it shrink with the batch.
        # Once a step without it is met, the models take every step without it and leave
        # room for it; while every step has it, they take the steps as they ran (the copy
        # where it lay: on the two-input model, room instead named 446, which ran out).
        without = [bool(copies) and self.prefix is not None and not has_copy(self.prefix)]

        def plain(trace):
            return _recording.without_blocks(trace, copies, kind="input") if without[0] else trace

        def limit():
            return room if without[0] else budget

        # What tf.data had prepared ahead, per sample: the most the failed fit()'s steps
        # and the short runs' steps met (a short run's second step can begin with none of
        # the batches a long run's steps begin with).
        per_sample = [self.prepared / self.b0, _recording.prepared_bytes(self.prefix) / self.b0]

        def unmet(trace):
            return _recording.unmet_prepared(trace, max(per_sample) * trace.batch_size)

        def build(template, other=None):
            return StepModel.build(plain(template), plain(other) if other is not None else None,
                                   extra_start=unmet(template), epoch=self.epoch)

        def ran(trace):
            # A short run that completed proves its size for a retry that copies the
            # arrays only if it had the copy, or if its step fits with room for it (under
            # 24 MiB, the README's CNN completed a batch of 1 without its 12 MiB copy,
            # where with it nothing fits); and for a retry whose steps meet tf.data's
            # prepared batches only if it met them too, or fits with them.
            if trace is None or not trace.complete:
                return False
            per_sample.append(_recording.prepared_bytes(trace) / trace.batch_size)
            if copies and not has_copy(trace):
                without[0] = True
            elif unmet(trace) is None:
                return True
            return build(trace).fits(trace.batch_size, limit())

        good = None
        sizes, size = [], self.b0 // 2
        while size > 1:
            sizes.append(size)
            size //= DESCENT
        for size in sizes + [1]:
            if size >= self.too_large:
                continue
            good = self._nested(model, size, all_samples=True)
            if ran(good):
                self.after_oom.append(size)
                break
            self.too_large = min(self.too_large, size)
            good = None
        if good is None:
            # Not even a batch of 1 ran: none fits (advice_cap is 0), and the failed step
            # says what a batch of 1 would need at least.
            self._model = StepModels([StepModel.build(self.prefix, None, first=True, epoch=self.epoch)])
            return self._model if self.too_large == 1 else None

        def with_failed(model):
            # The failed step up to its refusal, its blocks lined up with a complete step's
            # (without that second size, on PyTorch, whose blocks carry no batch tag, none
            # of them would shrink with the batch): the retry's first step must fit too.
            # Unless a short run shows it wrong: its first step, which traced the step as
            # the retry's will, completed at a size this model says does not fit. The
            # failed step can have built what the retry finds built (the zoo's embedding
            # model: Adam's two slots of its 12 MiB table, and their initial values, made
            # while 71 MiB of 76 were in use); by it, no size above 300 fitted, where a
            # short run at 658 completed and 823 trained.
            f = StepModel.build(plain(self.prefix), plain(good), first=True, epoch=self.epoch)
            return StepModels([model, f] if f.fits(good.batch_size, limit()) else [model])
        # One size only: every block that is not batch-shaped is taken as proportional above
        # it, which can only overstate the need; the next size corrects it.
        current = with_failed(build(good))
        refused = False
        for _ in range(ASCENT_RUNS):
            if refused:
                size = (good.batch_size + self.too_large) // 2
            else:
                size = min(current.largest_fitting(limit(), at_most=self.n), self.too_large - 1)
            if size <= good.batch_size:
                break
            trace = self._nested(model, size, all_samples=True)
            if ran(trace):
                lower, good = good, trace
                current = with_failed(build(good, lower))
                self.after_oom.append(size)
            else:
                self.too_large = min(self.too_large, size)
                refused = True
        # The answer is a size that ran: the model picks where to look, the runs decide.
        # Extrapolated answers ran out in retries near the limit (the zoo's autoencoder:
        # 1233 after its runs, in CI), where peaks move from run to run.
        self.cap = good.batch_size
        self._model = current
        return current

    def advice_floor(self):
        """The smallest batch size the advice may name after an OOM: the largest whose
        step completed in the short runs (it ran, as the retry will, on all the data)."""
        return max(self.after_oom, default=0)

    def advice_cap(self):
        """The largest batch size the advice may name: below the smallest known not to fit,
        and after an OOM whose model was shown wrong, the largest whose step completed."""
        return min(self.too_large - 1, self.cap)
