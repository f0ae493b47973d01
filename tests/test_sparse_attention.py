"""Sparse attention projections (models.sparse_attention): q, k and v read the channels of their input whose |x|
passes t_in, the output projection those of the attention's output whose |a| passes t_out; one decoded token on
the CPU sums the rows of the channel-major copies, batches and the GPU run the originals over the masked input.
The engine against the float64 oracle with the same thresholds, its counted channels against the oracle's, the
copies against the originals, placement's charge, and `pyinfer sparsify --attn-skip`."""
from __future__ import annotations

import numpy as np
import pytest
from reference import reference_logits

from pyinfer.engine.driver import Model
from pyinfer.errors import ModelFormatError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.native import ggml
from pyinfer.sparsity import input_sparsity
from pyinfer.sparsity.sparsify import main as sparsify

TOKENS = [1, 7, 3, 9, 4, 12, 30, 5, 2, 8, 11, 6]
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output")


def _samples(src: str) -> dict:
    model = Model(src, n_ctx=64, n_threads=2, kv_type="f32")
    return model.ffn_activations(list(np.random.default_rng(0).integers(0, model.config.n_vocab, 48)))[1]


def _written(src: str, out, target: float, skip: float | None,
             acts: dict | None = None) -> tuple[str, list, list[input_sparsity.AttentionCalibration]]:
    """src with FFN thresholds for target and attention thresholds for skip (0: thresholds of 0, every channel
    read) from its own samples on random tokens, written to out."""
    acts = acts or _samples(src)
    n_layer = GGUFFile(src).config.n_layer
    ffn = input_sparsity.calibrate([(acts[f"ffn_inp.{il}"], acts[f"ffn_act.{il}"]) for il in range(n_layer)], target)
    if skip:
        attention = input_sparsity.calibrate_attention(
            [(acts[f"attn_inp.{il}"], acts[f"attn_out.{il}"]) for il in range(n_layer)], skip)
    else:
        attention = [input_sparsity.AttentionCalibration(0.0, 0.0, 1.0, 1.0)] * n_layer
    input_sparsity.write(src, str(out), ffn, target, "random tokens", attention=attention)
    return str(out), ffn, attention


def _thresholds(ffn, attention) -> dict:
    return {"input_sparsity": ([c.t_x for c in ffn], [c.t_h for c in ffn]),
            "attn_sparsity": ([c.t_in for c in attention], [c.t_out for c in attention])}


@pytest.mark.parametrize("variant", ["llama_silu", "qwen2", "gemma3"])
def test_engine_equals_the_oracle_with_the_same_thresholds(tiny_files, tmp_path, variant):
    """Batches (the originals over masked inputs) and decode steps (the copies' rows) both give the oracle's
    logits; the thresholds change the function beyond the FFN's alone; the channels counted are the oracle's."""
    path, ffn, attention = _written(tiny_files(variant, False), tmp_path / "a.gguf", 0.3, 0.5)
    g = GGUFFile(path)
    ref = reference_logits(g, TOKENS, **_thresholds(ffn, attention))
    ffn_only = reference_logits(g, TOKENS, input_sparsity=_thresholds(ffn, attention)["input_sparsity"])
    model = Model(path, n_ctx=64, n_threads=2, kv_type="f32")
    assert sorted(model.sparse_spec.attn_input) == list(range(g.config.n_layer))
    tol = 2e-3 * np.abs(ref).max()
    np.testing.assert_allclose(model.logits(TOKENS), ref, atol=tol)
    model.reset()
    model.timings.reset()
    np.testing.assert_allclose(np.stack([model.eval([t]).copy() for t in TOKENS]), ref, atol=tol)
    assert np.abs(ffn_only - ref).max() > 10 * tol
    # counted: entries of q's input and of the output projection's above their thresholds, as the oracle has them
    model.reset()
    acts = model.ffn_activations(TOKENS)[1]
    want = sum(int(np.count_nonzero(np.abs(acts[f"attn_inp.{il}"]) > c.t_in))
               + int(np.count_nonzero(np.abs(acts[f"attn_out.{il}"]) > c.t_out)) for il, c in enumerate(attention))
    model.reset()
    model.timings.reset()
    model.logits(TOKENS)
    x = model.timings.extra
    assert x["attn_channels_active"] == pytest.approx(want, rel=0.01)
    assert 0.3 < x["attn_channels_active"] / x["attn_channels_total"] < 0.7  # about 1 - skip


def test_thresholds_of_zero_give_the_ffn_only_file(tiny_files, tmp_path):
    """With t_in = t_out = 0 every channel is read: the file computes what the same file without sparse attention
    does, whether a token decodes (the copies) or a batch runs (the originals)."""
    src = tiny_files("qwen2", False)
    acts = _samples(src)
    path, ffn, _ = _written(src, tmp_path / "zero.gguf", 0.3, 0.0, acts)
    plain = str(tmp_path / "plain.gguf")
    input_sparsity.write(src, plain, ffn, 0.3, "random tokens")
    want = Model(plain, n_ctx=64, n_threads=2, kv_type="f32").logits(TOKENS)
    model = Model(path, n_ctx=64, n_threads=2, kv_type="f32")
    np.testing.assert_allclose(model.logits(TOKENS), want, atol=1e-4 * np.abs(want).max())
    model.reset()
    np.testing.assert_allclose(np.stack([model.eval([t]).copy() for t in TOKENS]), want,
                               atol=2e-3 * np.abs(want).max())


def test_channel_major_copies_hold_the_originals(tiny_files, tmp_path):
    path, _, attention = _written(tiny_files("llama_silu", False), tmp_path / "a.gguf", 0.3, 0.4)
    g = GGUFFile(path)
    for il in range(g.config.n_layer):
        for name in PROJECTIONS:
            np.testing.assert_array_equal(g.dequantize(f"blk.{il}.{name}_t.weight").T,
                                          g.dequantize(f"blk.{il}.{name}.weight"))
    np.testing.assert_allclose(g.metadata["pyinfer.sparsity.attn_input_thresholds"], [c.t_in for c in attention])
    np.testing.assert_allclose(g.metadata["pyinfer.sparsity.attn_output_density"], [c.out_density for c in attention])


def test_a_file_missing_a_copy_is_refused(tiny_files, tmp_path, monkeypatch):
    path, _, _ = _written(tiny_files("llama_silu", False), tmp_path / "a.gguf", 0.3, 0.4)
    g = GGUFFile(path)
    del g.tensors["blk.1.attn_v_t.weight"]
    monkeypatch.setattr("pyinfer.engine.driver.GGUFFile", lambda p: g)
    with pytest.raises(ModelFormatError, match="blk.1.attn_v_t.weight"):
        Model(path, n_ctx=64, n_threads=2)


def test_placement_charges_the_hosts_attention_at_its_density(tiny_files, tmp_path):
    """A host layer reads the channel-major copies at the calibrated shares (at the sparse rate) and its norms
    whole; the GPU holds, and is charged, the originals whole."""
    from pyinfer.engine.placement import ATTENTION_PARTS, model_costs

    path, _, attention = _written(tiny_files("llama_silu", False), tmp_path / "a.gguf", 0.3, 0.5)
    g = GGUFFile(path)
    for il, (layer, c) in enumerate(zip(model_costs(g, 64, 4, True, 32).layers, attention, strict=True)):
        size = {m: int(g.tensors[f"blk.{il}.{m}.weight"].data.nbytes) for m in PROJECTIONS}
        whole = sum(int(g.tensors[name].data.nbytes) for part in ATTENTION_PARTS
                    for name in (f"blk.{il}.{part}.weight", f"blk.{il}.{part}.bias") if name in g.tensors)
        assert layer.attn_bytes == whole
        assert layer.attn_host_dense == whole - sum(size.values())
        read = c.in_density * (size["attn_q"] + size["attn_k"] + size["attn_v"]) + c.out_density * size["attn_output"]
        assert layer.attn_host_sparse == pytest.approx(read, abs=1)
        assert 0.3 < layer.attn_host_sparse / sum(size.values()) < 0.7
    # a file without sparse attention is charged its attention whole on the host
    plain = str(tmp_path / "plain.gguf")
    input_sparsity.write(tiny_files("llama_silu", False), plain,
                         input_sparsity.calibrate([(np.ones((4, g.config.n_embd)), np.ones((4, g.config.n_ff)))]
                                                  * g.config.n_layer, 0.3), 0.3, "ones")
    assert all(la.attn_host_dense is None and la.attn_host_sparse == 0
               for la in model_costs(GGUFFile(plain), 64, 4, True, 32).layers)


def test_sparsify_attn_skip_reports_what_was_read(tiny_files, tmp_path, capsys, monkeypatch):
    """--attn-skip calibrates the projections' thresholds on the calibration text, writes their copies and says
    what share of their bytes the calibration text skipped; the held-out report counts their channels read."""
    from pyinfer.sparsity import corpus

    words = " ".join(f"w{i % 97}" for i in range(6000))
    monkeypatch.setattr(corpus, "held_out_text", lambda progress=True: words[::-1])
    text = tmp_path / "calib.txt"
    text.write_text(words)
    out = tmp_path / "out.gguf"
    src = tiny_files("llama_silu", False)
    assert sparsify([src, "--method", "input", "--target", "0.3", "--attn-skip", "0.4", "--corpus", str(text),
                     "--tokens", "256", "--ctx", "64", "--eval-tokens", "1024", "-o", str(out)]) == 0
    report = capsys.readouterr().out
    line = next(x for x in report.splitlines() if x.startswith("attention projections of"))
    assert "40.0 % of each input's channels skipped" in line
    assert "of the attention projections' input channels" in report
    g = GGUFFile(str(out))
    assert all(f"blk.{il}.attn_q_t.weight" in g.tensors for il in range(g.config.n_layer))
    assert 0.5 < np.mean(g.metadata["pyinfer.sparsity.attn_input_density"]) < 0.7


@pytest.mark.parametrize("skip", ["1.0", "-0.1"])
def test_sparsify_refuses_an_attn_skip_outside_0_1(tiny_files, tmp_path, capsys, skip):
    out = tmp_path / "out.gguf"
    src = tiny_files("llama_silu", False)
    capsys.readouterr()
    assert sparsify([src, "--method", "input", "--target", "0.3", "--attn-skip", skip, "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attn-skip must be in [0, 1)" in err[0], err
    assert not out.exists()


@pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("ngl", [2, 99])
def test_on_the_gpu_as_on_the_cpu(tiny_files, tmp_path, ngl):
    """A layer whose attention is on the GPU runs the originals over the masked input (the copies stay in host
    memory): decoding gives the CPU's logits, which sum the copies' rows."""
    path, _, _ = _written(tiny_files("llama_silu", False), tmp_path / "a.gguf", 0.3, 0.5)
    cpu, gpu = (Model(path, n_ctx=64, n_threads=2, kv_type="f32", n_gpu_layers=n) for n in (0, ngl))
    n_layer = cpu.config.n_layer
    assert not gpu.weights[f"blk.{n_layer - 1}.attn_q_t.weight"].on_device
    want = np.stack([cpu.eval([t]).copy() for t in TOKENS])
    np.testing.assert_allclose(np.stack([gpu.eval([t]).copy() for t in TOKENS]), want,
                               atol=1e-3 * np.abs(want).max())


def test_plan_says_the_gain_of_sparse_ffn_and_attention(tiny_files, tmp_path):
    """`pyinfer plan` on a file with sparse attention models its host attention at the calibrated shares: faster than
    the same file's FFN-only plan under the same budget where rows read sparsely as fast as densely, slower where
    they read at a fifth of the speed (the CPU sums the copies' rows whatever the rate), and it names both in the
    gain line."""
    import subprocess
    import sys

    from test_placement import FLAGS

    from pyinfer.engine.machine import MachineProfile
    from pyinfer.engine.placement import model_costs, solve

    src = tiny_files("llama_silu", False)
    acts = _samples(src)
    path, ffn, _ = _written(src, tmp_path / "a.gguf", 0.3, 0.5, acts)
    plain = str(tmp_path / "plain.gguf")
    input_sparsity.write(src, plain, ffn, 0.3, "random tokens")
    rates = [float(v) for v in FLAGS[1::2]]
    for sparse_rate, faster in ((rates[0], True), (rates[0] / 5, False)):
        machine = MachineProfile("given figures", rates[0], sparse_rate, *rates[2:])
        with_attention, ffn_only = (solve(model_costs(GGUFFile(p), 64, 2, True, 32), machine, 0) for p in (path, plain))
        assert (with_attention.token_us < ffn_only.token_us) == faster
    machine = MachineProfile("given figures", *rates)
    with_attention = solve(model_costs(GGUFFile(path), 64, 2, True, 32), machine, 0)
    dense = solve(model_costs(GGUFFile(path), 64, 2, False, 32), machine, 0)
    text = subprocess.run([sys.executable, "-m", "pyinfer", "plan", "-m", path, "--vram-budget", "0", "-c", "64",
                           "-b", "32", *FLAGS], capture_output=True, text=True, timeout=120, check=True).stdout
    gain = with_attention.tokens_per_second / dense.tokens_per_second
    assert f"the sparse FFN and attention's modelled gain {gain:.2f}x" in text, text


@pytest.mark.parametrize("variant,args,message", [
    ("llama_relu", ["--method", "predictors", "--sparsity", "0.3"], "--attn-skip goes with --method input"),
    ("qwen35", ["--method", "input", "--target", "0.3", "--tokens", "64", "--ctx", "32"],
     "needs layers with q, k, v and output projections")])
def test_sparsify_refuses_attn_skip_where_it_cannot_apply(tiny_files, tmp_path, capsys, monkeypatch, variant, args,
                                                          message):
    """Predictors take no attention thresholds; Qwen3.5's builder reads its attention layers itself (and most of its
    layers are linear attention): both are one-line errors that write nothing."""
    words = " ".join(f"w{i % 97}" for i in range(3000))
    text = tmp_path / "calib.txt"
    text.write_text(words)
    out = tmp_path / "out.gguf"
    src = tiny_files(variant, False)
    capsys.readouterr()
    assert sparsify([src, *args, "--attn-skip", "0.3", "--corpus", str(text), "--eval-tokens", "0",
                     "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("hot_rows", [(64, 64), (1, 127), (128, 0)])
def test_a_placed_model_computes_what_the_host_computes(tiny_files, host_only, tmp_path, hot_rows):
    """A plan with every layer's attention 'on the GPU' (here left in host memory: q, k and v fused into one matrix as
    on a GPU, read as originals over the masked input) and FFNs split by neuron decodes what the whole host model
    decodes from the copies' rows."""
    from split_harness import split_plan

    path, _, _ = _written(tiny_files("llama_silu", False), tmp_path / "a.gguf", 0.3, 0.5)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    placed = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan(hot_rows))
    assert "blk.0.attn_qkv.weight" in placed.weights and "blk.0.attn_q.weight" not in placed.weights
    want = np.stack([whole.eval([t]).copy() for t in TOKENS])
    got = np.stack([placed.eval([t]).copy() for t in TOKENS])
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
