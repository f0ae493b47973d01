"""`pyinfer bench`: llama-bench's rows and its name for the file's type."""
from __future__ import annotations

import json

from gguf import GGMLQuantizationType as Q
from hf_tiny import build

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.apps.bench import bench, file_type_name
from pyinfer.engine.threads import default_threads
from pyinfer.native.ggml import cuda_available


def test_file_type_comes_from_general_file_type():
    # a Q4_K_M file holds Q5_0, Q6_K and Q8_0 tensors too: the key names it, not any one tensor
    types = [Q.Q5_0, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.F32]
    assert file_type_name({"general.file_type": 15}, types) == "Q4_K - Medium"
    assert file_type_name({"general.file_type": 1}, types) == "F16"
    assert file_type_name({"general.file_type": 0}, types) == "all F32"
    assert file_type_name({"general.file_type": 999}, types) == "unknown, may not work"


def test_file_type_guessed_from_the_commonest_tensor_type_as_llama_cpp_does():
    assert file_type_name({}, [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.F32]) == "Q4_K - Medium (guessed)"
    assert file_type_name({}, [Q.Q8_0, Q.F32, Q.Q8_0]) == "Q8_0 (guessed)"
    assert file_type_name({"general.file_type": "q4_0"}, [Q.Q5_0]) == "Q5_0 (guessed)"
    assert file_type_name({}, []) == "unknown, may not work"


def test_bench_rows_on_a_tiny_model(tmp_path):
    oracle = build("llama_silu", str(tmp_path / "hf"))
    path = str(tmp_path / "m.gguf")
    assert conv.main([oracle.folder, "-o", path, "--outtype", "q8_0"]) == 0
    rows = json.loads(bench(path, [8], [4], 2, "json", {"n_threads": 1}))
    assert [r["test"] for r in rows] == ["pp8", "tg4"]
    for r in rows:
        assert r["model"].startswith("llama ") and r["model"].endswith(" Q8_0")
        assert len(r["samples_ts"]) == 2 and all(x > 0 for x in r["samples_ts"])
        assert r["backend"] == "CPU" and r["threads"] == 1
        assert (r["driver_bytes"] is None) == (not cuda_available())  # the driver's count wherever a GPU is
    (default,) = json.loads(bench(path, [8], [0], 1, "json", {}))
    assert default["threads"] == default_threads()
    table = bench(path, [8], [0], 1, "md", {"n_threads": 1})
    assert "| pp8 |" in table and "Q8_0" in table


def test_depth_runs_every_test_after_that_many_tokens_in_the_cache(tmp_path):
    """llama-bench's -d: each test starts with D tokens already in the cache (not timed), and is named
    "pp8 @ d16" as llama-bench names it; a negative depth is one line of error."""
    import subprocess
    import sys

    import numpy as np
    import pytest

    from pyinfer.apps.bench import run_test
    from pyinfer.engine.driver import Model
    from pyinfer.errors import InvalidArgumentError

    oracle = build("llama_silu", str(tmp_path / "hf"))
    path = str(tmp_path / "m.gguf")
    assert conv.main([oracle.folder, "-o", path, "--outtype", "f32"]) == 0
    rows = json.loads(bench(path, [8], [4], 1, "json", {"n_threads": 1}, [0, 16]))
    assert [(r["test"], r["n_depth"]) for r in rows] == [("pp8", 0), ("tg4", 0), ("pp8 @ d16", 16), ("tg4 @ d16", 16)]
    assert "| tg4 @ d16 |" in bench(path, [0], [4], 1, "md", {"n_threads": 1}, [16])
    model = Model(path, n_ctx=40, n_threads=1)
    run_test(model, "tg", 4, 1, np.random.default_rng(0), depth=16)
    assert model.n_past == 16 + 4  # the timed tokens came after the depth's
    with pytest.raises(InvalidArgumentError, match="depths must be >= 0"):
        bench(path, [8], [0], 1, "json", {}, [-1])
    res = subprocess.run([sys.executable, "-m", "pyinfer", "bench", "-m", path, "-d", "-4", "-p", "8", "-n", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1 and "depths" in res.stderr
