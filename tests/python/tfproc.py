"""Runs TensorFlow scenarios in their own Python processes.

The plugin is loaded by `import tensorflow` and a crash must not take the test run with
it, so every TensorFlow scenario runs in a fresh interpreter. A scenario prints one JSON
object as its last line of stdout; run() returns it with the exit code and stderr.
"""
import json
import os
import subprocess
import sys
import textwrap

PRELUDE = """
import os, sys, json, gc
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
def emit(**kw):
    print(json.dumps(kw), flush=True)
"""

# A hard budget needs oneDNN off (its kernels crash on a refused allocation; see
# tf_memguard/_onednn.py). `import tf_memguard` before TensorFlow turns it off; scenarios
# that import TensorFlow first get it off from here (run()'s default), tests of the
# oneDNN path ask for it, and tests of the import order unset it (None).
HARD = {"TF_ENABLE_ONEDNN_OPTS": "0"}
ONEDNN = {"TF_ENABLE_ONEDNN_OPTS": "1"}
UNSET_ONEDNN = {"TF_ENABLE_ONEDNN_OPTS": None}

# A scenario part: keras.io's "Timeseries anomaly detection using an Autoencoder" (Conv1D and
# Conv1DTranspose over windows of 288 steps; a synthetic series of its shape, 4,032 windows),
# compiled as `m` with its windows as `xs` (keras and numpy as np imported, install() called).
# Its convolutions take 23-26 MB workspaces whatever the batch: under 48 MiB two of them meet
# unless one waits.
TIMESERIES_AUTOENCODER = """
L = keras.layers
keras.utils.set_random_seed(0)
m = keras.Sequential([keras.Input((288, 1)),
                      L.Conv1D(32, 7, padding="same", strides=2, activation="relu"), L.Dropout(0.2),
                      L.Conv1D(16, 7, padding="same", strides=2, activation="relu"),
                      L.Conv1DTranspose(16, 7, padding="same", strides=2, activation="relu"), L.Dropout(0.2),
                      L.Conv1DTranspose(32, 7, padding="same", strides=2, activation="relu"),
                      L.Conv1DTranspose(1, 7, padding="same")])
m.compile(keras.optimizers.Adam(1e-3), "mse")
t = np.arange(4032 + 288)
series = (np.sin(t * 2 * np.pi / 288) + 0.3 * np.random.default_rng(0).standard_normal(t.size)).astype("float32")
xs = np.stack([series[i:i + 288] for i in range(4032)])[..., None]
"""


class Result:
    def __init__(self, returncode, out, err):
        self.returncode = returncode
        self.stdout = out
        self.stderr = err
        lines = [line for line in out.splitlines() if line.startswith("{")]
        self.data = json.loads(lines[-1]) if lines else None

    def __repr__(self):
        return f"Result(rc={self.returncode}, data={self.data}, stderr tail={self.stderr[-1500:]!r})"


def run(*parts, env=None, timeout=600):
    """Runs the code `parts` (each dedented on its own, then joined) in a fresh Python;
    `env` adds variables to the environment (a value of None removes one)."""
    full_env = dict(os.environ)
    for key in ("TF_MEMGUARD_DISABLE", "TF_CPU_ALLOCATOR_USE_BFC", "TF_MEMGUARD_CORE", "TF_MEMGUARD_HOST_UPSTREAM",
                "TF_MEMGUARD_GPU", "TF_MEMGUARD_GLUE", "TF_MEMGUARD_PLUGIN"):
        full_env.pop(key, None)
    full_env.update(HARD)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    proc = subprocess.run([sys.executable, "-c", PRELUDE + "\n".join(textwrap.dedent(p) for p in parts)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)
