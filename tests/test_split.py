"""Layers split by neurons (pyinfer.engine.offload, the split FFN graphs), tested on the CPU: both halves of a split
layer stay in host memory here, so the graph is the one a GPU runs in two halves, computed by one device.
Oracle: the same model unsplit (and its float64 reference). The GPU runs of the same plans are in
tests/test_hybrid.py."""
from __future__ import annotations

import numpy as np
import pytest
from split_harness import decode_steps, split_plan, streamed_graphs_on_cpu

from pyinfer.engine.driver import Model
from pyinfer.engine.placement import Plan
from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml
from pyinfer.native.binding import lib

TOKENS = [1, 5, 77, 200, 3, 9, 250, 11, 299, 42, 17]
N_FF = 128  # the tiny checkpoints' FFN width




@pytest.mark.parametrize("variant", ["llama_relu", "llama_silu", "llama_geglu", "opt"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("hot_rows", [(64, 64), (1, 127), (96, 0)])
def test_split_layers_equal_the_unsplit_model(tiny_files, host_only, variant, sparse, hot_rows):
    """Logits of decode steps and of a prompt batch, and greedy decoding, whatever rows each half holds."""
    path = tiny_files(variant, sparse)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan(hot_rows))
    assert split.hot_rows == {il: k for il, k in enumerate(hot_rows) if 0 < k < N_FF}
    bundled = sparse and variant != "opt"  # OPT's FFN biases keep the three row ops
    for il, k in split.hot_rows.items():
        assert f"blk.{il}.ffn_up.hot.weight" in split.weights
        assert (f"blk.{il}.ffn_bundle.weight" in split.weights) == bundled
        if bundled:  # the CPU's bundle holds its own rows only
            assert split.weights[f"blk.{il}.ffn_bundle.weight"].shape[0] == (3 if variant != "opt" else 2) * (N_FF - k)
    want, got = decode_steps(whole, TOKENS), decode_steps(split, TOKENS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(split.logits(TOKENS), whole.logits(TOKENS), rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    params = SamplerParams(temperature=0)
    whole.reset()
    split.reset()
    a = list(whole.generate_tokens(TOKENS[:3], 32, params, stop_at_eos=False))
    b = list(split.generate_tokens(TOKENS[:3], 32, params, stop_at_eos=False))
    assert a == b


@pytest.mark.parametrize("variant,fused", [("llama_silu", True), ("qwen2", True), ("opt", True), ("qwen3", True),
                                           ("gemma3", True), ("falcon_relu", False)])
def test_attention_on_the_gpu_takes_q_k_v_as_one_matrix(tiny_files, host_only, variant, fused):
    """A layer whose attention goes to the GPU gets q, k and v (and their biases: Qwen2, OPT) as one attn_qkv
    matrix, read through views, per-head q and k norms (Qwen3, Gemma 3) normalizing the views' heads where they lie;
    not where the file has one already (Falcon). Logits and greedy tokens equal the model with three matrices."""
    path = tiny_files(variant, False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    cfg = whole.config
    gpu = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((cfg.n_ff,) * cfg.n_layer))
    for il in range(cfg.n_layer):
        assert (f"blk.{il}.attn_q.weight" in gpu.weights) == (not fused and variant != "falcon_relu")
        assert (f"blk.{il}.attn_qkv.weight" in gpu.weights) == (fused or variant == "falcon_relu")
    if variant in ("qwen2", "opt"):
        assert "blk.0.attn_qkv.bias" in gpu.weights and "blk.0.attn_q.bias" not in gpu.weights
    want, got = decode_steps(whole, TOKENS), decode_steps(gpu, TOKENS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(gpu.logits(TOKENS), whole.logits(TOKENS), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    whole.reset()
    gpu.reset()
    params = SamplerParams(temperature=0)
    assert (list(whole.generate_tokens(TOKENS[:3], 16, params, stop_at_eos=False))
            == list(gpu.generate_tokens(TOKENS[:3], 16, params, stop_at_eos=False)))


def test_split_counts_the_cpu_neurons_only(tiny_files, host_only):
    """The realised density of a split model counts the neurons the host computes (the GPU's would cost a
    copy and a wait per layer and token): rows [k, n_ff) of each split layer."""
    path = tiny_files("llama_relu", True)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((32, 100)))
    split.eval(TOKENS)
    x = split.timings.extra
    assert x["ffn_rows_total"] == len(TOKENS) * ((N_FF - 32) + (N_FF - 100))
    assert 0 < x["ffn_rows_active"] < x["ffn_rows_total"]


def test_cpu_half_of_a_split_layer_is_the_matching_rows(tiny_files):
    """The CPU's half: sparse_ffn over a bundle of rows [k, n_ff) with no selector = the dense FFN's sum over
    those rows (numpy float64 from the file's matrices)."""
    path = tiny_files("llama_silu", False)
    model = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    f = model.file
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64).astype(np.float32)
    gate, up, down_t = (f.dequantize(f"blk.0.{n}.weight") for n in ("ffn_gate", "ffn_up", "ffn_down_t"))
    for k in (0, 1, 64, 127):
        rows = np.concatenate([gate[k:, None], up[k:, None], down_t[k:, None]], axis=1).reshape(-1, 64)
        ctx = ggml.Context(1 << 22)
        bundle = ctx.tensor_from_numpy(rows.astype(np.float32))
        out = ctx.sparse_ffn(bundle, ctx.tensor_from_numpy(x), None, "swiglu")
        graph = ggml.Graph(ctx, [out])  # owns out's memory: kept until out is read
        graph.compute(model.pool)
        g, u = gate[k:] @ x, up[k:] @ x
        want = (g / (1 + np.exp(-g)) * u) @ down_t[k:]
        np.testing.assert_allclose(out.numpy()[:64], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_plan_must_fit_the_model(tiny_files, host_only):
    with pytest.raises(InvalidArgumentError, match="the model has 2"):
        Model(tiny_files("llama_relu", False), n_ctx=64, plan=split_plan((1, 2, 3)))
    with pytest.raises(InvalidArgumentError, match="exclude each other"):
        Model(tiny_files("llama_relu", False), n_ctx=64, plan=split_plan((1, 2)), n_gpu_layers=1)


@pytest.fixture
def streamed_on_cpu(host_only, monkeypatch):
    """Prompt batches build the streamed graph (host neurons in chunks of 48 rows, the GPU's rows as they
    are) but run it on the CPU: what the GPU computes there, chunk by chunk."""
    from pyinfer.models import common

    monkeypatch.setattr(common, "STREAM_ROWS", 48)
    streamed_graphs_on_cpu(monkeypatch)


@pytest.mark.parametrize("variant", ["llama_relu", "llama_silu", "opt", "llama3_rope"])
@pytest.mark.parametrize("sparse", [False, True])
def test_streamed_prompt_graph_equals_the_unsplit_model(tiny_files, streamed_on_cpu, variant, sparse):
    path = tiny_files(variant, sparse)
    prompt = (TOKENS * 4)[:40]  # >= 32 tokens: a streamed batch
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    plan = Plan(attn_gpu=(True, False), hot_rows=(30, 0), head_gpu=False, device_bytes=1, budget=1 << 30,
                layer_us=(0.0, 0.0), head_us=0.0)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=plan)
    assert split.streams_prompts
    want = whole.logits(prompt)
    np.testing.assert_allclose(split.logits(prompt), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    graph = split._graphs[(40, 40, False)].graph
    ops = [lib.ggml_get_op(lib.ggml_graph_node(graph.ptr, i)) for i in range(graph.n_nodes)]
    # layer 0: its 98 host rows in chunks of 48, 48, 2, and its 30 GPU rows; layer 1: 128 host rows in 3
    assert ops.count(lib.GGML_OP_AXPY_ROWS) == 4 + 3


@pytest.mark.parametrize("streamed", [False, True])
def test_gemma4s_double_wide_layers_split_and_stream_whole(tiny_files, host_only, monkeypatch, streamed):
    """Gemma 4's shared-KV layers with FFNs twice as wide (E2B's; the tiny variant's last two, 256 neurons where
    the others have 128): a split at a neuron past the narrow width, decoding and in a streamed prompt batch, computes
    every neuron of the layer (the split and the stream had taken n_ff from the model, not the layer)."""
    from pyinfer.models import common

    if streamed:
        monkeypatch.setattr(common, "STREAM_ROWS", 48)
        streamed_graphs_on_cpu(monkeypatch)
    path = tiny_files("gemma4_ple", False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    assert [whole.config.layer_n_ff(il) for il in range(5)] == [128, 128, 128, 256, 256]
    plan = Plan(attn_gpu=(True, False, False, True, False), hot_rows=(30, 0, 0, 200, 0), head_gpu=False,
                device_bytes=1, budget=1 << 30, layer_us=(0.0,) * 5, head_us=0.0)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=plan)
    assert split.hot_rows == {0: 30, 3: 200}
    assert split.weights["blk.3.ffn_down_t.cold.weight"].shape[0] == 56
    prompt = (TOKENS * 4)[:40] if streamed else TOKENS
    want = whole.logits(prompt)
    np.testing.assert_allclose(split.logits(prompt), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if not streamed:
        whole.reset()
        split.reset()
        want = np.stack([whole.eval([t]).copy() for t in TOKENS])
        np.testing.assert_allclose(np.stack([split.eval([t]).copy() for t in TOKENS]), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())


def test_a_budget_keeps_one_batch_graph(tiny_files):
    """Under a VRAM budget a prompt of a batch and a remainder keeps one batch graph, beside the decode step's:
    the reserve holds one batch's device intermediates (it had kept the n_batch- and the remainder-sized graphs)."""
    model = Model(tiny_files("llama_relu", True), n_ctx=64, n_batch=8)
    model.eval(TOKENS)  # 8 + 3 tokens
    model.eval([4])
    assert sorted(k[0] for k in model._graphs) == [1, 3, 8]  # no budget: the cache keeps what it may reuse
    model.vram_budget = 1 << 40  # as a budget's model has one; the rule is the runtime's, no GPU needed
    model._graphs.clear()
    model.reset()
    model.eval(TOKENS)
    assert [k[0] for k in model._graphs] == [3]
    model.eval([4])
    model.eval(TOKENS[:8])
    assert sorted(k[0] for k in model._graphs) == [1, 8]
