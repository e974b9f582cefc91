"""The memory of a Keras training step on JAX, from the step XLA compiled (no run).

`jax.jit(model.train_step, donate_argnums=0).lower(state, batch).compile()` is the program
fit() runs; its memory_analysis() gives the bytes of its arguments (weights, optimizer
state, metrics, the batch), outputs, temporaries (one buffer XLA plans for all of the
step's intermediates) and the outputs that reuse donated arguments (alias). Lowered with
ShapeDtypeStructs it needs no data and allocates nothing on the device. The step then
needs, on top of what is live outside it,

    argument + output + temp - alias

and measured on an H200 (benchmarks/results/probe_jax_h200.json, autotuning off) that was
within 0.1-2% of XLA's own peak for a CNN at batch 64-2,048 and a 4-block transformer at
32-512, the gap a fixed 7-45 MiB and, on the CNN, the batch Keras puts on the GPU one step
ahead (no look-ahead on CPU: Keras' JAXEpochIterator). A run measures that gap where XLA
keeps statistics (`residual`); StepMemory adds it.

The same step compiled in another process can plan more temporaries than the one the
advice compiled: XLA's autotuning picks each cuBLAS matmul's algorithm afresh, and gives
each one a workspace of up to GemmConfig::kHopperWorkspace (32 MiB on compute capability
9.0 and newer, kDefaultWorkspace 4 MiB before; xla/service/gpu/matmul_utils.h), shrunk to
what the chosen algorithm needs. Matmuls run one at a time, so at any moment a recompile
can hold at most one workspace more: the advice keeps that much free (`margin`; measured
on the H200: a transformer's step at batch 230 planned 26 MiB more in a fresh process,
benchmarks/NOTES.md). The check before a step runs uses the step compiled for it, without
the margin.

XlaStepModel holds the compiled sizes of a few batch sizes and answers the same questions
as the pool's StepModel (need, fits, largest_fitting, budget_for), for _advice's
Suggestion, the report and `python -m tf_memguard what-if`.
"""
import dataclasses

import numpy as np

from tf_memguard._fit_args import round_down

KIND = "xla-compiled"

# XLA's cuBLAS workspace per matmul (GemmConfig, xla/service/gpu/matmul_utils.h).
HOPPER_WORKSPACE = 32 << 20
DEFAULT_WORKSPACE = 4 << 20


def matmul_workspace(device, hlo_text):
    """The bytes one matmul's workspace can add in a recompile of the program `hlo_text`
    on `device` (a jax Device): 0 without cuBLAS calls or off CUDA."""
    if getattr(device, "platform", "") != "gpu" or "__cublas" not in hlo_text:
        return 0
    cc = str(getattr(device, "compute_capability", "") or "0")
    try:
        major = int(cc.split(".")[0])
    except ValueError:
        major = 0
    return HOPPER_WORKSPACE if major >= 9 else DEFAULT_WORKSPACE


def _distribution():
    """Keras' distribution in force (keras.distribution.set_distribution), or None."""
    try:
        from keras.src.distribution import distribution_lib
        return distribution_lib.distribution()
    except ImportError:
        return None


def _sharding(layout):
    try:
        return layout.backend_layout if layout is not None else None
    except Exception:  # noqa: BLE001 - a layout Keras cannot map: compile unsharded
        return None


def _spec(a, sharding=None):
    import jax
    return jax.ShapeDtypeStruct(tuple(a.shape), np.dtype(a.dtype), sharding=sharding)


def _variable_sharding(v, dist):
    value = getattr(v, "_value", None)
    if value is not None and hasattr(value, "sharding"):
        return value.sharding
    return _sharding(dist.get_variable_layout(v)) if dist is not None else None


def state_spec(model):
    """The train step's state argument as ShapeDtypeStructs (from the variables' shapes, so
    it works while fit() has purged their values). Under a Keras distribution
    (keras.distribution.DataParallel, ModelParallel) each carries its sharding, so the
    program compiled is the one each device runs, and memory_analysis() is per device."""
    dist = _distribution()
    groups = (model.trainable_variables, model.non_trainable_variables,
              model.optimizer.variables, model.metrics_variables)
    return tuple([_spec(v, _variable_sharding(v, dist)) for v in g] for g in groups)


def data_spec(batch, size=None):
    """The structure of `batch` (arrays with the batch first) as ShapeDtypeStructs, the
    batch dimension set to `size` if given, sharded as Keras' distribution shards it."""
    import jax
    dist = _distribution()

    def one(a):
        if a is None:
            return None
        shape = tuple(a.shape)
        if size is not None and shape:
            shape = (int(size),) + shape[1:]
        sharding = _sharding(dist.get_data_layout(shape)) if dist is not None and shape else None
        return jax.ShapeDtypeStruct(shape, np.dtype(a.dtype), sharding=sharding)
    return jax.tree_util.tree_map(one, batch, is_leaf=lambda a: a is None)


def distribution_devices():
    """The devices Keras' distribution spreads the step over (names as "CPU:0", "GPU:1"),
    or None without one."""
    dist = _distribution()
    if dist is None:
        return None
    try:
        devices = list(np.asarray(dist.device_mesh.devices).flat)
    except Exception:  # noqa: BLE001
        return None
    return [f"{'GPU' if d.platform == 'gpu' else d.platform.upper()}:{d.id}" for d in devices]


def batch_of(spec):
    import jax
    leaves = [a for a in jax.tree_util.tree_leaves(spec) if getattr(a, "shape", ())]
    return int(leaves[0].shape[0]) if leaves else 0


def nbytes(tree):
    """Bytes of the arrays (or ShapeDtypeStructs) in `tree` on one device: a sharded one
    counts its shard."""
    import jax
    total = 0
    for a in jax.tree_util.tree_leaves(tree):
        if not hasattr(a, "shape"):
            continue
        shape = tuple(a.shape)
        sharding = getattr(a, "sharding", None)
        if sharding is not None and hasattr(sharding, "shard_shape"):
            shape = tuple(sharding.shard_shape(shape))
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
    return int(total)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """memory_analysis() of the step at one batch size."""
    batch_size: int
    argument: int
    output: int
    temp: int
    alias: int
    data: int  # bytes of the batch among the arguments
    margin: int = 0  # what a recompile may plan more (matmul_workspace)

    @property
    def step(self):
        """What the step adds to the device's memory while it runs, beyond its state."""
        return self.argument + self.output + self.temp - self.alias


class Compiler:
    """Compiles `model`'s train step at batch sizes (cached) for one batch structure."""

    def __init__(self, model, example_batch):
        import jax
        self.model = model
        self.example = data_spec(example_batch)
        self.state = state_spec(model)
        self._jit = jax.jit(model.train_step, donate_argnums=0)
        self.cache = {}

    def at(self, size):
        """The Compiled step at batch `size`. Raises XLA's error when compiling fails
        (RESOURCE_EXHAUSTED while autotuning, under a cap)."""
        size = int(size)
        if size not in self.cache:
            data = data_spec(self.example, size)
            import jax
            compiled = self._jit.lower(self.state, data).compile()
            ma = compiled.memory_analysis()
            device = jax.devices()[0]
            margin = matmul_workspace(device, compiled.as_text() or "") if device.platform == "gpu" else 0
            self.cache[size] = Compiled(size, int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                                        int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes), nbytes(data),
                                        margin)
        return self.cache[size]


@dataclasses.dataclass
class XlaStepModel:
    """The step's memory at any batch size, from the compiled step at a few.

    need(b) = fixed + residual + margin + step(b) + ahead * data(b): `fixed`, what is live
    outside the step's arguments; `residual`, what a run measured beyond the prediction;
    `margin`, what a recompile may plan more (module docstring); step(b), piecewise linear
    through the compiled sizes and extended by the line through the two nearest; `ahead`,
    batches Keras holds on the device beside the step's own (1 on GPU, 0 on CPU)."""

    points: list            # [(batch, step bytes, data bytes, temp bytes)] sorted by batch
    fixed: int              # bytes live outside the step's arguments
    ahead: int = 0
    residual: int = 0       # measured peak minus predicted at the running size (>= 0)
    method: str = "the compiled step"
    largest_free: int = 0   # the largest free block XLA had at a step's start (0: unknown)
    margin: int = 0         # what a recompile may plan more (matmul_workspace)

    def contiguous_fits(self, temp, margin=True):
        """XLA's temporaries are one buffer: it must fit in one free block (with the
        recompile margin, for advice; without, for the step about to run)."""
        return not self.largest_free or temp + (self.margin if margin else 0) <= self.largest_free

    @property
    def base_batch(self):
        return self.points[-1][0] if self.points else 1

    def _line(self, b, column):
        pts = self.points
        if len(pts) == 1:
            b0, v0 = pts[0][0], pts[0][column]
            return v0 * b / b0 if column == 2 else v0  # data is linear; one size: step as it is
        lo = max([p for p in pts if p[0] <= b], default=pts[0], key=lambda p: p[0])
        hi = min([p for p in pts if p[0] >= b], default=pts[-1], key=lambda p: p[0])
        if lo[0] == hi[0]:
            if lo[0] == b:
                return lo[column]
            # beyond the compiled sizes: the line through the two nearest
            lo, hi = (pts[-2], pts[-1]) if b > pts[-1][0] else (pts[0], pts[1])
        slope = (hi[column] - lo[column]) / (hi[0] - lo[0])
        return lo[column] + slope * (b - lo[0])

    def need(self, b):
        b = max(1, int(b))
        step, data = self._line(b, 1), self._line(b, 2)
        return {"peak_account": int(self.fixed + self.residual + self.margin + step + self.ahead * data)}

    def fits(self, b, budget):
        if self.need(b)["peak_account"] > budget:
            return False
        return self.contiguous_fits(self._line(max(1, int(b)), 3)) if self.points and len(self.points[0]) > 3 \
            else True

    def largest_fitting(self, budget, at_most=None):
        hi = int(at_most) if at_most else 1 << 24
        if not self.fits(1, budget):
            return 0
        lo = 1
        if self.fits(hi, budget):
            return hi
        while hi - lo > 1:  # need() is monotone in b where XLA's sizes are
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, budget) else (lo, mid)
        return lo

    def budget_for(self, b):
        return self.need(b)["peak_account"]

    def to_dict(self):
        return {"kind": KIND, "points": [list(p) for p in self.points], "fixed": self.fixed, "ahead": self.ahead,
                "residual": self.residual, "method": self.method, "largest_free": self.largest_free,
                "margin": self.margin}

    @classmethod
    def from_dict(cls, d):
        return cls(points=[tuple(p) for p in d["points"]], fixed=d["fixed"], ahead=d.get("ahead", 0),
                   residual=d.get("residual", 0), method=d.get("method", "the compiled step"),
                   largest_free=d.get("largest_free", 0), margin=d.get("margin", 0))

    def add(self, compiled):
        pts = {p[0]: p for p in self.points}
        pts[compiled.batch_size] = (compiled.batch_size, compiled.step, compiled.data, compiled.temp)
        self.points = sorted(pts.values())
        self.margin = max(self.margin, compiled.margin)


def verified_largest(model, compiler, budget, at_most=None, compiles=3, oom=lambda e: False, multiple=1):
    """The largest batch size whose compiled step fits `budget` by `model` (an
    XlaStepModel fed from `compiler`): the line's answer, compiled and checked, at most
    `compiles` times; only a compiled size is returned (0 when none fits). A size whose
    compilation runs out of memory (autotuning under the cap: `oom(error)`) does not fit.
    `multiple`: sizes are multiples of it (the devices a Keras distribution splits the
    batch over: a batch that does not divide cannot be sharded)."""
    refused = []
    if len(model.points) < 2 and at_most:
        # One size gives no line: a second below it (after a refusal the refused size is
        # usually the only one compiled, or none where its compilation ran out of memory).
        size = min(model.points[0][0] // 2, at_most) if model.points else at_most
        size = round_down(size, multiple)
        for _ in range(4):
            if size < 1 or any(p[0] == size for p in model.points):
                break
            try:
                model.add(compiler.at(size))
                break
            except Exception as e:  # noqa: BLE001
                if not oom(e):
                    raise
                refused.append(size)
                size = round_down(size // 4, multiple)
    if not model.points:
        return 0
    for _ in range(compiles):
        b = model.largest_fitting(budget, at_most=at_most)
        if refused:
            b = min(b, min(refused) - 1)
        b = round_down(b, multiple)
        if b <= 0 or any(p[0] == b for p in model.points):
            break
        try:
            model.add(compiler.at(b))
        except Exception as e:  # noqa: BLE001 - XLA's error types vary by version
            if not oom(e):
                raise
            refused.append(b)
    ok = [p[0] for p in model.points if model.fits(p[0], budget) and (not at_most or p[0] <= at_most)
          and p[0] % multiple == 0
          and not any(p[0] >= r for r in refused)]
    return max(ok, default=0)


def first_batch(model, x, y, size):
    """The first batch fit(x, y, batch_size=size) passes to the train step (as Keras'
    JAX trainer makes it: dtypes converted, the structure it unpacks), after building the
    model, its optimizer and metrics as fit() does."""
    from keras.src.backend.jax.trainer import JAXEpochIterator
    iterator = JAXEpochIterator(x=x, y=y, batch_size=size, steps_per_execution=1, shuffle=False)
    model._symbolic_build(iterator=iterator)
    iterator.reset()
    for _, _, batches in iterator:
        return next(batches)
    raise ValueError("find_batch_size(x=...): x holds no samples")


def find(model, x, y, budget, device, samples, start=None, fixed=None):
    """The largest batch size whose compiled step fits `budget` (find_batch_size on JAX):
    no step is run, so nothing can run out of memory and the model is untouched. `fixed`:
    the only batch size the model runs (its inputs fix it): compiled alone, the answer if
    it fits, else 0."""
    if fixed:
        start = fixed
    import jax

    from tf_memguard import _xla
    data = first_batch(model, x, y, min(int(start) if start else 32, samples))
    compiler = Compiler(model, data)
    state = [v.value for v in model.variables if getattr(v, "_value", None) is not None]
    stats = _xla.memory_stats(device)
    on_gpu = device.startswith("GPU")
    if stats and "bytes_in_use" in stats:
        outside = max(0, int(stats["bytes_in_use"]) - nbytes(state))
    else:
        ids = {id(a) for a in state}
        outside = nbytes([a for a in jax.live_arrays() if id(a) not in ids])
    model_ = XlaStepModel(points=[], fixed=outside, ahead=1 if on_gpu else 0,
                          largest_free=int((stats or {}).get("largest_free_block_bytes", 0)))
    model_.add(compiler.at(batch_of(data)))
    if fixed:
        return (fixed if model_.fits(fixed, budget) else 0), model_
    devices = distribution_devices()
    size = verified_largest(model_, compiler, budget, at_most=samples, compiles=4, oom=_xla.is_oom,
                            multiple=len(devices) if devices else 1)
    return size, model_
