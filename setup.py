"""PyInfer's build: ninja compiles the C/CUDA engine into an archive, cffi binds it (native/build.py)."""

import importlib.util
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_ext import build_ext


def load_native_build():
    """native/build.py by its path: it is a build script, not a module of the installed package."""
    spec = importlib.util.spec_from_file_location("pyinfer_native_build", Path(__file__).parent / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native_build = load_native_build()


class BuildNative(Command):
    """`python setup.py build_native`: rebuild the engine in place (development)."""

    description = "build the native engine and the cffi module in place"
    user_options = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        print(f"built {native_build.build_inplace()}")


class BuildExt(build_ext):
    """Runs ninja before cffi compiles the extension that links its archive."""

    def run(self):
        native_build.build_archive()
        super().run()


setup(
    cffi_modules=["native/build.py:ffibuilder"],
    cmdclass={"build_native": BuildNative, "build_ext": BuildExt},
)
