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
- the steep step: of the same steps, the one whose own order of allocations would peak
  highest at twice b0 (its batch-shaped blocks doubled), where it is not the template: the
  order that is highest at b0 is not always the one that grows fastest, and both are
  modelled;
- the second size: the first epoch's partial last batch when there is one of a useful
  size (a step fit() runs anyway), else a short fit() of its own at b0 // 2 on the first
  samples of the arrays (one step, recorded; the model restored exactly; at 2 from a
  run at 1). It tells
  which untagged blocks change with the batch, and which tagged ones stop growing
  (workspaces TensorFlow caps). With b0 dividing the samples, the run's steps have a
  known batch dimension; the short fit()'s last batch is partial, so its steps stand for
  the sizes that do not divide them (another trace, an unknown batch dimension), beside
  the run's own models (that trace needs at least as much: StepModels).
After an out-of-memory error: the failed step up to its refusal (the first step of the
retry must fit too), and, once the failed fit()'s data is out of the pool, short fit()
runs of its own on all the samples at smaller sizes (down to one that completes, then
up: _after_oom).
"""
from tf_memguard import _after_oom, _backend, _core, _fit_args, _recording, _run_model, _units
from tf_memguard._memory_model import StepModels, alike_groups, order_gap
from tf_memguard._step_data import StepData

# The smallest partial last batch used as the second size, as a share of b0: below that,
# block sizes are too near the granule (and TensorFlow's kernels pick other algorithms
# for tiny batches) for a line through two points to be worth more than the bounds.
MIN_PARTIAL = 1 / 8
# Epochs whose steps are candidates for the template.
RECORDED_EPOCHS = 2
# Steps of the short fit() for the second size (where fit() runs none), the last recorded,
# those before it thrown away. One: the step that traces the function for an unknown batch
# dimension, and the tracing's own blocks are freed before its kernels run (a model takes
# those it cannot match as bounded, never as less). On the zoo's 12 models and 4 from
# outside the repository, one step named the sizes two steps did (the first thrown away),
# or higher ones within what one process differs from the next, and all trained
# (benchmarks/NOTES.md, "One step for the second size"); two cost a step over issue 14's
# "at most two beyond fit()" with the confirmation's.
LONE_STEPS = 1
# Short fit() runs of its own per run for the second size (after an OOM, _after_oom's
# DESCENT and ASCENT_RUNS bound them).
MAX_NESTED_RUNS = 4
# The batch size, over the running one, at which the steps' own orders are compared for the
# steepest (StepSampler.steep): the advice is mostly asked for from a run at about half
# the size that fits (the zoo, and a user halving a size that ran out).
STEEP_FACTOR = 2.0


class StepSampler:
    """Records the steps of one fit() run and makes the StepModel of its training step."""

    def __init__(self, pool, batch_size, n_samples=None, steps_per_epoch=None, x=None, y=None, own_epochs=True,
                 dataset=None, validation=None, partial=None, collective=False):
        self.pool = pool
        self.b0 = int(batch_size)
        self.steps = steps_per_epoch
        self.recorder = _recording.StepRecorder(pool)
        self.tf = _backend.framework() == "tensorflow"
        # The samples the short runs take (fit()'s arrays; after an OOM on a dataset, a
        # sample of its batches).
        self.data = StepData(pool, self.recorder, x, y, n_samples, dataset=dataset, tf=self.tf,
                             own_epochs=own_epochs, validation=validation, steps=steps_per_epoch)
        # Keras' pipeline has batches of a known size only when b0 divides the samples: then
        # the recorded steps run the trace with a known batch dimension ("static"), and a
        # lone step (whose new size makes TensorFlow trace the step again, relaxed to an
        # unknown batch dimension) stands for the sizes that do not divide them.
        self.static = self.tf and bool(n_samples) and n_samples % self.b0 == 0
        self.lone = None
        self.lone_extra = None
        self.template = None      # the steady steps' (the highest of them)
        self.template_peak = -1
        # The full step at b0 whose own order of allocations, with its batch-shaped blocks
        # scaled by STEEP_FACTOR, peaks highest (_recording.scaled_peak), where that is not
        # the template: the order whose peak grows fastest with the batch.
        self.steep = None
        self.steep_at = -1
        self.steep_peak = 0
        self.first = None         # the run's first step (it traces the step's function)
        # Bytes per sample a fresh fit()'s build leaves into its first steps (Keras' torch
        # backend: _recording.build_garbage_rate), set by MemGuardCallback; in every model.
        self.garbage_per_sample = 0.0
        self.other = None
        self.prefix = None        # the step refused partway, if one was
        self.partial = None
        if n_samples and steps_per_epoch and n_samples % self.b0:
            last = n_samples - (steps_per_epoch - 1) * self.b0
            if 0 < last < self.b0:
                self.partial = last
        elif partial and steps_per_epoch and 0 < partial < self.b0:
            # A tf.data pipeline's own partial last batch (_fit_args.dataset_partial_batch):
            # without it a dataset's run has one batch size, and a block that did not
            # change with it is taken as possibly proportional (TensorFlow's convolution
            # backprop caps its 20 MiB workspace; keras.io's text CNN on its string
            # pipeline at 32 was advised 93 where 210 trains).
            self.partial = int(partial)
        # A worker of a multi-worker run: its steps are collectives, which every worker must
        # run alike. No short fit() of its own: where one worker's step is refused and
        # another's completes, they part, and both wait in a collective for ever (CI: the
        # second size's short run at 32 MiB refused on worker 1, which then sat in
        # reset_metrics()'s all-reduce; killed after 240 s). Its models are of the run's
        # own steps (and an epoch's partial last batch).
        self.collective = bool(collective)
        self._recording = None    # "first", "template" or "other", while a step is recorded
        self._nested_runs = 0
        self._model = None
        self.too_large = 1 << 62  # the smallest batch size known not to fit
        self.cap = 1 << 62        # the largest the advice may name (model_after_oom)
        self.after_oom = []       # the sizes of the short fit() runs after an OOM that completed
        self.confirmed = None     # (size, what ran) of the run after an OOM that confirmed the answer
        self.prepared = 0         # the most batch-tagged bytes live at a step's start at b0
        # The peaks of the full steps at b0, by (bytes in use at the step's start,
        # batch-tagged bytes at its end): steps alike but for their kernels' order.
        self._alike = {}
        self._began = 0
        # The most bytes of backing granules the live blocks of a full step at b0 touched
        # at once (StepTrace.footprint), over the steps and in the template.
        self.footprint = 0
        self.template_footprint = 0

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
            s = self.pool.stats()
            self.prepared = max(self.prepared, int(s["batch_bytes_in_use"]))
            self._began = int(s["bytes_in_use"])
        size = self.partial if which == "other" else self.b0
        self._profile(size)
        self._recording = which
        self.recorder.begin(size)

    def step_end(self, epoch, step):
        if self._recording is None:
            return
        which, self._recording = self._recording, None
        if which == "template":
            s = self.pool.stats()
            peak = s["window_peak_bytes_in_use"]
            trace = self.recorder.end(True)
            if trace is not None and not self._at_size(trace):
                return
            self._alike.setdefault((self._began, int(s["batch_bytes_in_use"])), []).append(int(peak))
            self._model = None   # a step more may change the order gap (order_bytes)
            if trace is None:
                return
            footprint = trace.footprint()
            if footprint > self.footprint:
                self.footprint, self._model = footprint, None
            if peak > self.template_peak:
                self.template, self.template_peak, self.template_footprint = trace, peak, footprint
                self._model = None
            if not trace.ordered:
                steep = _recording.scaled_peak(trace, STEEP_FACTOR)
                if steep > self.steep_at:
                    self.steep, self.steep_at, self.steep_peak = trace, steep, int(peak)
                    self._model = None
        elif which == "other":
            trace = self.recorder.end(True)
            if trace is not None and self._at_size(trace):
                self.other = trace
                self._model = None
            self._profile(self.b0)
        else:
            trace = self.recorder.end(True)
            if trace is not None and self._at_size(trace):
                self.first = trace
                self._model = None

    def _at_size(self, trace):
        """Whether `trace` is a step at the size it was recorded for: on TensorFlow, one that
        made blocks of that batch size (StepTrace.carries_batch). A PyDataset's batches come
        in the order fit() shuffles them to: a CNN's PyDataset of 2,048 samples at 400 under
        256 MiB ran its batch of 48 first, recorded as the first step at 400 (its peak 51
        MiB), and after the OOM in the next step the advice named 373, which ran out in 2 of
        2 fresh processes (limit about 260). (PyTorch's glue sees no shapes: taken as is.)"""
        return not self.tf or trace.carries_batch()

    def epoch_end(self, epoch, model):
        """After the first epoch: the second size, if fit() ran none and it matters."""
        self._profile(0)
        self.recorder.abort()
        if epoch == 0:
            self.second_size(model)

    def second_size(self, model):
        """The short fit()'s step at half the running size (the lone step), where fit()
        showed no second size: after the first epoch, or when a run is stopped after its
        first step (XLA's buffers or oneDNN's kernels granted over the budget)."""
        # At a batch of 1, the second size is 2: with one size, every block no batch tag
        # marks is taken as possibly proportional, and a CNN at 1 under 96 MiB was advised
        # 2, where a hundred fit.
        size = self.b0 // 2 if self.b0 > 1 else 2
        if (self.template or self.first) is None or self.other is not None or self.collective \
                or _fit_args.fixed_batch_size(model) is not None:
            return
        data = self.data
        if data.x is None and data.tf and not data.varying:
            # A dataset whose epoch ends with no partial batch fit() could record (its
            # batches divide its elements, drop_remainder, or a length not known: TFRecord
            # files interleaved): the short fit() on a sample of its first batches as arrays
            # (a copy: the run's own data stays the dataset). With one size, every block no
            # batch tag marks is taken as possibly proportional: tensorflow.org's TFRecord
            # pipeline (4 shards of 32x32 images, interleave, map, shuffle(1000)) into a CNN
            # under 128 MiB was advised 49 after two epochs at 32 and 69 at 48, where 120
            # trains. (Not for batches that vary in shape: their sample is padded to the
            # longest of a pass over the dataset, an epoch's reading at every fit().)
            data = data.sampled(self.b0)
        if data is None or (data.n or 2) < size:
            return
        self.lone = self.short_fit(model, size, steps=LONE_STEPS, data=data)
        self.other = self.lone if self.lone is not None and self.lone.complete else None
        # What a step of the run holds beside its own batch that the short run's step
        # (one step per execution) did not: the batch steps_per_execution's loop fetches.
        self.lone_extra = _recording.stale_batches(data.x, data.y, self.lone.batch_size, model) \
            if self.lone is not None else None
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

    def short_fit(self, model, size, all_samples=False, steps=2, epochs=1, data=None):
        """StepData.short_fit of `data` (default: the run's), at most MAX_NESTED_RUNS times
        a run for the second size (after an OOM, with `all_samples`, _after_oom's own loops
        bound them); None in a multi-worker run (`collective`)."""
        data = self.data if data is None else data
        if self.collective:
            return None
        if not all_samples:
            if data.x is None or self._nested_runs >= MAX_NESTED_RUNS:
                return None
            self._nested_runs += 1
        return data.short_fit(model, size, all_samples=all_samples, steps=steps, epochs=epochs)

    # -- the model ---------------------------------------------------------------------

    def model(self, observed_peak=0):
        """The StepModels of the steps recorded (None before a complete step), with the
        spread from `observed_peak` (the highest step peak fit() showed at b0):
        _run_model.models_of."""
        if self._model is None and (self.template is not None or self.first is not None):
            self._model = _run_model.models_of(self, observed_peak)
        return self._model

    def order_bytes(self):
        """How far above the highest step peak at b0 an order of the kernels not met could
        peak, from the full steps that began with the same bytes in use and ended with the
        same batch-shaped bytes (the same blocks live, the same batches prepared: what is
        left to differ is which blocks the threads' order had live at once). Where the
        highest peak of such steps recurs, the orders' top has been met, and the template
        (the highest step) holds it: 0. Where it was met once, the top of the orders has
        not been sampled, and the next order up is taken to lie as far above it as it lies
        above the next peak down. Peaks within a granule of the pool's backing (64 KiB on
        the host) count as one: a step that took one more granule is the same order. On
        the zoo's ResNet at 150, steps alike peaked at 216.7, 219.4 and, once, 223.3 MiB,
        and the model of the 223.3 step named 305 where 301 trains (another process's
        steps peaked at 228.6); on its wide MLP, the highest peak of alike steps (47.4 of
        50 MiB) came in a quarter of them, and the answer needs no more room.
        Groups of two do not speak (benchmarks/NOTES.md, "Groups of two steps"): on the
        zoo's mixed-precision CNN at 408 every pair held one step of each of two orders
        31.6 MiB apart, and with their gap kept it named 589 where 817 trains."""
        same = max(int(self.pool.layout().get("page_bytes", 0) or 0), 1)
        return max((order_gap(peaks, same) for peaks in alike_groups(self._alike, same)), default=0)

    def layout_bytes(self):
        """How many more bytes of backing granules than the template's the live blocks of
        the run's widest step at b0 touched at once (StepTrace.footprint): a layout the
        template's replay does not show (StepModel.build's layout_bytes)."""
        return max(0, self.footprint - self.template_footprint) if self.template is not None else 0

    def method(self):
        if self.after_oom:
            what = ("the memory model of short fit() runs after the out-of-memory error at " +
                    ", ".join(str(b) for b in self.after_oom) + f" (refused at {self.b0})")
            if self.data.from_dataset:
                what += f", on the dataset's first {self.data.n} samples as arrays"
                if self.data.longest:
                    what += (" padded to the longest shape of its batches (" +
                             ", ".join("x".join(str(d) for d in shape) for shape in self.data.longest if shape) + ")")
            if self.data.waits:
                what += (", their requests waiting for frees as the retry's will (without waits not even a "
                         "batch of 1 completed)")
            what += "; the largest that completed"
            if self.confirmed:
                what += f" (and {self.confirmed[1]} at {self.confirmed[0]})"
            what += f", {self.too_large} having been refused" if self.too_large < self.b0 else ""
            fresh = self.fresh_process_size()
            if fresh is not None:
                what += (f"; for this process (a fresh process's first fit() also holds what Keras' build of the "
                         f"model leaves, {_units.format_bytes(int(self.garbage_per_sample))} a sample: {fresh} "
                         f"there)")
            return what
        sizes = [t.batch_size for t in (self.template or self.first, self.other) if t is not None]
        if self.prefix is not None and (not sizes or self.too_large <= 1):
            # No step completed, before the failure or in the short runs after it (every
            # size down to 1 refused): what the failed step held up to its refusal is what a
            # batch of 1 needs at least.
            return f"the failed step at {self.b0} up to its refusal (no short run of fit() completed, down to a batch of 1)"
        what = "the memory model of steps at " + " and ".join(str(b) for b in sizes)
        kept = self._model.spread(self.b0) if self._model is not None else 0
        return what + (f" (kept free at {self.b0} for the peaks and layouts of other steps and orders of the "
                       f"kernels not met: {kept >> 20} MiB)" if kept >= 1 << 20 else "")

    def fresh_process_size(self):
        """After an OOM on Keras' torch backend: the largest size whose steps fit with what
        Keras' build of the model leaves beside them (garbage_per_sample, which a fresh
        process's first fit() meets in its first steps, and the retry in this process,
        the model built, does not), at most the answer; None where there is nothing of
        the kind or it names no less. keras_hub's Qwen3 under 4 GiB on an H100 after an OOM
        at 177: the answer 121 trained in that process, where 111 is the most that trains
        in a fresh one (at 121 the build leaves 473 MiB)."""
        if not self.after_oom or self.garbage_per_sample <= 0 or self._model is None or self.cap < 1:
            return None
        m = self._model
        models = m.models if isinstance(m, StepModels) else [m]
        with_build = StepModels([x.with_shortfall(self.garbage_per_sample, _recording.SHORTFALL_FLAGS)
                                 for x in models], getattr(m, "domains", None), getattr(m, "samples", None))
        size = with_build.largest_fitting(self.pool.stats()["bytes_limit"], at_most=self.cap)
        return size if size < self.cap else None

    def use_model(self, model):
        """Makes `model` (StepModels) the one model() returns from now on; returns it."""
        self._model = model
        return model

    def model_after_oom(self, model):
        """After a refused step: the StepModel from short fit() runs of its own (see
        _after_oom.model_after_oom), or None when no complete step could be had."""
        return _after_oom.model_after_oom(self, model)

    def advice_floor(self):
        """The smallest batch size the advice may name after an OOM: the largest whose
        step completed in the short runs (it ran, as the retry will, on all the data),
        never above the cap."""
        return min(max(self.after_oom, default=0), self.cap)

    def advice_cap(self):
        """The largest batch size the advice may name: below the smallest known not to fit,
        and after an OOM whose model was shown wrong, the largest whose step completed."""
        return min(self.too_large - 1, self.cap)
