"""The samples a run's memory model runs steps of its own on, and those short fit() runs.

fit()'s arrays when it was given arrays. When it was given a tf.data dataset, nothing
until an out-of-memory error: then a sample of the dataset's first batches, taken through
its whole pipeline as numpy arrays (_dataset_sample), stands in for them.
"""
import copy
import warnings
import weakref

from tf_memguard import _core, _dataset_sample, _recording
from tf_memguard._fit_args import fed_nbytes

# Batches of data a short fit() of its own is given: tf.data's autotuned map and prefetch
# held three prepared batches at every step's start in the runs measured (the README's
# CNN, 2 cores), and the recorded step must find the pipeline as full as a long run's
# (with four, the README's CNN's step was recorded with fewer, and 237 was suggested
# where 233 ran out; with eight, 223-229). The second size's short fit() runs one step
# (_steps.LONE_STEPS), which begins before its pipeline has prepared anything (none of
# tf.data's batches at its start on the zoo's autoencoder and GRU): there the prepared
# batches are the template's, measured at the run's own steps, and the samples given only
# make its last batch partial.
NESTED_BATCHES = 8


class StepData:
    """The data of one fit() run as the memory model's short runs take it.

    Attributes:
        x, y: the arrays (or structures of them); None for a dataset not yet sampled.
        n: the samples they hold (None when unknown).
        epoch: (samples, bytes per sample of a batch) of the epochs fit() runs over the
            arrays, which bound the batches tf.data prepares ahead (see
            _recording.epoch_of), or None (a dataset, steps_per_epoch given, torch).
        from_dataset: True once x and y are a sample of a dataset's batches.
    """

    def __init__(self, pool, recorder, x=None, y=None, n_samples=None, dataset=None, tf=True, own_epochs=True,
                 validation=None, steps=None):
        self.pool, self.recorder = pool, recorder
        self.x, self.y, self.n = x, y, n_samples
        self.tf = tf
        # A tf.data dataset fit() was given instead of arrays (weakly: a report kept must
        # not keep it, and its tensors, alive): after an OOM, a sample of its batches as
        # arrays stands in for x and y (sample_dataset(); on TensorFlow, whose pool
        # tf.data's buffers are in).
        self._dataset = weakref.ref(dataset) if dataset is not None and tf else None
        self.from_dataset = False
        # Whether the short runs' requests wait for frees as the pool's do (off by default:
        # _recording.fit_steps); on once no size down to a batch of 1 completed without.
        self.waits = False
        # Whether the dataset's batches vary in shape beyond the batch dimension, and then
        # the longest shapes of an epoch of them (leaf by leaf; taken with the sample), to
        # which the sample is padded: _dataset_sample. `steps`: fit()'s steps per epoch.
        self.varying = self._dataset is not None and _dataset_sample.varying_shapes(dataset)
        self.longest = None
        self._steps = steps
        # What bounds the batches tf.data prepares ahead: the epoch over the arrays, when
        # fit() makes one of its own per epoch (no steps_per_epoch given).
        self.epoch = _recording.epoch_of(x, y, n_samples) if tf and own_epochs and x is not None else None
        # Keras' copy of the validation arrays (`validation`: their leaves, when fit() has
        # them and runs more than one epoch), on TensorFlow: its evaluation at the first
        # epoch's end converts them, and the iterator it keeps holds the copy through
        # every later epoch's steps, which the first epoch's steps and the short runs
        # (no validation) never meet. keras.io's MNIST convnet with validation_split=0.1
        # under 96 MiB: its second epoch's steps began 3.7 MiB higher than its first's;
        # 140 completed short runs and four steps after an OOM, and its retry ran out in
        # the second epoch (132 is the most that trains).
        self.validation_copies = self._sizes(validation) if tf and validation is not None else []

    @property
    def usable(self):
        """True when there are arrays to run steps on, or a dataset to sample them from."""
        return self.x is not None or self._dataset is not None

    def short_fit(self, model, size, all_samples=False, steps=2, epochs=1):
        """A short fit() of its own at `size` (its last step recorded). By default on
        enough of the first samples for its pipeline to fill (NESTED_BATCHES batches and
        one sample more, so that the last batch is partial and the step runs the trace for
        an unknown batch dimension), its own copy of them left out of the blocks live at
        the start (the run's full copy stands for the retry's), and so are the batches
        the run had prepared at its own size (_recording.without_outer_batches). With
        `all_samples`, on all of them, as a retry would run: its copy is the retry's.
        `steps`: the steps it runs, the last recorded; `epochs` > 1 (with `all_samples`):
        that many whole epochs instead, the first step of the last recorded. None when
        there are no arrays or it could not be recorded (a step was refused before it, or,
        over whole epochs, after it)."""
        if self.x is None:
            return None
        samples = None if all_samples else min(self.n or NESTED_BATCHES * size + 1, NESTED_BATCHES * size + 1)
        if all_samples and self.from_dataset:
            # A retry on the dataset copies no arrays, and the sample's copy is in the pool
            # while the run lasts (MobileNetV3Small at 160: 31 MB of a 256 MiB budget, and
            # the runs completed 72 where 86 trains): only the batches the run takes, one
            # more prepared ahead, and a sample (a partial last batch, so that the step is
            # traced for an unknown batch dimension, as on a batched dataset).
            samples = min(self.n, (steps + 1) * size + 1)
        elif samples is not None and self.n and samples >= self.n and self.n % size == 0:
            # All the samples, in batches of `size`: the last is not partial, and the step
            # would run the trace with a known batch dimension. One sample fewer makes it
            # the other trace, which this step is recorded for. (The zoo's autoencoder at
            # 1,024 of 2,048 samples: the short fit() at 512 ran the known-size trace, its
            # model took it for the sizes that do not divide the samples, and named 1,566,
            # which ran out in 2 of 2 processes where 1,139 is the most that trains.)
            samples = self.n - 1
        outer = self.pool.live_blocks() if not all_samples else None
        try:
            trace = _recording.fit_steps(model, self.x, self.y, size, self.recorder, samples=samples, steps=steps,
                                         epochs=epochs if all_samples else 1, waits=self.waits)
        except Exception as e:  # noqa: BLE001 - the model of the step must never stop the training
            warnings.warn(f"tf_memguard: steps at batch size {size} for the memory model failed "
                          f"({type(e).__name__}: {e}); the advice uses what was recorded", stacklevel=4)
            return None
        finally:
            self.pool.reset_peak()
        if trace is None or (all_samples and samples is None):
            return trace
        align = int(trace.layout.get("alignment", 64))
        if not all_samples:
            trace = _recording.without_outer_batches(trace, outer)
        return _recording.without_blocks(trace, self._batch_sizes(samples, align), kind="input")

    def copy_sizes(self):
        """The blocks of Keras' copy of the arrays, on TensorFlow (one per array)."""
        return self._sizes((self.x, self.y)) if self.tf and self.x is not None else []

    def _sizes(self, arrays):
        import keras
        align = int(self.pool.layout().get("alignment", 64) or 64)
        return [-(-fed_nbytes(a) // align) * align for a in keras.tree.flatten(arrays)
                if a is not None and hasattr(a, "nbytes") and a.nbytes > 0]

    def unmet_copies(self, trace, validation=True, train=True):
        """Keras' copies of the arrays that a retry's steps can hold and `trace`'s step did
        not begin with, as more blocks live at its start ((sizes, flags) for
        StepModel.build's extra_start), or None: the validation arrays' copy (see
        __init__) with `validation`, and the training arrays' copy with `train`. Whether Keras copies an
        array into the pool or takes numpy's memory as it is depends on where numpy put it
        (benchmarks/NOTES.md, "Keras' copy of the arrays comes and goes"), which another
        process draws anew."""
        from tf_memguard._step_trace import kind_of
        if trace is None:
            return None
        wanted = (self.copy_sizes() if train else []) + (self.validation_copies if validation else [])
        kind = _core.KINDS.index("input")
        have = [int(v) for v in trace.start_size[kind_of(trace.start_flags) == kind]]
        missing = []
        for size in wanted:
            if size in have:
                have.remove(size)
            else:
                missing.append(size)
        flags = kind << _core.ALLOC_KIND_SHIFT
        return (missing, [flags] * len(missing)) if missing else None

    def _batch_sizes(self, batch_size, align):
        import keras
        out = []
        for a in keras.tree.flatten((self.x, self.y)):
            if a is not None and hasattr(a, "nbytes") and len(a):
                out.append(-(-(fed_nbytes(a) // len(a)) * batch_size // align) * align)
        return out

    def sample_dataset(self, batch_size):
        """With no arrays but a tf.data dataset: its first batches (_dataset_sample.BATCHES
        of `batch_size`, the failed size) as arrays become x and y, the samples they hold
        n, and nothing bounds the batches the pipeline prepares (epoch None: the dataset's
        size is its own). True when there are arrays to run steps on."""
        if self.x is not None:
            return True
        dataset = self._dataset() if self._dataset is not None else None
        if dataset is None:
            return False
        try:
            if self.varying:
                try:
                    self.longest = _dataset_sample.longest_shapes(dataset, self._steps)
                except Exception as e:  # noqa: BLE001 - a sample padded to its own longest is still worth having
                    warnings.warn(f"tf_memguard: the longest shapes of the dataset's batches could not be read "
                                  f"({type(e).__name__}: {e}); the short runs take the longest of the sample's",
                                  stacklevel=4)
            arrays = _dataset_sample.sample_arrays(dataset, _dataset_sample.BATCHES * batch_size, self.longest)
        except Exception as e:  # noqa: BLE001 - the advice must never stop the training
            warnings.warn(f"tf_memguard: no sample of the dataset's batches could be taken for the advice's short "
                          f"runs ({type(e).__name__}: {e})", stacklevel=4)
            return False
        finally:
            del dataset
        if arrays is None:
            return False
        import keras
        self.x, self.y = arrays
        self.n = min(len(a) for a in keras.tree.flatten(self.x))
        self.epoch = None
        self.from_dataset = True
        return True

    def sampled(self, batch_size):
        """A copy of this StepData whose x and y are a sample of the dataset's first batches
        (sample_dataset(batch_size)), this one left as it is; None where no sample can be
        taken (no dataset, or it is gone)."""
        twin = copy.copy(self)
        return twin if twin.sample_dataset(batch_size) else None

    def dataset(self):
        """The tf.data dataset fit() was given, if it is still referenced, else None."""
        return self._dataset() if self._dataset is not None else None

    def dataset_gone(self):
        """True when fit() was given a dataset that no one keeps any more (so no sample of
        it can be taken after an OOM)."""
        return self.x is None and self._dataset is not None and self._dataset() is None
