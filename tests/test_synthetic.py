"""The synthetic models' random weights: zero-mean matrices of the asked spread, and mixtures whose routers spread
a stream's tokens over the experts in every layer (a shared mean direction had sent every token to the same
experts past the first layer), more unevenly with a router skew."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gguf_quants

from pyinfer.converters import synthetic
from pyinfer.engine.driver import Model
from pyinfer.native import ggml
from pyinfer.sparsity.expert_profile import routing_freq, top_share


@pytest.mark.parametrize("qtype", [synthetic.Q.Q4_0, synthetic.Q.Q8_0, synthetic.Q.F16, synthetic.Q.MXFP4,
                                   synthetic.Q.Q4_K, synthetic.Q.Q6_K])
def test_random_matrices_have_zero_mean_and_the_asked_spread(qtype):
    """(The K-quants, which the engine's quantizer writes, read back by gguf-py's dequantizer.)"""
    raw = synthetic.random_weight(np.random.default_rng(3), qtype, (256, 512), 0.05)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if qtype in (synthetic.Q.Q4_K, synthetic.Q.Q6_K):
        w = gguf_quants.dequantize(raw, qtype).astype(np.float64)
    else:
        w = ggml.dequantize(int(qtype), raw, 256 * 512).astype(np.float64)
    assert abs(w.mean()) < 0.01 * w.std()
    assert w.std() == pytest.approx(0.05, rel=0.05)


def test_q4_k_m_mix_types_each_tensor_as_llama_quantize_and_runs(tmp_path):
    """llama-quantize's Q4_K_M (llama_tensor_get_type): Q6_K for output.weight and for attn_v and ffn_down of layers
    i < n/8, i >= 7n/8 and every third from n/8 + 2 (of 8 layers: 0, 3, 6, 7); Q4_K for the rest; file type 15; the
    file runs as the float64 reference computes it."""
    path = str(tmp_path / "q4km.gguf")
    synthetic.make_llama(path, "small", synthetic.Q.Q4_K, n_layer=8, dense=True, share_weights=True, mix="q4_k_m")
    reader = GGUFReader(path)
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 15
    wide = {"output.weight"} | {f"blk.{il}.{m}.weight" for il in (0, 3, 6, 7) for m in ("attn_v", "ffn_down")}
    for t in reader.tensors:
        if t.tensor_type != synthetic.Q.F32:
            assert t.tensor_type == (synthetic.Q.Q6_K if t.name in wide else synthetic.Q.Q4_K), t.name
    from reference import reference_logits

    from pyinfer.formats.gguf_file import GGUFFile

    tokens = list(range(1, 17))
    want = reference_logits(GGUFFile(path), tokens)
    got = Model(path, n_ctx=64, kv_type="f32", n_threads=2).logits(tokens)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_synthetic_mixture_routes_tokens_to_many_experts_in_every_layer(tmp_path):
    rng = np.random.default_rng(1)
    chunks = [rng.integers(300, 512, 64).astype(np.int32) for _ in range(4)]
    shares = {}
    for skew in (0.0, 1.0):
        path = str(tmp_path / f"moe{skew}.gguf")
        synthetic.make_moe(path, "tiny-moe", synthetic.Q.Q4_0, router_skew=skew)
        freq = routing_freq(path, chunks, progress=False)  # (3 layers, 32 experts)
        np.testing.assert_allclose(freq.sum(axis=1), 4.0)
        if skew == 0.0:
            assert ((freq > 0).sum(axis=1) >= 24).all()  # of 32 experts, over 256 tokens
            assert (freq.max(axis=1) < 0.6).all()
        shares[skew] = np.mean([top_share(f) for f in freq])
    assert shares[1.0] > shares[0.0] + 0.1


def test_synthetic_mixture_routes_as_evenly_in_its_last_layer_as_in_its_first(tmp_path):
    """12 layers sharing their weights, as the benchmarks' files: random attention's shared direction had grown until
    the most routed 20 % of experts took 58 % of the routings by layer 10 (26 % in layer 0)."""
    rng = np.random.default_rng(1)
    chunks = [rng.integers(300, 512, 64).astype(np.int32) for _ in range(4)]
    shares = {}
    for skew in (0.0, 0.2):
        path = str(tmp_path / f"moe{skew}.gguf")
        synthetic.make_moe(path, "tiny-moe", synthetic.Q.Q4_0, router_skew=skew, n_layer=12, share_weights=True)
        shares[skew] = np.array([top_share(f) for f in routing_freq(path, chunks, progress=False)])
    assert (shares[0.0] < 0.34).all()  # sampling alone: 0.23-0.31
    assert shares[0.2].mean() > shares[0.0].mean()


@pytest.mark.parametrize(("experts", "n_layer", "tol"), [(synthetic.Q.F32, 2, 1e-4), (synthetic.Q.MXFP4, 1, 2e-2)])
def test_synthetic_gpt_oss_runs_as_the_numpy_reference(tmp_path, experts, n_layer, tol):
    """The gpt-oss shapes' extras (sinks, biases, windowed layers, its norm names) make a file that loads and
    runs as the float64 reference computes it; with MXFP4 experts as gpt-oss' files have them (the CPU rounds
    their inputs to Q8_0 blocks: one layer, since a second one's router can then break a near-tie otherwise)."""
    from reference import reference_logits

    from pyinfer.engine.driver import Model
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "oss.gguf")
    synthetic.make_moe(path, "tiny-oss", synthetic.Q.F32, n_layer=n_layer, expert_type=experts)
    g = GGUFFile(path)
    assert g.config.attn_sinks and g.config.expert_bias and g.config.windowed(0)
    assert g.tensors["blk.0.ffn_up_exps.weight"].type == experts
    tokens = list(range(300, 340))
    want = reference_logits(g, tokens)
    got = Model(path, n_ctx=64, kv_type="f32", n_threads=2).logits(tokens)
    assert np.abs(got - want).max() < tol * np.abs(want).max()


@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen35moe"])
def test_synthetic_qwen35_runs_a_long_stream_in_bounds(tmp_path, shape):
    """A random Qwen3.5, dense or a mixture (llama.cpp's layout, every fourth layer full attention), loads and runs 600
    tokens with its recurrent states bounded (finite logits of a steady size), a prompt in batches as in one."""
    from pyinfer.engine.driver import Model

    path = str(tmp_path / "q35.gguf")
    synthetic.make_qwen35(path, shape, synthetic.Q.Q8_0, n_layer=8, share_weights=True)
    model = Model(path, n_ctx=1024, n_batch=128)
    assert model.config.recurrent_layers == (True, True, True, False) * 2
    tokens = np.random.default_rng(2).integers(300, 512, 600).tolist()
    logits = model.logits(tokens)
    assert np.isfinite(logits).all() and np.abs(logits[-50:]).max() < 10 * np.abs(logits[:50]).max()
    model.reset()
    model.eval(tokens[:300])
    # batches of other sizes sum in other orders (a mixture's experts: GEMM tiles or dot products): 1e-5 apart
    np.testing.assert_allclose(model.eval(tokens[300:]), logits[-1], rtol=0, atol=1e-4 * np.abs(logits).max())


def test_synthetic_gemma4_mixture_loads_routes_evenly_and_batches_as_one(tmp_path):
    """A random Gemma 4 mixture as llama.cpp's converter writes one (its experts' gate and up fused, per-expert scales,
    windowed layers with values and global ones without): its config, tokens routed to most experts in every layer,
    and a prompt in batches computing what one batch does."""
    from pyinfer.engine.driver import Model
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "g4.gguf")
    synthetic.make_gemma4(path, "tiny-gemma4moe", synthetic.Q.Q8_0)
    g = GGUFFile(path)
    cfg = g.config
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_layer, cfg.final_logit_softcap) == (8, 2, 64, 6, 30.0)
    assert [cfg.windowed(il) for il in range(6)] == [True] * 5 + [False] and cfg.v_from_k
    sizes = (cfg.layer_head_dim(0), cfg.layer_head_dim(5), cfg.layer_n_head_kv(0), cfg.layer_n_head_kv(5))
    assert sizes == (32, 64, 2, 1)
    assert g.tensors["blk.0.ffn_gate_exps.weight"].ne == (128, 64, 8)  # read as the two halves of the fused tensor
    rng = np.random.default_rng(3)
    freq = routing_freq(path, [rng.integers(300, 512, 64).astype(np.int32) for _ in range(4)], progress=False)
    np.testing.assert_allclose(freq.sum(axis=1), 2.0)
    assert ((freq > 0).sum(axis=1) >= 7).all()
    model = Model(path, n_ctx=256, n_batch=32)
    tokens = rng.integers(300, 512, 100).tolist()
    whole = model.logits(tokens)
    assert np.isfinite(whole).all()
    model.reset()
    model.eval(tokens[:50])
    np.testing.assert_allclose(model.eval(tokens[50:]), whole[-1], rtol=0, atol=1e-4 * np.abs(whole).max())
