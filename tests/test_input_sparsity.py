"""Training-free input sparsity (pyinfer.sparsity.input_sparsity, sparse_ffn.input_ffn): gate and up sum the
rows of their channel-major copies whose |x| passes t_x, down the rows of ffn_down_t whose |h| passes t_h; the
engine against the float64 oracle with the same thresholds, the copies against the row-major originals, and
`pyinfer sparsify --method input`'s bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_logits

from pyinfer.engine.driver import Model
from pyinfer.errors import InvalidArgumentError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.native import ggml
from pyinfer.sparsity import input_sparsity
from pyinfer.sparsity.sparsify import main as sparsify

TOKENS = [1, 7, 3, 9, 4, 12, 30, 5, 2, 8, 11, 6]


def _calibrated(tiny_files, variant: str, target: float, out) -> tuple[str, list[float], list[float]]:
    """The tiny model of variant with thresholds from its own FFN samples on random tokens, written to out."""
    src = tiny_files(variant, False)
    model = Model(src, n_ctx=64, n_threads=2, kv_type="f32")
    _, acts = model.ffn_activations(list(np.random.default_rng(0).integers(0, model.config.n_vocab, 48)))
    layers = [(acts[f"ffn_inp.{il}"], acts[f"ffn_act.{il}"]) for il in range(model.config.n_layer)]
    t_x, t_h = input_sparsity.thresholds(layers, target)
    input_sparsity.write(src, str(out), t_x, t_h, target, "random tokens")
    return str(out), t_x, t_h


@pytest.mark.parametrize("variant", ["llama_silu", "llama_geglu"])
def test_engine_equals_the_oracle_with_the_same_thresholds(tiny_files, variant, tmp_path):
    path, t_x, t_h = _calibrated(tiny_files, variant, 0.4, tmp_path / "input.gguf")
    ref = reference_logits(GGUFFile(path), TOKENS, input_sparsity=(t_x, t_h))
    dense = reference_logits(GGUFFile(path), TOKENS)
    model = Model(path, n_ctx=64, n_threads=2, kv_type="f32")
    assert model.sparse_spec is not None and model.sparse_spec.kind == "input"
    tol = 2e-3 * np.abs(ref).max()
    np.testing.assert_allclose(model.logits(TOKENS), ref, atol=tol)  # a batch: every token under its masks
    model.reset()
    np.testing.assert_allclose(np.stack([model.eval([t]).copy() for t in TOKENS]), ref, atol=tol)
    assert np.abs(dense - ref).max() > 10 * tol  # the thresholds really change the function
    density = model.timings.extra["ffn_rows_active"] / model.timings.extra["ffn_rows_total"]
    assert 0.1 < density < 0.6  # down's share of neurons read, near 1 - s_h (s_h = 0.72)


def test_sparse_off_runs_the_dense_ffn(tiny_files, tmp_path):
    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.5, tmp_path / "input.gguf")
    ref = reference_logits(GGUFFile(path), TOKENS)
    model = Model(path, n_ctx=64, n_threads=2, kv_type="f32", sparse=False)
    np.testing.assert_allclose(model.logits(TOKENS), ref, atol=2e-3 * np.abs(ref).max())


def test_channel_major_copies_hold_the_originals(tiny_files, tmp_path):
    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.3, tmp_path / "input.gguf")
    g = GGUFFile(path)
    for il in range(g.config.n_layer):
        for name in ("ffn_gate", "ffn_up"):
            np.testing.assert_array_equal(g.dequantize(f"blk.{il}.{name}_t.weight").T,
                                          g.dequantize(f"blk.{il}.{name}.weight"))
    assert g.metadata["pyinfer.sparsity.kind"] == "input"


@given(st.floats(0.01, 0.9))
def test_split_skips_the_target_share_of_bytes(target):
    s_x, s_h = input_sparsity.split(target)
    assert 0 <= s_x < 1 and 0 < s_h <= input_sparsity.MAX_H and s_h >= s_x
    assert (2 * s_x + s_h) / 3 == pytest.approx(target)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 0.99])
def test_targets_outside_what_can_be_skipped_are_refused(target):
    with pytest.raises(InvalidArgumentError, match="--target"):
        input_sparsity.split(target)


def test_a_sparsified_file_is_refused(tiny_files, tmp_path):
    path, t_x, t_h = _calibrated(tiny_files, "llama_silu", 0.3, tmp_path / "input.gguf")
    with pytest.raises(InvalidArgumentError, match="already sparsified"):
        input_sparsity.write(path, str(tmp_path / "again.gguf"), t_x, t_h, 0.3, "none")
    assert not (tmp_path / "again.gguf").exists()


def test_a_relu_model_is_refused(tiny_files, tmp_path):
    with pytest.raises(UnsupportedError, match="SwiGLU/GeGLU"):
        input_sparsity.write(tiny_files("llama_relu", False), str(tmp_path / "x.gguf"), [0.0] * 2, [0.0] * 2, 0.5,
                             "none")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [(["--target", "1.5"], "--target must be in (0, 1)"),
                                          (["--target", "0.5"], "SwiGLU/GeGLU")])
def test_sparsify_bad_input_is_one_line_and_writes_nothing(tiny_files, tmp_path, capsys, args, message):
    out = tmp_path / "out.gguf"
    model = tiny_files("llama_relu", False)
    assert sparsify([model, "--method", "input", *args, "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("ngl", [1, 99])
def test_on_the_gpu_as_on_the_cpu(tiny_files, tmp_path, ngl):
    """-ngl moves the channel-major copies with the layer. Decoding (float32 GEMVs on both devices) gives the
    CPU's logits; 40-token batches run cuBLAS GEMMs in TF32 (and with a layer left on the CPU stream its weights
    in), whose ~1e-3 error flips the masks of entries at their threshold, so they give the CPU's logits under
    thresholds of 0, where nothing sits at a threshold, and the CPU's greedy tokens under calibrated ones."""
    path, t_x, t_h = _calibrated(tiny_files, "llama_silu", 0.4, tmp_path / "input.gguf")
    zero = str(tmp_path / "zero.gguf")
    input_sparsity.write(tiny_files("llama_silu", False), zero, [0.0] * len(t_x), [0.0] * len(t_h), 0.4, "none")
    tokens = (TOKENS * 4)[:40]
    for f in (path, zero):
        cpu, gpu = (Model(f, n_ctx=64, n_threads=2, kv_type="f32", n_gpu_layers=n) for n in (0, ngl))
        assert gpu.weights["blk.1.ffn_gate_t.weight"].on_device
        want = np.stack([cpu.eval([t]).copy() for t in TOKENS])
        np.testing.assert_allclose(np.stack([gpu.eval([t]).copy() for t in TOKENS]), want,
                                   atol=1e-4 * np.abs(want).max())
        cpu.reset()
        gpu.reset()
        want, got = cpu.logits(tokens), gpu.logits(tokens)
        if f == zero:
            np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
        else:
            assert np.isfinite(got).all() and np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
