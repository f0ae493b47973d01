"""pyinfer/sparsity/relufy.py: GGUF -> transformers is exact, and the trained ReGLU student is written back exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_tiny import N_VOCAB, build
from reference import reference_logits

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity import relufy

TOKENS = [1, 5, 77, 200, 3, 9, 250, 11, 299]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def plain_silu(tmp_path_factory):
    """A tiny SwiGLU llama as a plain F32 llama.cpp GGUF, and its float64 oracle."""
    out = tmp_path_factory.mktemp("relufy")
    tiny = build("llama_silu", str(out / "hf"))
    dense = str(out / "dense.gguf")
    assert conv.main([tiny.folder, "-o", str(out / "power.gguf"), "--outtype", "f32", "--dense-gguf", dense]) == 0
    return dense, tiny


def test_to_hf_matches_the_oracle(plain_silu):
    dense, tiny = plain_silu
    hf = relufy.to_hf(GGUFFile(dense))
    with torch.no_grad():
        got = hf(torch.tensor([TOKENS])).logits[0].double().numpy()
    assert rel_err(got, tiny.logits(TOKENS)) < 1e-5  # float32 model vs float64 oracle


def test_trained_student_is_written_back(plain_silu, tmp_path):
    dense, _ = plain_silu
    g = GGUFFile(dense)
    torch.manual_seed(1)
    teacher = relufy.to_hf(g)
    student, acts = relufy.student_of(teacher)
    data = np.random.default_rng(2).integers(0, N_VOCAB, (8, 16))
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    relufy.train(teacher, student, acts, data, steps=3, batch=2, micro=1, lr=1e-2, l1=0.1, device="cpu", seed=3)
    changed = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("layers." in n and "layernorm" not in n for n in changed)

    out = str(tmp_path / "relu.gguf")
    relufy.write_relu_gguf(g, student, out)
    r = GGUFFile(out)
    assert r.config.ffn_kind == "reglu" and r.ffn_layout == "down"
    assert np.array_equal(r.tensors["token_embd.weight"].data, g.tensors["token_embd.weight"].data)
    assert not np.array_equal(r.tensors["blk.0.attn_q.weight"].data, g.tensors["blk.0.attn_q.weight"].data)
    with torch.no_grad():
        want = student(torch.tensor([TOKENS])).logits[0].double().numpy()
    assert rel_err(reference_logits(r, TOKENS), want) < 1e-5
    ev = relufy.evaluate(teacher, student, acts, data[:2], "cpu")
    assert 0 < ev["density"] < 1 and ev["kl"] > 0 and len(ev["density_per_layer"]) == g.config.n_layer


def test_rejects_a_model_that_is_not_swiglu(plain_silu, tmp_path, capsys):
    dense, _ = plain_silu
    g = GGUFFile(dense)
    teacher = relufy.to_hf(g)
    student, _ = relufy.student_of(teacher)
    relu = str(tmp_path / "relu.gguf")
    relufy.write_relu_gguf(g, student, relu)
    rc = relufy.main([relu, "-o", str(tmp_path / "again.gguf"), "--tokens", "x.npy", "--device", "cpu"])
    assert rc == 1 and "SwiGLU llama" in capsys.readouterr().err
    assert not (tmp_path / "again.gguf").exists()
