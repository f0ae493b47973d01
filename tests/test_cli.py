"""Every command answers --help, from any folder (the installed packages, not the checkout, serve it),
and bad input is one line on stderr with exit code 1."""
from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = ["run", "chat", "serve", "bench", "plan", "pull", "convert", "perplexity", "profile", "train-predictors",
            "sparsify"]


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfer.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_from_any_folder(command, tmp_path):
    result = _cli(command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.parametrize("command", ["run", "bench", "perplexity", "sparsify", "convert"])
def test_truncated_model_is_one_line(command, tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 64)
    extra = {"perplexity": ["-f", str(bad)], "sparsify": ["-o", str(tmp_path / "o.gguf")],
             "convert": ["-o", str(tmp_path / "o.gguf")]}.get(command, [])
    args = [str(bad), *extra] if command in ("sparsify", "convert") else ["-m", str(bad), *extra]
    result = _cli(command, *args, cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "o.gguf").exists()
