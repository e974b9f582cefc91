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
  size (a step fit() runs anyway), else one lone step at b0 // 2 on the first samples of
  the arrays (train_on_batch, the model restored exactly after it). It tells which
  untagged blocks change with the batch, and which tagged ones stop growing (workspaces
  TensorFlow caps).
After an out-of-memory error: the failed step up to its refusal (its blocks live at the
start are fit()'s), and complete lone steps at smaller sizes (at most two).
"""
import warnings

import numpy as np

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


class StepSampler:
    """Records the steps of one fit() run and makes the StepModel of its training step."""

    def __init__(self, pool, batch_size, n_samples=None, steps_per_epoch=None, x=None, y=None):
        self.pool = pool
        self.b0 = int(batch_size)
        self.n = n_samples
        self.x, self.y = x, y
        self.steps = steps_per_epoch
        self.recorder = _recording.StepRecorder(pool)
        self.tf = _backend.framework() == "tensorflow"
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
        self._lone_steps = 0
        self._model = None
        self.too_large = 1 << 62  # the smallest batch size known not to fit

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

    def _nested(self, model, size, exclude_batch=None):
        """A short fit() of its own at `size` (its second step recorded), on enough of the
        first samples for its pipeline to fill (NESTED_BATCHES batches and one sample more,
        so that the last batch is partial and the step runs the trace for an unknown batch
        dimension); its blocks live at the start lose its own copy of those samples (the
        run's full copy stands for the retry's) and, with `exclude_batch`, the batches the
        failed fit() had prepared at that size. None when it could not be recorded."""
        if self.x is None or self._lone_steps >= 3:
            return None
        self._lone_steps += 1
        samples = min(self.n or NESTED_BATCHES * size + 1, NESTED_BATCHES * size + 1)
        try:
            trace = _recording.fit_steps(model, self.x, self.y, size, self.recorder, samples=samples)
        except Exception as e:  # noqa: BLE001 - the model of the step must never stop the training
            warnings.warn(f"tf_memguard: steps at batch size {size} for the memory model failed "
                          f"({type(e).__name__}: {e}); the advice uses what was recorded", stacklevel=3)
            return None
        finally:
            self.pool.reset_peak()
        if trace is None:
            return None
        align = int(trace.layout.get("alignment", 64))
        trace = _recording.without_blocks(trace, self._batch_sizes(samples, align), kind="input")
        if exclude_batch:
            trace = _recording.without_blocks(trace, self._batch_sizes(exclude_batch, align), tagged=True)
        return trace

    # -- the model ---------------------------------------------------------------------

    def model(self, observed_peak=0):
        """The StepModel from the steps recorded (None before a complete step), with the
        spread from `observed_peak` (the highest step peak fit() showed at b0)."""
        if self._model is None and (self.template is not None or self.first is not None):
            steady = StepModel.build(self.template, self.other, observed_peak=observed_peak or None) \
                if self.template is not None else None
            first = StepModel.build(self.first, self.other, first=True) if self.first is not None else None
            domain = "static" if self.static else "all"
            models, domains = [steady, first], [domain, domain]
            start = self.template or self.first
            if self.static and self.lone is not None and self.lone.complete:
                # The other trace: the short fit()'s step, for the sizes that do not divide
                # the samples.
                models.append(StepModel.build(self.lone, start))
                domains.append("dynamic")
            self._model = StepModels(models, domains, samples=self.n if self.tf else None)
        return self._model

    def _batch_sizes(self, batch_size, align):
        import keras
        out = []
        for a in keras.tree.flatten((self.x, self.y)):
            if a is not None and len(a):
                out.append(-(-(int(a.nbytes) // len(a)) * batch_size // align) * align)
        return out

    def method(self):
        sizes = [t.batch_size for t in (self.template or self.first, self.other) if t is not None]
        what = "the memory model of steps at " + " and ".join(str(b) for b in sizes)
        return what + (f" (kept free for other steps' peaks: {self._model.spread_bytes >> 20} MiB)"
                       if self._model is not None and self._model.spread_bytes >= 1 << 20 else "")

    def model_after_oom(self, model):
        """After a refused step: the StepModel, from short fit() runs of its own at smaller
        sizes (b0 // 2, or b0 // 8 where that is refused too, then near where the first says
        the limit is), with the failed fit()'s copy of the data standing for the retry's and
        the batches its pipeline had prepared at b0 left out. The failed step up to its
        refusal is the run's first step, and must fit too. After these runs the retry runs
        the trace for an unknown batch dimension whatever its size: the models hold for
        every size. None when no complete step could be had."""
        if self.x is None or self.prefix is None:
            return self.model()
        failed = StepModel.build(self.prefix, None, first=True)
        half = max(1, self.b0 // 2)
        first = self._nested(model, half, exclude_batch=self.b0)
        if first is None or not first.complete:  # None: refused in its first step
            self.too_large = min(self.too_large, half)
            first = self._nested(model, max(1, self.b0 // 8), exclude_batch=self.b0)
        if first is None or not first.complete:
            return None
        budget = self.pool.stats()["bytes_limit"]
        m1 = StepModels([StepModel.build(first, self.prefix), failed])
        size = min(m1.largest_fitting(budget, at_most=self.n), self.too_large - 1)
        if size <= first.batch_size:
            self._model = m1
            return m1
        second = self._nested(model, size, exclude_batch=self.b0)
        if second is not None and second.complete:
            self._model = StepModels([StepModel.build(second, first), failed])
        else:
            self.too_large = min(self.too_large, size)  # its steps were refused: smaller than that
            self._model = m1
        return self._model

    def _lone(self, model, size):
        """A lone step at `size` without its own input batch (fit()'s batches come from its
        pipeline, counted from the failed step), or None."""
        if self.x is None or self._lone_steps >= 3:
            return None
        self._lone_steps += 1
        try:
            trace = _recording.lone_step(model, self.x, self.y, size, self.recorder)
        except Exception as e:  # noqa: BLE001 - the explanation must never hide the error
            warnings.warn(f"tf_memguard: a step at batch size {size} for the memory model failed "
                          f"({type(e).__name__}: {e}); the advice uses what was recorded", stacklevel=3)
            return None
        return _recording.without_inputs(trace, self.x, self.y) if trace is not None else None

    def _prepared_batches(self, prefix):
        """(sizes, flags) of the input batches live when the step was refused that the step
        itself allocated, what fit()'s pipeline had prepared (blocks tagged batch-shaped of
        exactly a batch of one of the arrays), and one more: the pipeline refills its buffer
        while a step runs (the README's CNN: 3 input batches live at every step's start, a
        4th made during the step)."""
        batch = set(self._batch_sizes(prefix.batch_size, int(prefix.layout.get("alignment", 64))))
        live = {}
        for op, addr, size, flags in zip(prefix.op.tolist(), prefix.address.tolist(), prefix.size.tolist(),
                                         prefix.flags.tolist()):
            if op == 1:
                live.pop(addr, None)
            elif op != 2:
                live[addr] = (size, flags)
        found = [(z, f) for z, f in live.values() if f & _core.ALLOC_BATCH and z in batch]
        if found:
            found.append(max(found))
        return np.array([z for z, _ in found], dtype=np.uint64), np.array([f for _, f in found], dtype=np.uint32)
