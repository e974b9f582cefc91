"""A pytest plugin for benchmarks/keras_suite.py: puts TensorFlow's tensors under a
tf_memguard budget (TF_MEMGUARD_SUITE_BUDGET) before any test runs."""
import os


def pytest_configure(config):
    import tf_memguard
    tf_memguard.install(max_bytes=os.environ["TF_MEMGUARD_SUITE_BUDGET"])
    config.stash_tf_memguard = tf_memguard.config()


def pytest_unconfigure(config):
    import tf_memguard
    s = tf_memguard.stats()
    print(f"\ntf_memguard: {s['num_allocs']} allocations served, peak {s['peak_bytes_in_use']} bytes, "
          f"{s['num_refusals']} refused")
