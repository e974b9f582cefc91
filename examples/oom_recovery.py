"""A step that does not fit the budget, explained, and the run retried at the batch size
tf_memguard suggests -- in the same process, with the same model.

    python examples/oom_recovery.py [--budget 128MiB] [--batch-size 1024]
"""
import argparse
import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tf_memguard  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="128MiB", help="Defaults to 128MiB.")
    ap.add_argument("--batch-size", type=int, default=1024, help="too big on purpose. Defaults to 1024.")
    args = ap.parse_args(argv)

    tf_memguard.install(max_bytes=args.budget)
    import keras
    import tensorflow as tf
    from _data import pattern_images, small_cnn

    x, y = pattern_images(4096)
    keras.utils.set_random_seed(0)
    model = small_cnn()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    guard = tf_memguard.MemGuardCallback(verbose=0)
    try:
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, callbacks=[guard])
        print(f"batch size {args.batch_size} fitted the budget; try a smaller --budget")
        return 0
    except tf.errors.ResourceExhaustedError as e:
        explanation = "\n".join(getattr(e, "__notes__", [])) or str(e)
        print(f"fit(batch_size={args.batch_size}) ran out of memory:\n  {explanation}\n")

    # The failed step's tensors are held by the exception's frames until a collection;
    # without one, the retry's copy of the data would meet them in the pool.
    gc.collect()
    size = guard.report.suggested_batch_size
    print(f"retrying with batch_size={size} in the same process ...")
    history = model.fit(x, y, batch_size=size, epochs=2, verbose=2, callbacks=[guard])
    print(guard.report)
    print(f"retry succeeded: accuracy {history.history['accuracy'][-1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
