"""tf_memguard never breaks `import tensorflow`: built against one TensorFlow and run
under another, the plugin warns once, TensorFlow works with its own allocator, and
install() raises the same message.

Needs an environment where tf_memguard was built against TensorFlow 2.21.0 and then
TensorFlow 2.20.0 was installed over it: .ci/tf_version_mismatch.sh makes one and runs
this file with TF_MEMGUARD_MISMATCH_PYTHON set to its interpreter (otherwise skipped).
"""
import os
import subprocess

import pytest

PYTHON = os.environ.get("TF_MEMGUARD_MISMATCH_PYTHON")

SCRIPT = """
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, keras, tf_memguard
from tf_memguard import _core
m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
m.compile("sgd", "mse")
h = m.fit(np.ones((64, 8)), np.ones((64, 4)), epochs=2, verbose=0)
try:
    tf_memguard.install("64MiB")
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({"tf": tf.__version__, "loss": h.history["loss"], "error": error,
                  "state": _core.plugin_state(), "allocs": tf_memguard.stats()["num_allocs"]}))
"""


@pytest.mark.skipif(not PYTHON, reason="needs TF_MEMGUARD_MISMATCH_PYTHON (see .ci/tf_version_mismatch.sh)")
def test_a_plugin_built_for_another_tensorflow_warns_and_tensorflow_still_trains():
    import json
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_MEMGUARD")}
    proc = subprocess.run([PYTHON, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["tf"] != "2.21.0"
    assert len(data["loss"]) == 2 and all(v == v for v in data["loss"])  # trained, with TF's allocator
    warning = f"this tf_memguard was built for TensorFlow 2.21.0, and this is TensorFlow {data['tf']}"
    assert proc.stderr.count(warning) == 1, proc.stderr[-3000:]   # one warning, at import
    assert "Rebuild tf_memguard against this TensorFlow" in proc.stderr
    assert data["error"] and warning in data["error"]               # install() says the same
    from tf_memguard import _core
    assert data["state"] & _core.PLUGIN_MISMATCH and not data["state"] & _core.PLUGIN_REGISTERED
    assert data["allocs"] == 0                                      # the pool never saw a tensor
