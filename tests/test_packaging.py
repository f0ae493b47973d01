"""The package installs under its own name only: no generic top-level names (models, tools, native,
converters), no module named like a standard-library one, no sys.path edits; and it works from a folder full
of decoys with those names."""
from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hf_tiny import build

import pyinfer
import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import Model

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(pyinfer.__file__).resolve().parent
DECOYS = ["models", "tools", "native", "converters"]


def _python_files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), ROOT / "setup.py",
                   *(ROOT / "docs").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])


def test_installed_top_level_names_are_only_pyinfer():
    # the installed metadata, not the build's pyinfer.egg-info that the checkout's root also holds
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (dist,) = importlib.metadata.distributions(name="pyinfer", path=sorted(site))
    assert dist.read_text("top_level.txt").split() == ["pyinfer"]
    top = set()
    for f in dist.files:
        first = f.parts[0]
        if first == ".." or first.endswith(".dist-info") or first == "__pycache__":
            continue  # console scripts, metadata
        top.add(first.removesuffix(".py").removesuffix(".pth"))
    # an editable install adds setuptools' import hook: it may map nothing but pyinfer
    for name in [t for t in top if t.startswith("__editable__")]:
        if name.endswith("_finder"):
            finder = importlib.import_module(name)
            assert set(finder.MAPPING) == {"pyinfer"}, finder.MAPPING
        top.discard(name)
    assert top <= {"pyinfer"}, top
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert set(scripts) == {"pyinfer", "convert-hf-to-powergguf"}
    assert all(v.startswith("pyinfer.") for v in scripts.values()), scripts


def test_no_module_shadows_the_standard_library():
    # tests/ too: pytest puts that folder first on sys.path
    names = {p.stem for p in _python_files() if p.stem != "__init__"}
    names |= {p.name for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    assert not names & set(sys.stdlib_module_names), sorted(names & set(sys.stdlib_module_names))


def test_nothing_edits_sys_path():
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny")
    oracle = build("llama_silu", str(folder / "hf"))
    path = str(folder / "m.gguf")
    assert conv.main([oracle.folder, "-o", path, "--outtype", "f32"]) == 0
    return path


def _decoy_folder(folder: Path) -> Path:
    """Folders and a profile.py that fail loudly when anything imports them."""
    for name in DECOYS:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(f"raise ImportError('decoy {name}/ was imported')\n")
    (folder / "profile.py").write_text("raise ImportError('decoy profile.py was imported')\n")
    return folder


def test_works_from_a_folder_of_decoys(tiny_gguf, tmp_path):
    decoys = _decoy_folder(tmp_path)
    want = Model(tiny_gguf, n_ctx=32, kv_type="f32").logits([3, 1, 4, 1, 5])
    code = ("import sys, numpy as np, pyinfer; "
            "np.save(sys.argv[2], pyinfer.Model(sys.argv[1], n_ctx=32, kv_type='f32').logits([3, 1, 4, 1, 5]))")
    # `python -c` and `python -m` put the current folder first on the import path: decoys are found first
    out = tmp_path / "logits.npy"
    res = subprocess.run([sys.executable, "-c", code, tiny_gguf, str(out)], cwd=decoys, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(np.load(out), want)
    res = subprocess.run([sys.executable, "-m", "pyinfer", "run", "-m", tiny_gguf, "-p", "The quick", "-n", "8",
                          "--temp", "0", "--ignore-eos"], cwd=decoys, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The quick") and len(res.stdout) > len("The quick\n")
    assert "decoy" not in res.stderr and "eval time" in res.stderr


def test_chat_page_goes_into_wheels(tmp_path):
    """The page of `pyinfer serve` is package data: build_py (what fills a wheel) copies it. An editable
    install would find it in the checkout anyway, so only a build shows a missing declaration."""
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    page = tmp_path / "pyinfer" / "apps" / "server" / "static" / "index.html"
    assert page.read_bytes() == (PACKAGE / "apps" / "server" / "static" / "index.html").read_bytes()
