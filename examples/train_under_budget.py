"""Train a small CNN under a hard memory budget and print tf_memguard's memory report.

    python examples/train_under_budget.py [--budget 128MiB] [--batch-size 64] [--epochs 3] [--out memguard_out]

Writes the report as JSON, and as a PNG plot when matplotlib is installed, to --out.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tf_memguard  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="128MiB", help="the budget (bytes, '128MiB', '1GB', 0.1). Defaults to 128MiB.")
    ap.add_argument("--batch-size", type=int, default=64, help="Defaults to 64.")
    ap.add_argument("--epochs", type=int, default=3, help="Defaults to 3.")
    ap.add_argument("--samples", type=int, default=4096, help="Defaults to 4096.")
    ap.add_argument("--out", default="memguard_out", help="where the report goes. Defaults to memguard_out.")
    args = ap.parse_args(argv)

    config = tf_memguard.install(max_bytes=args.budget)   # before the model is built
    print(f"tf_memguard: {config}")

    import keras
    from _data import pattern_images, small_cnn

    x, y = pattern_images(args.samples)
    keras.utils.set_random_seed(0)
    model = small_cnn()
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.1,
                        verbose=2, callbacks=[tf_memguard.MemGuardCallback()])

    report = tf_memguard.report()
    # Read here, a suggestion above the running size is confirmed by a step at it first.
    if report.suggested_batch_size:
        print(f"batch size that fits the budget: {report.suggested_batch_size} ({report.suggestion_method})")
    os.makedirs(args.out, exist_ok=True)
    report.to_json(os.path.join(args.out, "report.json"))
    try:
        report.save_plot(os.path.join(args.out, "memory.png"))
        print(f"wrote {args.out}/report.json and {args.out}/memory.png")
    except ImportError:
        print(f"wrote {args.out}/report.json (pip install 'tf_memguard[plot]' for memory.png)")
    acc = history.history["val_accuracy"][-1]
    print(f"validation accuracy {acc:.2f} (chance: 0.25); peak {tf_memguard.format_bytes(report.peak_bytes)} "
          f"of a {tf_memguard.format_bytes(config.max_bytes)} budget")
    return 0 if acc > 0.4 else 1


if __name__ == "__main__":
    sys.exit(main())
