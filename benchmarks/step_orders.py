"""How much the order of a step's kernels moves its peak: every step of one fit() recorded.

TensorFlow's inter-op threads run the kernels of a step that do not depend on each other
in an order that changes from step to step, and the peak of the step moves with it. This
records every training step of a fit() of the README's CNN (examples/_data.small_cnn) at
each size asked for, under a budget large enough that nothing is refused, and prints per
step of an epoch the peaks seen; and per recorded step its peak "smeared" by W events
(every allocation moved W events earlier, every free W events later: an upper bound for
every order that moves no event further than W), for the W listed.

Prints a table and writes benchmarks/results/step_orders.json.

    python benchmarks/step_orders.py [--sizes 389,553] [--epochs 6] [--samples 1024]
"""
import argparse
import collections
import json
import os
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import numpy as np  # noqa: E402

MIB = float(1 << 20)
WINDOWS = (0, 1, 2, 4, 8)


def smeared_peak(trace, window):
    """The highest account of `trace` (a StepTrace) with its allocations `window` events
    earlier and its frees `window` events later (allocations first at equal times)."""
    op = trace.op
    size = trace.size.astype(np.float64)
    at = np.arange(len(op), dtype=np.float64)
    free = op == 1
    when = np.where(free, at + window, at - window)
    # Allocations and overshoot take memory; a refusal (2) takes none.
    delta = np.where(free, -size, np.where((op == 0) | (op == 3), size, 0.0))
    order = np.lexsort((free, when))
    start = float(trace.start_size.sum())
    return max(start, start + float(np.cumsum(delta[order]).max())) if len(op) else start


def record(size, epochs, samples):
    import keras
    from _data import pattern_images, small_cnn
    from tf_memguard import _core, _install
    from tf_memguard._recording import StepRecorder

    x, y = pattern_images(samples)
    keras.utils.set_random_seed(0)
    model = small_cnn()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # the optimizer built
    pool = _install.device_pool("CPU:0")
    recorder = StepRecorder(pool)
    steps = []

    class RecordAll(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            _core.set_profile_batch(size)

        def on_train_batch_begin(self, batch, logs=None):
            pool.reset_peak()
            recorder.begin(size)

        def on_train_batch_end(self, batch, logs=None):
            trace = recorder.end(True)
            s = pool.stats()
            peak = s["window_peak_bytes_in_use"] - s["passthrough_bytes_in_use"]
            if trace is not None:
                steps.append((batch, peak, trace))

    model.fit(x, y, batch_size=size, epochs=epochs, verbose=0, callbacks=[RecordAll()])
    _core.set_profile_batch(0)
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="389,553", help="batch sizes, comma-separated. Defaults to 389,553.")
    ap.add_argument("--epochs", type=int, default=6, help="Defaults to 6.")
    ap.add_argument("--samples", type=int, default=1024, help="Defaults to 1024 (the README test's data).")
    ap.add_argument("--budget", default="1GiB", help="large enough that nothing is refused. Defaults to 1GiB.")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "step_orders.json"))
    args = ap.parse_args(argv)
    import tf_memguard
    tf_memguard.install(max_bytes=args.budget)
    result = {"command": "python benchmarks/step_orders.py " + " ".join(argv or sys.argv[1:]),
              "samples": args.samples, "epochs": args.epochs, "budget": args.budget, "sizes": {}}
    print(f"{'size':>5} {'step':>4}  peaks seen (MiB: count)            smeared by W = {list(WINDOWS)} (MiB, "
          f"each distinct peak's step)")
    for size in (int(s) for s in args.sizes.split(",")):
        steps = record(size, args.epochs, args.samples)
        rows = []
        by_step = collections.defaultdict(list)
        for batch, peak, trace in steps:
            by_step[batch].append((peak, trace))
        for batch in sorted(by_step):
            seen = collections.Counter(round(p / MIB, 1) for p, _ in by_step[batch])
            smears = {}
            for peak, trace in by_step[batch]:
                key = round(peak / MIB, 1)
                if key not in smears:
                    smears[key] = [round(smeared_peak(trace, w) / MIB, 1) for w in WINDOWS]
            rows.append({"step": batch, "peaks_mib": dict(seen), "smeared_mib": smears})
            print(f"{size:>5} {batch:>4}  {dict(sorted(seen.items(), reverse=True))!s:<34} {smears}")
        result["sizes"][str(size)] = rows
    result["windows"] = list(WINDOWS)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
