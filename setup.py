"""Builds tf_memguard's native parts.

* ``tf_memguard/libtfmg_core.so``: the C++ core (cc/tfmg) as a shared library with a
  plain C interface, so that every user in a process shares one copy and one pool per
  device.
* ``tf_memguard/_core*.so``: the pybind11 bindings, linked to the core (rpath $ORIGIN).

The list of core sources is ``cc/core_sources.txt``, read by every build (this file and
CMakeLists.txt) so they cannot drift apart.
"""
import os
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
        if ext.name == "tf_memguard._core":
            core_dir = os.path.dirname(self.get_ext_fullpath("tf_memguard.libtfmg_core"))
            ext.extra_link_args = ext.extra_link_args + [
                "-L" + core_dir, "-l:libtfmg_core.so", "-Wl,-rpath,$ORIGIN"]
        super().build_extension(ext)


def pybind11_include():
    import pybind11
    return pybind11.get_include()


core = PlainSharedLibrary(
    "tf_memguard.libtfmg_core",
    sources=read_sources("core_sources.txt"),
    include_dirs=[HERE],
    language="c++",
    extra_compile_args=CXXFLAGS,
    extra_link_args=["-Wl,-soname,libtfmg_core.so", "-pthread"],
)

bindings = Extension(
    "tf_memguard._core",
    sources=["cc/python/bindings.cc"],
    include_dirs=[HERE, pybind11_include()],
    language="c++",
    extra_compile_args=CXXFLAGS,
)

setup(ext_modules=[core, bindings], cmdclass={"build_ext": BuildExt})
