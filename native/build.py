"""Builds the native library: writes a ninja file for ggml/ and native/ (plus CUDA objects when nvcc is
present), runs ninja, then compiles the cffi module `pyinfer._pyinfer_native` against the archive.

Used by setup.py (`pip install -e .`, `python setup.py build_native`); no other entry point.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "native"
HEADERS = [ROOT / "ggml" / "include" / "ggml.h", ROOT / "native" / "include" / "pyinfer_native.h"]
INCLUDE_DIRS = [ROOT / "ggml" / "include", ROOT / "native" / "include"]

C_FLAGS = "-std=c11 -O3 -fPIC -Wall -Wextra -Werror -pthread -D_GNU_SOURCE"
# SIMD kernels live in files named for their instruction set and are chosen at run time,
# so the rest of the library runs on any x86-64
SIMD_FLAGS = {"_avx2.c": "-mavx2 -mfma -mf16c", "_avx512.c": "-mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c"}
# Hopper machine code plus portable PTX that newer GPUs compile at load time
NVCC_FLAGS = ("-O3 -std=c++17 -Xcompiler -fPIC -Xcompiler -Wall -Werror all-warnings "
              "-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90")


def find_nvcc() -> str | None:
    """nvcc from PATH or CUDA_HOME; PYINFER_NO_CUDA=1 forces a CPU-only build."""
    if os.environ.get("PYINFER_NO_CUDA") == "1":
        return None
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand):
            return cand
    return None


def cuda_library_dirs() -> list[str]:
    """Folders holding libcudart_static.a: CUDA installs put it in lib, lib64 or targets/<arch>/lib."""
    nvcc = Path(find_nvcc() or "/usr/local/cuda/bin/nvcc")
    roots = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")), nvcc.resolve().parent.parent,
             *sorted(Path("/usr/local").glob("cuda*"))]
    found = []
    for root in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            d = root / sub
            if (d / "libcudart_static.a").is_file() and str(d) not in found:
                found.append(str(d))
    if not found:
        raise RuntimeError("nvcc is present but libcudart_static.a is not: set CUDA_HOME or PYINFER_NO_CUDA=1")
    return found


def sources() -> tuple[list[Path], list[Path]]:
    c_files = sorted([*ROOT.glob("ggml/src/**/*.c"), *ROOT.glob("native/src/**/*.c")])
    cu_files = sorted([*ROOT.glob("ggml/src/cuda/*.cu"), *ROOT.glob("native/src/**/*.cu")])
    return c_files, cu_files


def write_ninja(nvcc: str | None) -> Path:
    c_files, cu_files = sources()
    use_cuda = nvcc is not None and bool(cu_files)
    includes = " ".join(f"-I{d}" for d in [*INCLUDE_DIRS, ROOT / "ggml" / "src"])
    defines = "-DGGML_USE_CUDA" if use_cuda else ""
    cc = os.environ.get("CC", "cc")
    lines = [
        f"cflags = {C_FLAGS} {defines} {includes} {os.environ.get('PYINFER_CFLAGS', '')}",
        f"rule cc\n  command = {cc} $cflags $extra -MMD -MF $out.d -c $in -o $out\n  depfile = $out.d\n  deps = gcc",
        "rule ar\n  command = rm -f $out && ar rcs $out $in",
    ]
    if use_cuda:
        lines.append(f"rule nvcc\n  command = {nvcc} {NVCC_FLAGS} {defines} {includes} -MD -MF $out.d -c $in -o $out"
                     "\n  depfile = $out.d\n  deps = gcc")
    objs = []
    for src in c_files:
        obj = BUILD / "obj" / (src.relative_to(ROOT).as_posix().replace("/", "_") + ".o")
        extra = next((f for suffix, f in SIMD_FLAGS.items() if src.name.endswith(suffix)), "")
        lines.append(f"build {obj}: cc {src}\n  extra = {extra}")
        objs.append(obj)
    for src in cu_files if use_cuda else []:
        obj = BUILD / "obj" / (src.relative_to(ROOT).as_posix().replace("/", "_") + ".o")
        lines.append(f"build {obj}: nvcc {src}")
        objs.append(obj)
    lines.append(f"build {BUILD / 'libpyinfer_native.a'}: ar {' '.join(map(str, objs))}")
    BUILD.mkdir(parents=True, exist_ok=True)
    ninja_file = BUILD / "build.ninja"
    text = "\n".join(lines) + "\n"
    if not ninja_file.exists() or ninja_file.read_text() != text:
        ninja_file.write_text(text)
    (BUILD / "cuda").write_text("1" if use_cuda else "0")
    return ninja_file


def run_ninja(ninja_file: Path) -> None:
    ninja = shutil.which("ninja")
    if ninja is None:
        import ninja as ninja_pkg  # the PyPI package ships the binary

        ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
    result = subprocess.run([ninja, "-f", str(ninja_file)], cwd=BUILD, capture_output=True, text=True)
    if result.returncode != 0:  # only a failing build is worth showing
        sys.stderr.write(result.stdout + result.stderr)
        raise RuntimeError("native build failed (see the compiler output above)")


def cdef_text() -> str:
    """The declarations between the CFFI markers of each public header."""
    parts = []
    for header in HEADERS:
        m = re.search(r"// CFFI-BEGIN\n(.*?)// CFFI-END", header.read_text(), re.S)
        if not m:
            raise RuntimeError(f"{header} has no CFFI block")
        parts.append(m.group(1))
    return "\n".join(parts)


def make_ffibuilder(use_cuda: bool):
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef_text())
    libraries = ["m", "pthread"]
    library_dirs = []
    if use_cuda:
        library_dirs += cuda_library_dirs()
        libraries += ["cudart_static", "stdc++", "dl", "rt"]
    ffi.set_source(
        "pyinfer._pyinfer_native",
        "".join(f'#include "{h.name}"\n' for h in HEADERS),
        include_dirs=[str(d) for d in INCLUDE_DIRS],
        extra_objects=[str(BUILD / "libpyinfer_native.a")],
        libraries=libraries,
        library_dirs=library_dirs,
        extra_compile_args=["-O2"],
    )
    return ffi


def build_archive() -> bool:
    """Compiles ggml/ and native/ into build/native/libpyinfer_native.a; returns whether CUDA is in it."""
    nvcc = find_nvcc()
    run_ninja(write_ninja(nvcc))
    return (BUILD / "cuda").read_text() == "1"


def build_inplace() -> Path:
    """Archive + cffi module, placed next to pyinfer/__init__.py (for development and tests)."""
    use_cuda = build_archive()
    ffi = make_ffibuilder(use_cuda)
    tmp = BUILD / "cffi"
    tmp.mkdir(parents=True, exist_ok=True)
    built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
    target = ROOT / "pyinfer" / (
        "_pyinfer_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    # a new file renamed into place: running processes keep the old one mapped (copying over it crashes them)
    tmp_target = target.with_name(target.name + ".tmp")
    shutil.copyfile(built, tmp_target)
    os.replace(tmp_target, target)
    return target


def ffibuilder():
    """Entry point of setup.py's cffi_modules (the archive is built by setup.py's build_ext first)."""
    return make_ffibuilder(find_nvcc() is not None and bool(sources()[1]))


if __name__ == "__main__":
    print(build_inplace(), file=sys.stderr)
