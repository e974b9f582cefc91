"""The Bazel build: same sources and flags as setup.py, and its plugin works in the pip
TensorFlow. Needs `bazel` (Debian's bazel-bootstrap 4.2.3; .ci/run installs it)."""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from tfproc import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def build_list(name):
    m = re.search(name + r" = (\[.*?\])", read("BUILD"), re.S)
    return ast.literal_eval(m.group(1))


def test_bazel_and_setup_py_name_the_same_sources_and_flags():
    core = [line.strip() for line in read("cc", "core_sources.txt").splitlines() if line.strip()]
    assert build_list("CORE_SRCS") == core
    setup_flags = ast.literal_eval(re.search(r"CXXFLAGS = (\[.*?\])", read("setup.py")).group(1))
    assert build_list("CXXFLAGS") == setup_flags


@pytest.fixture(scope="module")
def bazel_outputs():
    if shutil.which("bazel") is None:
        pytest.skip("bazel is not installed (apt-get install bazel-bootstrap)")
    env = dict(os.environ, PYTHON_BIN_PATH=sys.executable)
    proc = subprocess.run(["bazel", "--batch", "test", "//..."], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bin_dir = subprocess.run(["bazel", "--batch", "info", "bazel-bin"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300).stdout.strip()
    return bin_dir, proc.stdout + proc.stderr


def test_bazel_builds_and_runs_the_cpp_tests(bazel_outputs):
    _, log = bazel_outputs
    assert "//:pool_test" in log and "PASSED" in log


def test_bazel_built_plugin_registers_and_serves_allocations(bazel_outputs, tmp_path):
    bin_dir, _ = bazel_outputs
    site = tmp_path / "site-packages" / "tensorflow-plugins"
    site.mkdir(parents=True)
    plugin = site / "libtf_memguard_plugin.so"
    shutil.copy(os.path.join(bin_dir, "tensorflow-plugins", "libtf_memguard_plugin.so"), plugin)
    core = os.path.join(bin_dir, "tf_memguard", "libtfmg_core.so")
    r = run("""
        import tensorflow as tf, tf_memguard
        from tf_memguard import _core
        before = tf_memguard.stats()["num_allocs"]
        y = tf.matmul(tf.ones([64, 64]), tf.ones([64, 64]))
        emit(path=_core.plugin_path(), state=_core.plugin_state(),
             allocs=tf_memguard.stats()["num_allocs"] - before, value=float(y[0, 0]))
    """, env={"PYTHONPATH": str(tmp_path / "site-packages"), "TF_MEMGUARD_PLUGIN": str(plugin),
              "TF_MEMGUARD_CORE": core})
    assert r.returncode == 0, r
    from tf_memguard import _core as c
    assert os.path.realpath(r.data["path"]) == os.path.realpath(str(plugin))
    assert r.data["state"] & c.PLUGIN_REGISTERED and r.data["state"] & c.PLUGIN_SERVING
    assert r.data["allocs"] >= 3 and r.data["value"] == 64.0
