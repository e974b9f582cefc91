"""oneDNN and the hard budget: TensorFlow's oneDNN kernels off unless asked for.

TensorFlow's oneDNN kernels (on by default on CPUs with AVX-512) crash when an allocation
is refused: their helpers return on a failed allocation and their callers use the tensor
(cc/tf/glue.cc). The glue therefore grants their requests over the budget, and
MemGuardCallback stops the run after the step: on such a CPU a plain CNN fit at a batch
too large for a 160 MiB budget peaked at 520 MiB (3.2x), 443 MB of it oneDNN's
(benchmarks/NOTES.md, "oneDNN on by default broke the budget"). With oneDNN off every
kernel request is refusable and the budget is hard.

TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, while `import tensorflow` runs and before it
loads its plugins (seen with TensorFlow 2.21: both of its libraries log their choice
before the plugin is loaded), so only Python code that runs before `import tensorflow`
can choose. Hence:
- `import tf_memguard` before TensorFlow sets TF_ENABLE_ONEDNN_OPTS=0 unless the
  environment already holds a value (the user's choice is kept; child processes inherit
  it, as they would the user's own setting);
- install() when TensorFlow came first with oneDNN on that nobody asked for raises
  RuntimeError saying how to get a hard budget (nothing is installed: the process goes
  on as it was);
- TF_ENABLE_ONEDNN_OPTS=1 set by the user keeps oneDNN: install() warns that its kernels'
  requests can pass the budget. A 0 set after `import tensorflow` came too late: the
  same RuntimeError.
"""
import os
import sys
import warnings

VAR = "TF_ENABLE_ONEDNN_OPTS"

# Whether `import tf_memguard` set VAR (None: it did not).
set_at_import = None


def choose_at_import():
    """Turns oneDNN off for the TensorFlow still to be imported, unless the environment
    already says; called once, by tf_memguard/__init__.py. An empty value says nothing:
    TensorFlow reads it as unset (its default, oneDNN on), and so does this."""
    global set_at_import
    if "tensorflow" in sys.modules or os.environ.get(VAR, "").strip():
        return
    os.environ[VAR] = "0"
    set_at_import = "0"


def enabled():
    """Whether the imported TensorFlow runs oneDNN kernels (False if it cannot say)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return False
    return bool(_pywrap_util_port.IsMklEnabled())


def check_install():
    """Called by install() on TensorFlow, after TensorFlow is imported: a RuntimeError when
    oneDNN is on though nobody asked for it, a warning when the user asked for it."""
    if not enabled():
        return
    value = os.environ.get(VAR)
    # Asked for: a true value (as TensorFlow reads it) that tf_memguard did not set. A
    # "0" with oneDNN on was set after `import tensorflow`: too late, as no value at all.
    asked = value is not None and value != set_at_import and value.strip().lower() in ("1", "true")
    if not asked:
        raise RuntimeError(
            "tf_memguard.install(): TensorFlow was imported before tf_memguard with its oneDNN kernels on "
            "(TensorFlow's default on CPUs with AVX-512). oneDNN kernels crash when an allocation is refused, so "
            "their requests cannot be held to the budget (a CNN fit at too large a batch took 3x a 160 MiB "
            "budget). For a hard budget, import tf_memguard before tensorflow and keras (it turns oneDNN off), "
            "or start Python with TF_ENABLE_ONEDNN_OPTS=0. To keep oneDNN's kernels with a budget they can "
            "pass (MemGuardCallback then stops a run after such a step), start Python with "
            "TF_ENABLE_ONEDNN_OPTS=1. Nothing was installed.")
    warnings.warn(
        f"tf_memguard: {VAR}={value} keeps TensorFlow's oneDNN kernels on, and they crash when an allocation "
        "is refused: their requests are granted over the budget (counted as overshoot of kind 'kernel'), and "
        "MemGuardCallback stops the run after such a step. For a hard budget, start Python with "
        f"{VAR}=0 (or without it, importing tf_memguard before tensorflow).", RuntimeWarning, stacklevel=4)
