"""PyInfer's build: ninja compiles the C/CUDA engine into an archive, cffi binds it (native/build.py)."""

import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import build as native_build  # noqa: E402


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
