"""Builds tf_memguard's native parts.

* ``tf_memguard/libtfmg_core.so``: the C++ core (cc/tfmg) as a shared library with a
  plain C interface, so that every user in a process shares one copy and one pool per
  device.
* ``tf_memguard/_core*.so``: the pybind11 bindings, linked to the core (rpath $ORIGIN).
* ``tf_memguard/libtfmg_torch.so``: the PyTorch glue (cc/torch), the two functions
  torch.cuda.memory.CUDAPluggableAllocator calls, linked to the core. Built against the
  PyTorch of the target environment (its headers and libc10, for torch's
  out-of-memory error) when there is one, else skipped: PyTorch is not a dependency.
* ``tensorflow-plugins/libtf_memguard_plugin.so``: the loader (cc/tf/loader.cc), which
  ``import tensorflow`` loads from site-packages. It has no TensorFlow symbol dependency,
  so it loads under any TensorFlow; it dlopen()s the core, and the glue only when the
  running TensorFlow is the one the glue was built for (the version is compiled in).
* ``tf_memguard/libtfmg_tf.so``: the TensorFlow glue (cc/tf/glue.cc, cc/tf/caller.cc),
  built against the TensorFlow of the environment being installed into (found by
  running its interpreter with -I, outside pip's isolated build environment), with that
  TensorFlow's own compile and link flags. Without TensorFlow the loader and the glue
  are skipped with a warning (the pool and its bindings still build);
  TF_MEMGUARD_REQUIRE_TF=1 makes that an error.

The list of core sources is ``cc/core_sources.txt``, read by every build (this file and
CMakeLists.txt) so they cannot drift apart.
"""
import glob
import json
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CXXFLAGS = ["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"]


def read_sources(name):
    with open(os.path.join(HERE, "cc", name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


class PlainSharedLibrary(Extension):
    """A shared library that Python does not import: named NAME.so, not NAME.cpython-*.so."""


PLUGIN = "tensorflow-plugins.libtf_memguard_plugin"
TF_GLUE = "tf_memguard.libtfmg_tf"


def tensorflow_build_flags():
    """Compile and link flags of the target environment's TensorFlow, or None."""
    probe = ("import json, tensorflow.sysconfig as s, tensorflow as tf; "
             "print(json.dumps([tf.__version__, s.get_compile_flags(), s.get_link_flags()]))")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_MEMGUARD_DISABLE="1")
    try:
        out = subprocess.run([sys.executable, "-I", "-c", probe], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout
        version, cflags, lflags = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None
    return version, cflags, lflags


TORCH_GLUE = "tf_memguard.libtfmg_torch"


def torch_build_flags():
    """Version, include dirs, library dir and C++ ABI flag of the target environment's
    PyTorch, or None."""
    probe = ("import json, os, torch; from torch.utils import cpp_extension as c; "
             "print(json.dumps([torch.__version__, c.include_paths(), "
             "os.path.join(os.path.dirname(torch.__file__), 'lib'), int(torch._C._GLIBCXX_USE_CXX11_ABI)]))")
    try:
        out = subprocess.run([sys.executable, "-I", "-c", probe], check=True, capture_output=True,
                             text=True, timeout=300).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


class BuildExt(build_ext):
    def get_ext_filename(self, fullname):
        ext = self.ext_map.get(fullname)
        if isinstance(ext, PlainSharedLibrary):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extensions(self):
        # The core first: the bindings link against it.
        self.extensions.sort(key=lambda e: not isinstance(e, PlainSharedLibrary))
        super().build_extensions()

    def build_extension(self, ext):
        if ext.name == PLUGIN:
            # In-place and editable builds copy to ./tensorflow-plugins/, made here.
            os.makedirs(os.path.join(HERE, "tensorflow-plugins"), exist_ok=True)
            if self.inplace or getattr(self, "editable_mode", False):
                # The package stays in the source tree: the plugin looks for the core there
                # when it is not beside it in site-packages.
                core = os.path.join(HERE, "tf_memguard", "libtfmg_core.so")
                ext.define_macros = ext.define_macros + [("TFMG_CORE_FALLBACK_PATH", '"%s"' % core)]
        if ext.name in ("tf_memguard._core", TORCH_GLUE):
            core_dir = os.path.dirname(self.get_ext_fullpath("tf_memguard.libtfmg_core"))
            ext.extra_link_args = ext.extra_link_args + [
                "-L" + core_dir, "-l:libtfmg_core.so", "-Wl,-rpath,$ORIGIN"]
        super().build_extension(ext)
        if ext.name == PLUGIN and getattr(self, "editable_mode", False):
            # An editable wheel holds what is in the install dir; put the plugin there so
            # that it lands in site-packages/tensorflow-plugins, where TensorFlow looks.
            target = os.path.join(self.distribution.get_command_obj("install").install_lib,
                                  "tensorflow-plugins")
            os.makedirs(target, exist_ok=True)
            shutil.copy2(self.get_ext_fullpath(ext.name), target)


def pybind11_include():
    import pybind11
    return pybind11.get_include()


# The core's headers: a change to one rebuilds everything that includes it (setuptools
# otherwise compares only the sources' times with the built file's).
HEADERS = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "cc", "tfmg", "*.h")))

core = PlainSharedLibrary(
    "tf_memguard.libtfmg_core",
    sources=read_sources("core_sources.txt"),
    depends=HEADERS,
    include_dirs=[HERE],
    language="c++",
    extra_compile_args=CXXFLAGS,
    extra_link_args=["-Wl,-soname,libtfmg_core.so", "-pthread", "-ldl"],
)

bindings = Extension(
    "tf_memguard._core",
    sources=["cc/python/bindings.cc"],
    depends=HEADERS,
    include_dirs=[HERE, pybind11_include()],
    language="c++",
    extra_compile_args=CXXFLAGS,
)

ext_modules = [core, bindings]
tf = tensorflow_build_flags()
if tf is None:
    message = ("tf_memguard: no TensorFlow found for %s; building without the TensorFlow plugin "
               "(install tensorflow-cpu==2.21.0 first, then reinstall tf_memguard)" % sys.executable)
    if os.environ.get("TF_MEMGUARD_REQUIRE_TF") == "1":
        sys.exit(message)
    print("WARNING: " + message, file=sys.stderr)
else:
    tf_version, tf_cflags, tf_lflags = tf
    print("tf_memguard: building the TensorFlow plugin against TensorFlow %s" % tf_version)
    # setuptools rebuilds an extension only when a source or a `depends` file is newer
    # than the built library: a stamp of the TensorFlow it is built against, rewritten
    # when that changes, makes a build in the same tree after a TensorFlow upgrade rebuild
    # the loader (which has the version compiled in) and the glue (its headers).
    stamp = os.path.join(HERE, "build", "tensorflow.stamp")
    wanted = json.dumps([tf_version, tf_cflags, tf_lflags])
    os.makedirs(os.path.dirname(stamp), exist_ok=True)
    if not os.path.exists(stamp) or open(stamp).read() != wanted:
        with open(stamp, "w") as f:
            f.write(wanted)
    ext_modules.append(PlainSharedLibrary(
        PLUGIN,
        sources=["cc/tf/loader.cc"],
        depends=HEADERS + ["cc/tf/glue.h", stamp],
        include_dirs=[HERE],
        language="c++",
        define_macros=[("TFMG_TF_VERSION", '"%s"' % tf_version)],
        extra_compile_args=CXXFLAGS,
        extra_link_args=["-ldl"],
    ))
    ext_modules.append(PlainSharedLibrary(
        TF_GLUE,
        sources=["cc/tf/glue.cc", "cc/tf/caller.cc"],
        depends=HEADERS + ["cc/tf/glue.h", "cc/tf/caller.h", stamp],
        include_dirs=[HERE],
        language="c++",
        # TensorFlow's flags last: they set the C++ standard and ABI it was built with.
        extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall"] + tf_cflags,
        extra_link_args=tf_lflags + ["-ldl"],
    ))

torch = torch_build_flags()
if torch is None:
    print("tf_memguard: no PyTorch found for %s; building without the PyTorch glue (Keras' torch "
          "backend needs it: install torch first, then reinstall tf_memguard)" % sys.executable,
          file=sys.stderr)
else:
    torch_version, torch_includes, torch_lib, torch_abi = torch
    print("tf_memguard: building the PyTorch glue against PyTorch %s" % torch_version)
    ext_modules.append(PlainSharedLibrary(
        TORCH_GLUE,
        sources=["cc/torch/allocator.cc"],
        depends=HEADERS,
        include_dirs=[HERE] + torch_includes,
        language="c++",
        define_macros=[("_GLIBCXX_USE_CXX11_ABI", str(torch_abi))],
        extra_compile_args=CXXFLAGS,
        extra_link_args=["-L" + torch_lib, "-lc10", "-Wl,-rpath," + torch_lib, "-ldl"],
    ))

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
