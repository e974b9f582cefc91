"""Keras' own test suite with and without tf_memguard: the same outcome for every test.

Extracts Keras' sources at the tag of the installed Keras (`git archive v<version>` from a
snapshot of keras-team/keras kept outside this repository) and runs a subset of its tests
twice on the TensorFlow backend: with TF_MEMGUARD_DISABLE=1 (TensorFlow's own allocator)
and with the plugin serving every tensor under a budget (tf_memguard.install() at the
session's start, benchmarks/keras_suite_plugin.py). Every test must end the same way.
Prints a table and writes benchmarks/results/keras_suite.json.

    python benchmarks/keras_suite.py --keras-repo /path/to/keras.git [--budget 8GiB] [--paths ...]
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = ["keras/src/trainers", "keras/src/callbacks", "keras/src/models", "keras/src/layers/core",
         "keras/src/layers/convolutional", "keras/src/optimizers"]


def extract(repo, version, into):
    tag = f"v{version}"
    archive = os.path.join(into, "keras.tar")
    subprocess.run(["git", f"--git-dir={repo}", "archive", "--format=tar", "-o", archive, tag], check=True)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    os.remove(archive)
    return into


def outcomes(xml_path):
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                state = "skipped"
        out[name] = state
    return out


def run_suite(src, paths, env_extra, xml_path, timeout):
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
               PYTHONPATH=HERE)  # keras_suite_plugin; the sources come first from the working directory
    env.update(env_extra)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
           "-o", "addopts=", "--continue-on-collection-errors"] + paths  # test modules that need jax or grain
    if env_extra.get("TF_MEMGUARD_SUITE_BUDGET"):
        cmd[3:3] = ["-p", "keras_suite_plugin"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.time() - t0


def main(argv=None):
    import keras
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keras-repo", required=True, help="a git directory of keras-team/keras with its tags")
    ap.add_argument("--budget", default="8GiB", help="the budget of the run with tf_memguard. Defaults to 8GiB.")
    ap.add_argument("--paths", nargs="*", default=PATHS, help="test paths inside Keras' sources")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "keras_suite.json"))
    args = ap.parse_args(argv)
    version = keras.__version__
    with tempfile.TemporaryDirectory(prefix=f"keras-{version}-") as tmp:
        src = extract(args.keras_repo, version, tmp)
        runs = {}
        for label, extra in (("tensorflow's allocator", {"TF_MEMGUARD_DISABLE": "1"}),
                             (f"tf_memguard, {args.budget}", {"TF_MEMGUARD_SUITE_BUDGET": args.budget})):
            xml_path = os.path.join(tmp, f"{len(runs)}.xml")
            proc, seconds = run_suite(src, args.paths, extra, xml_path, args.timeout)
            if not os.path.exists(xml_path):
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                return 1
            runs[label] = (outcomes(xml_path), seconds, proc.stdout.strip().splitlines()[-1:])
    (base, t_base, line_base), (guard, t_guard, line_guard) = runs.values()
    differ = sorted(name for name in set(base) | set(guard) if base.get(name) != guard.get(name))
    counts = {label: {s: sum(1 for v in o.values() if v == s) for s in ("passed", "failed", "error", "skipped")}
              for label, (o, _, _) in runs.items()}
    print(f"Keras {version}, tests in {', '.join(args.paths)}")
    print(f"{'run':<28}{'passed':>8}{'failed':>8}{'error':>7}{'skipped':>9}{'seconds':>9}")
    for label, (o, seconds, _) in runs.items():
        c = counts[label]
        print(f"{label:<28}{c['passed']:>8}{c['failed']:>8}{c['error']:>7}{c['skipped']:>9}{seconds:>9.0f}")
    print(f"tests that ended differently: {len(differ)}")
    for name in differ[:50]:
        print(f"  {name}: {base.get(name)} -> {guard.get(name)}")
    result = {"keras": version, "paths": args.paths, "budget": args.budget, "counts": counts,
              "seconds": {label: round(s, 1) for label, (_, s, _) in runs.items()},
              "tests": len(set(base) | set(guard)), "differ": [[n, base.get(n), guard.get(n)] for n in differ]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
