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
