"""Every command answers --help, from any folder (the installed packages, not the checkout, serve it),
and bad input is one line on stderr with exit code 1."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyinfer.errors import PyInferError
from pyinfer.native.ggml import cuda_available

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["run", "chat", "serve", "bench", "plan", "pull", "convert", "perplexity", "profile", "train-predictors",
            "sparsify"]


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfer", *args], cwd=cwd, capture_output=True, text=True,
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


# ---- issue 14: input that is not UTF-8, llama.cpp's seed -1 ----

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    from tools.fuzz.seeds import make_seeds

    return make_seeds(str(tmp_path_factory.mktemp("seeds")), None)["llama-bpe"]


def _one_line_error(result: subprocess.CompletedProcess, words: str) -> None:
    err = result.stderr if isinstance(result.stderr, str) else result.stderr.decode("utf-8", "replace")
    lines = err.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert words in lines[0], err


def test_prompt_file_not_utf8(tiny_gguf, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"Hello \xff world")
    result = _cli("run", "-m", tiny_gguf, "-f", str(prompt), "-n", "2", cwd=tmp_path)
    _one_line_error(result, f"prompt file {prompt} is not UTF-8 text (byte 0xff at offset 6)")


def test_prompt_argument_not_utf8(tiny_gguf, tmp_path):
    argv = [sys.executable.encode(), b"-m", b"pyinfer", b"run", b"-m", tiny_gguf.encode(), b"-p", b"Hi \xff", b"-n",
            b"2"]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=120)
    _one_line_error(result, "the prompt (-p) is not valid UTF-8 text (byte 0xff at character 3)")


def test_seed_minus_one_is_random_as_in_llama_cpp(tiny_gguf, tmp_path):
    result = _cli("run", "-m", tiny_gguf, "-p", "Hello", "-n", "4", "-s", "-1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello")


def test_other_negative_seed_is_one_line(tiny_gguf, tmp_path):
    _one_line_error(_cli("run", "-m", tiny_gguf, "-p", "Hello", "-s", "-2", cwd=tmp_path), "seed must be >= 0, not -2")


@pytest.mark.parametrize("flag,value,words", [("--temp", "nan", "temperature"), ("-t", "-3", "n_threads"),
                                              ("--repeat-penalty", "0", "repeat_penalty"), ("-c", "-5", "n_ctx")])
def test_bad_numbers_are_one_line(tiny_gguf, tmp_path, flag, value, words):
    _one_line_error(_cli("run", "-m", tiny_gguf, "-p", "Hello", "-n", "2", flag, value, cwd=tmp_path), words)


def test_an_error_message_of_several_lines_is_printed_as_one(tiny_gguf, capsys, monkeypatch):
    """Whatever a message holds (a name from a file, a library's text), the CLI prints one line."""
    from pyinfer.apps import cli
    from pyinfer.engine import driver
    from pyinfer.errors import ModelFormatError

    def broken(*args, **kwargs):
        raise ModelFormatError("first\nsecond")
    monkeypatch.setattr(driver, "Model", broken)
    assert cli.main(["run", "-m", tiny_gguf, "-p", "Hello"]) == 1
    assert capsys.readouterr().err == "error: first second\n"


@pytest.mark.skipif(cuda_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("budget,message", [("8GiB", "needs a CUDA build and a GPU"), ("lots", "not a size")])
def test_vram_budget_without_gpu_is_one_line(budget, message, tmp_path):
    result = _cli("run", "-m", "no-such.gguf", "--vram-budget", budget, cwd=tmp_path)
    assert result.returncode == 1 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value,want", [("all", {"n_gpu_layers": 999, "n_cpu_moe": 0}), ("-2", {"n_gpu_layers": 999,
                                          "n_cpu_moe": 0}), ("-7", {"n_gpu_layers": 999, "n_cpu_moe": 0}),
                                          ("3", {"n_gpu_layers": 3, "n_cpu_moe": 0}), ("auto", None), ("-1", None),
                                          ("AUTO", None)])
def test_ngl_takes_llama_cpps_words(value, want):
    """-ngl as llama.cpp's: a count, `all` (or -2 and below) for the whole model, `auto` (or -1, its default) for the
    default placement: a VRAM budget of the GPU's free memory, or the CPU where there is no GPU."""
    import argparse

    from pyinfer.apps.flags import add_placement_args, placement_options

    p = argparse.ArgumentParser()
    add_placement_args(p)
    default = placement_options(p.parse_args([]))
    assert default == ({"vram_budget": "auto", "machine": None} if cuda_available() else {"n_gpu_layers": 0})
    assert placement_options(p.parse_args(["-ngl", value])) == (want or default)
    on_cpu = p.parse_args(["-ngl", value, "--device", "cpu"])
    if want is None:  # auto leaves the choice to --device
        assert placement_options(on_cpu) == {"n_gpu_layers": 0}
    else:
        with pytest.raises(PyInferError, match="contradicts"):
            placement_options(on_cpu)


def test_ngl_of_another_word_is_one_line(tmp_path):
    result = _cli("run", "-m", "no-such.gguf", "-ngl", "most", cwd=tmp_path)
    assert result.returncode == 2 and "expected a number of layers, auto or all, not 'most'" in result.stderr


@pytest.mark.parametrize("tool, args, message", [
    ("bench_kernels", ["--types", "bogus"], "unknown bogus"),
    ("bench_kernels", ["--sizes", "4096x"], "--sizes '4096x'"),
    ("bench_kernels", ["--threads", "0"], "--threads must be >= 1"),
    ("bench_cuda_kernels", ["--shapes", "12xab"], "--shapes '12xab'"),
    ("profile_decode", ["-m", "missing.gguf", "-ngl", "99"], "missing.gguf"),
    ("compare_bench", ["--ours", "missing.json", "--llamacpp", "missing.json"], "missing.json"),
    ("factual_eval", ["-m", "missing.gguf"], "missing.gguf"),
])
def test_tools_bad_input_is_one_line(tool, args, message):
    # the kernel benchmarks had printed a KeyError or ValueError traceback for a bad flag, factual_eval one for a
    # missing model
    result = subprocess.run([sys.executable, "-m", f"tools.{tool}", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and message in lines[0], result.stderr


# every runnable developer tool: python -m tools.NAME from the repository's root (a module, or a folder with a
# __main__.py)
TOOLS = sorted([p.stem for p in (ROOT / "tools").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()]
               + [p.parent.name for p in (ROOT / "tools").glob("*/__main__.py")])


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_answer_help(tool):
    # compare_bench's --help had died on a bare % in a help string
    result = subprocess.run([sys.executable, "-m", f"tools.{tool}", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


# every runnable module of the package (python -m pyinfer.ROOM.NAME), from any folder: the installed package serves it
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "pyinfer").rglob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("module", MODULES)
def test_package_modules_answer_help(module, tmp_path):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


def test_the_cuda_kernel_benchmark_reads_the_checkouts_headers():
    # its cffi declarations come from ggml-impl.h and cuda.h of the checkout; after tools/ moved to the top it looked
    # for them one folder above the repository and died on the GPU machine before timing anything
    from tools import bench_cuda_kernels

    assert "struct ggml_tensor {" in bench_cuda_kernels._tensor_struct()
    assert "ggml_cuda_forward" in bench_cuda_kernels._cuda_api()


def test_run_prints_system_info_as_llama_cpp(tiny_gguf, tmp_path):
    """`pyinfer run` names the kernels this machine runs in llama.cpp's system_info line; the CPU's flags as
    Linux reads them (/proc/cpuinfo) are the oracle."""
    result = _cli("run", "-m", tiny_gguf, "-p", "Hello", "-n", "1", "-t", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("system_info: ")]
    assert line.startswith(f"system_info: n_threads = 2 / {os.cpu_count()} | CPU : ")
    shown = dict(part.strip().split(" = ") for part in line.split(" : ", 1)[1].split("|") if part.strip())
    with open("/proc/cpuinfo") as f:
        flags = set(next(x for x in f if x.startswith("flags")).split(":", 1)[1].split())
    assert shown["AVX2"] == str(int({"avx2", "fma", "f16c"} <= flags))
    assert shown["AVX512"] == str(int("avx512f" in flags))
    if not {"amx_tile", "amx_int8", "avx512bw", "avx512vl"} <= flags:
        assert shown["AMX_INT8"] == "0"  # where the flags are there, the kernel's leave to use the tiles decides
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver, no GPU to run on
        assert shown["CUDA"] == "0"


def test_a_termination_turned_into_another_error_is_still_a_termination():
    """SIGTERM inside terminate_as_interrupt raises Terminated where the program is; a library that catches it there
    and raises its own error (numpy's tofile under the fuzzer's SIGTERM: a TypeError, reported as a traceback) still
    ends as a termination, and an error without a signal stays that error."""
    import os
    import signal
    import time

    from pyinfer.console import Terminated, terminate_as_interrupt

    with pytest.raises(Terminated) as caught, terminate_as_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in here
        except Terminated:
            raise TypeError("expected str, bytes or os.PathLike object, not BufferedWriter") from None
    assert caught.value.signum == signal.SIGTERM and isinstance(caught.value.__cause__, TypeError)
    with pytest.raises(TypeError), terminate_as_interrupt():
        raise TypeError("no signal")
