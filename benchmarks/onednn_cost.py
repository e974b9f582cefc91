"""What the hard budget's default costs in speed: TensorFlow's oneDNN kernels off.

`import tf_memguard` before TensorFlow sets TF_ENABLE_ONEDNN_OPTS=0 (oneDNN's kernels crash
when an allocation is refused; README, "oneDNN"). This measures what that costs a user, on
four kinds of model, each timed in fresh processes, interleaved, --repeat of each:

* tf_onednn: TensorFlow as installed (oneDNN on by default on this AVX-512 CPU), no
  tf_memguard: what the user had before.
* tf_no_onednn: TensorFlow with TF_ENABLE_ONEDNN_OPTS=0, no tf_memguard.
* memguard: `import tf_memguard` first (oneDNN off), install() with a budget that fits.

Each process runs --epochs epochs of a fixed number of steps and reports each epoch's
time; the first epoch (tracing) is dropped and a process counts with its fastest epoch (on
2 cores an epoch takes one of two times, benchmarks/NOTES.md). The table gives the medians
and the ratios memguard / tf_onednn (the cost a user sees) and tf_no_onednn / tf_onednn
(oneDNN's share of it). Writes benchmarks/results/onednn_cost.json.

    python benchmarks/onednn_cost.py [--repeat 3] [--epochs 7] [--models cnn,gp_critic,mlp,lstm]

About 15 minutes on 2 cores.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
mode, name, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
import numpy as np
if mode == "memguard":
    import tf_memguard
    tf_memguard.install(max_bytes="1GiB")
import tensorflow as tf, keras
from keras import layers
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
if name == "cnn":        # the reference CNN of tf_overhead.py, batch 64
    x = rng.random((1280, 32, 32, 3), dtype=np.float32); y = rng.integers(0, 2, 1280); b = 64
    m = keras.Sequential([keras.Input((32, 32, 3)),
        layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(64, 3, activation="relu"), layers.MaxPooling2D(),
        layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(2)])
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
elif name == "gp_critic":  # keras.io WGAN-GP's critic (5x5 convolutions) with its gradient penalty, batch 32
    x = rng.random((160, 28, 28, 1), dtype=np.float32); y = None; b = 32
    def critic():
        i = keras.Input((28, 28, 1)); h = layers.ZeroPadding2D(2)(i)
        for f in (64, 128, 256, 512):
            h = layers.LeakyReLU(0.2)(layers.Conv2D(f, 5, strides=2, padding="same")(h))
        return keras.Model(i, layers.Dense(1)(layers.Flatten()(h)))
    class GP(keras.Model):
        def __init__(self):
            super().__init__(); self.c = critic()
        def call(self, x):
            return self.c(x)
        def train_step(self, real):
            fake = tf.random.normal(tf.shape(real))
            with tf.GradientTape() as tape:
                a = tf.random.uniform([tf.shape(real)[0], 1, 1, 1])
                mid = real + a * (fake - real)
                with tf.GradientTape() as gp_tape:
                    gp_tape.watch(mid)
                    p = self.c(mid, training=True)
                g = gp_tape.gradient(p, mid)
                gp = tf.reduce_mean((tf.sqrt(tf.reduce_sum(tf.square(g), axis=[1, 2, 3])) - 1.0) ** 2)
                loss = tf.reduce_mean(self.c(fake, training=True)) - tf.reduce_mean(self.c(real, training=True)) + 10 * gp
            grads = tape.gradient(loss, self.c.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.c.trainable_variables))
            return {"loss": loss}
    m = GP(); m.compile(keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9))
elif name == "mlp":      # Dense 1024 x3 with dropout, batch 256
    x = rng.random((5120, 784), dtype=np.float32); y = rng.integers(0, 10, 5120); b = 256
    m = keras.Sequential([keras.Input((784,)), layers.Dense(1024, activation="relu"), layers.Dropout(0.2),
        layers.Dense(1024, activation="relu"), layers.Dropout(0.2), layers.Dense(1024, activation="relu"),
        layers.Dense(10)])
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
elif name == "lstm":     # Embedding and LSTM(128) over 80 tokens, batch 64
    x = rng.integers(0, 10000, (1280, 80)); y = rng.integers(0, 2, 1280); b = 64
    m = keras.Sequential([keras.Input((80,), dtype="int32"), layers.Embedding(10000, 64), layers.LSTM(128),
        layers.Dense(1)])
    m.compile("adam", keras.losses.BinaryCrossentropy(from_logits=True))
class T(keras.callbacks.Callback):
    def on_epoch_begin(self, e, logs=None):
        self.t = time.perf_counter()
    def on_epoch_end(self, e, logs=None):
        times.append(round(time.perf_counter() - self.t, 4))
times = []
m.fit(x, y, batch_size=b, epochs=epochs, verbose=0, callbacks=[T()])
print("RESULT " + json.dumps({"times": times}))
"""

MODES = ("tf_onednn", "tf_no_onednn", "memguard")


def run(mode, name, epochs):
    env = dict(os.environ)
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    if mode == "tf_no_onednn":
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    out = subprocess.run([sys.executable, "-c", CHILD, mode, name, str(epochs)], env=env,
                         capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["times"]
    raise RuntimeError(f"{mode} {name} failed:\n{out.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes of each mode. Defaults to 3.")
    ap.add_argument("--epochs", type=int, default=7, help="epochs a process runs (the first dropped). Defaults to 7.")
    ap.add_argument("--models", default="cnn,gp_critic,mlp,lstm")
    ap.add_argument("--out", default=os.path.join(RESULTS, "onednn_cost.json"))
    args = ap.parse_args()
    start = time.time()
    rows, raw = [], {}
    for name in args.models.split(","):
        best = {mode: [] for mode in MODES}
        raw[name] = {mode: [] for mode in MODES}
        for _ in range(args.repeat):
            for mode in MODES:   # interleaved: the machine's drift falls on every mode alike
                times = run(mode, name, args.epochs)
                raw[name][mode].append(times)
                best[mode].append(min(times[1:]))
        med = {mode: statistics.median(v) for mode, v in best.items()}
        rows.append({"model": name, **{f"{mode}_s": round(v, 3) for mode, v in med.items()},
                     "memguard_over_tf_onednn": round(med["memguard"] / med["tf_onednn"], 3),
                     "no_onednn_over_onednn": round(med["tf_no_onednn"] / med["tf_onednn"], 3),
                     "memguard_over_tf_no_onednn": round(med["memguard"] / med["tf_no_onednn"], 3)})
        r = rows[-1]
        print(f"{name:10s} epoch: TF (oneDNN) {r['tf_onednn_s']:.3f} s, TF (no oneDNN) {r['tf_no_onednn_s']:.3f} s, "
              f"tf_memguard {r['memguard_s']:.3f} s", flush=True)
    print()
    print(f"{'model':10s} {'tf_memguard / TF as installed':>30s} {'TF without oneDNN / with':>26s} "
          f"{'tf_memguard / TF without oneDNN':>33s}")
    for r in rows:
        print(f"{r['model']:10s} {r['memguard_over_tf_onednn']:30.2f} {r['no_onednn_over_onednn']:26.2f} "
              f"{r['memguard_over_tf_no_onednn']:33.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "epoch_seconds": raw, "repeat": args.repeat, "epochs": args.epochs,
                   "command": "python benchmarks/onednn_cost.py " + " ".join(sys.argv[1:]),
                   "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                   "seconds": round(time.time() - start, 1),
                   "when": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
