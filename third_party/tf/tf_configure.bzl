"""A repository rule that finds the pip TensorFlow the plugin is built against, in the
manner of tensorflow/custom-op: headers, libtensorflow_framework.so.2 and the compile
flags, all from tf.sysconfig of the interpreter in PYTHON_BIN_PATH (default python3)."""

_PROBE = """
import json, os, tensorflow as tf
print(json.dumps({
    "include": tf.sysconfig.get_include(),
    "lib": tf.sysconfig.get_lib(),
    "cflags": tf.sysconfig.get_compile_flags(),
    "lflags": tf.sysconfig.get_link_flags(),
    "version": tf.__version__,
}))
"""

def _tf_configure_impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "python3")
    result = ctx.execute([python, "-c", _PROBE], environment = {
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "TF_MEMGUARD_DISABLE": "1",
    })
    if result.return_code != 0:
        fail("tf_configure: could not import tensorflow with %s (set PYTHON_BIN_PATH):\n%s" % (python, result.stderr))
    info = json.decode(result.stdout.strip().splitlines()[-1])
    ctx.symlink(info["include"], "include")
    ctx.symlink(info["lib"] + "/libtensorflow_framework.so.2", "libtensorflow_framework.so.2")
    defines = [f[2:] for f in info["cflags"] if f.startswith("-D")]
    copts = [f for f in info["cflags"] if not f.startswith("-D") and not f.startswith("-I")]
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "tf_header_lib",
    hdrs = glob(["include/**/*.h", "include/**/*.inc", "include/**/*.hpp", "include/**"], exclude = ["include/**/*.py"]),
    includes = ["include"],
    defines = {defines},
)

cc_library(
    name = "libtensorflow_framework",
    srcs = ["libtensorflow_framework.so.2"],
)

TF_COPTS = {copts}
""".format(defines = repr(defines), copts = repr(copts)))
    ctx.file("flags.bzl", "TF_COPTS = %s\nTF_DEFINES = %s\nTF_VERSION = %s\n" % (repr(copts), repr(defines), repr(info["version"])))

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH"],
)
