"""Mixtures of experts split between the devices: experts [0, k) of a layer on the GPU, the rest on the CPU, a
token's experts on both sides at once (models.moe). Oracle: the same model whole on the CPU. On the CPU box the
"GPU" side stays in host memory (host_only), which checks the split's bookkeeping; on a GPU machine the same
plans, budgets and llama.cpp's --n-cpu-moe run for real."""
from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import build
from split_harness import decode_steps, split_plan, streamed_graphs_on_cpu

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import Model
from pyinfer.engine.placement import MachineProfile, minimum_budget, model_costs, solve
from pyinfer.engine.sampling import SamplerParams
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.native import ggml

TOKENS = np.random.default_rng(11).integers(0, 300, 40).tolist()  # >= 32: a prompt batch streams host weights
N_EXPERT = 4
needs_gpu = pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")
# figures that make experts worth more on the GPU than its attention, so small budgets split layers
SPLITTY = MachineProfile("test", cpu_dense_gbps=50.0, cpu_sparse_gbps=5.0, gpu_dense_gbps=2000.0,
                         gpu_sparse_gbps=1000.0, xfer_us=1.0, gpu_layer_us=1.0, cpu_layer_us=1.0)


def _same(model: Model, whole: Model, prompt=TOKENS, batch_tol: float = 1e-3) -> None:
    """Decode steps, a prompt batch (batch_tol: relative to its largest logit) and greedy decoding as the whole
    model's."""
    want = decode_steps(whole, TOKENS[:8])
    np.testing.assert_allclose(decode_steps(model, TOKENS[:8]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    batch = whole.logits(prompt)
    np.testing.assert_allclose(model.logits(prompt), batch, rtol=batch_tol, atol=batch_tol * np.abs(batch).max())
    params = SamplerParams(temperature=0)
    whole.reset()
    model.reset()
    assert (list(model.generate_tokens(TOKENS[:3], 32, params, stop_at_eos=False))
            == list(whole.generate_tokens(TOKENS[:3], 32, params, stop_at_eos=False)))


@pytest.mark.parametrize("variant", ["qwen3moe", "mixtral", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("gpu_experts", [(0, 4), (1, 3), (2, 2), (3, 0)])
def test_expert_splits_equal_the_whole_model(tiny_files, host_only, variant, gpu_experts):
    path = tiny_files(variant, False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan(gpu_experts))
    assert split.hot_rows == {il: k for il, k in enumerate(gpu_experts) if 0 < k < N_EXPERT}
    for il, k in split.hot_rows.items():  # no profile: the first k experts on the GPU
        assert split.weights[f"blk.{il}.ffn_gate_exps.gpu.weight"].ne[2] == k
        assert split.weights[f"blk.{il}.ffn_down_exps.cpu.weight"].ne[2] == N_EXPERT  # the file's, viewed
        slots = {side: split.weights[f"blk.{il}.ffn_exps_slots.{side}"].raw().view(np.int32) for side in ("gpu", "cpu")}
        np.testing.assert_array_equal(slots["gpu"], list(range(k)) + [-1] * (N_EXPERT - k))
        np.testing.assert_array_equal(slots["cpu"], [-1] * k + list(range(k, N_EXPERT)))
    _same(split, whole, TOKENS[:20])  # (a batch of 32 would stream host weights to a GPU)


def test_gemma4_experts_split_beside_its_dense_ffn(tiny_files, host_only):
    """Gemma 4's 26B-A4B layers (5 here): the dense FFN and the router's scale go with the attention, the experts
    split, each side with its own copy of every expert's scale; decode, a batch and greedy decoding as the whole
    model's."""
    path = tiny_files("gemma4_moe", False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((1, 3, 0, 4, 2)))
    assert split.hot_rows == {0: 1, 1: 3, 4: 2}
    file = GGUFFile(path)
    for il in split.hot_rows:
        want = np.frombuffer(file.tensors[f"blk.{il}.ffn_down_exps.scale"].data, np.float32)
        for side in ("gpu", "cpu"):
            np.testing.assert_array_equal(split.weights[f"blk.{il}.ffn_down_exps.scale.{side}"].numpy(), want)
    _same(split, whole, TOKENS[:20])


def test_experts_are_the_solver_units(tiny_files):
    """A layer's costs count experts (the most often routed first), and a budget between none and all of them
    places whole experts."""
    path = tiny_files("qwen3moe", False)
    costs = model_costs(GGUFFile(path), 64, 4, False, 32)
    layer = costs.layers[0]
    assert layer.experts and layer.n_ff == N_EXPERT and layer.group_rows == 1
    np.testing.assert_allclose(layer.freq, [2 / N_EXPERT] * N_EXPERT)  # 2 of 4 a token, no profile: uniform
    full = costs.reserve_bytes + costs.head_bytes + sum(
        la.attn_bytes + la.kv_bytes + la.n_ff * la.neuron_bytes for la in costs.layers)
    half = solve(costs, SPLITTY, (minimum_budget(costs) + full) // 2)
    assert half.device_bytes <= half.budget and 0 < sum(half.hot_rows) < N_EXPERT * len(costs.layers)
    assert solve(costs, SPLITTY, full).hot_rows == (N_EXPERT,) * len(costs.layers)


@needs_gpu
@pytest.mark.parametrize("variant", ["qwen3moe", "mixtral", "olmoe", "gpt_oss", "gemma4_moe"])
def test_on_the_gpu_whole_split_and_by_budget(tiny_files, variant):
    """A batch's GEMMs take F32 weights as TF32 on the GPU (the router excepted): 3e-2 as test_hybrid's."""
    path = tiny_files(variant, False)
    n_layer = GGUFFile(path).config.n_layer
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2, n_batch=32)
    _same(Model(path, n_ctx=64, kv_type="f32", n_batch=32, n_gpu_layers=99), whole, batch_tol=3e-2)
    _same(Model(path, n_ctx=64, kv_type="f32", n_batch=32, n_gpu_layers=99, n_cpu_moe=1), whole, batch_tol=3e-2)
    _same(Model(path, n_ctx=64, kv_type="f32", n_batch=32, plan=split_plan(((1, 3) * n_layer)[:n_layer])), whole,
          batch_tol=3e-2)
    costs = model_costs(GGUFFile(path), 64, 4, False, 32)
    full = costs.reserve_bytes + costs.head_bytes + sum(
        la.attn_bytes + la.kv_bytes + la.n_ff * la.neuron_bytes for la in costs.layers)
    split_seen = False
    for budget in np.linspace(minimum_budget(costs), full, 5).astype(int):
        model = Model(path, n_ctx=64, kv_type="f32", n_batch=32, vram_budget=int(budget), machine=SPLITTY)
        split_seen |= bool(model.hot_rows)
        _same(model, whole, batch_tol=3e-2)
        assert model.device_bytes <= model.device_peak_bytes <= budget
    # gpt-oss and Gemma 4: what goes with the attention (gpt-oss' expert biases, Gemma 4's dense FFN) outweighs these
    # tiny experts, and at these budgets the solver keeps whole layers (split_plan above splits them)
    assert split_seen or variant in ("gpt_oss", "gemma4_moe")


def test_cpu_experts_keep_the_cpu_threads(tiny_files, host_only):
    """-ngl 99 alone leaves the CPU one thread (it only looks up embeddings); with --n-cpu-moe it computes experts
    and keeps its threads (one thread had made a third of the experts on the CPU 7x slower than llama.cpp's)."""
    from pyinfer.engine.threads import default_threads

    path = tiny_files("qwen3moe", False)
    assert Model(path, n_ctx=64, n_gpu_layers=99).n_threads == 1
    cpu_moe = Model(path, n_ctx=64, kv_type="f32", n_gpu_layers=99, n_cpu_moe=1)
    assert cpu_moe.n_threads == default_threads()
    _same(cpu_moe, Model(path, n_ctx=64, kv_type="f32", n_threads=2), TOKENS[:20])


def test_profile_counts_the_routers_choices_and_orders_the_split(tiny_files, tmp_path, host_only, capsys):
    """`pyinfer profile` counts each layer's routings as transformers' routers choose them (an independent oracle),
    stores them without touching a tensor, and the split puts the most routed experts on the GPU."""
    import torch

    from pyinfer.sparsity import profiler
    from pyinfer.sparsity.expert_profile import routing_freq

    path = tiny_files("qwen3moe", False)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. 12345 67890. " * 40)
    out = str(tmp_path / "profiled.gguf")
    assert profiler.main([path, "--corpus", str(text), "--tokens", "96", "--ctx", "48", "-o", out]) == 0
    assert "top 20% share" in capsys.readouterr().out
    profiled = GGUFFile(out)
    freq = profiled.expert_freq
    np.testing.assert_allclose(freq.sum(axis=1), 2.0)  # 2 experts a token
    for name, info in GGUFFile(path).tensors.items():
        assert np.array_equal(profiled.tensors[name].data, info.data), name
    # the oracle: transformers' routers on the same chunks
    chunks, _ = profiler.calibration_chunks(path, [str(text)], 96, 48, progress=False)
    oracle = build("qwen3moe", str(tmp_path / "hf"))  # same seed: the same weights as tiny_files'
    counts = np.zeros_like(freq)
    with torch.no_grad():
        for chunk in chunks:
            logits = oracle.model(torch.tensor([chunk.tolist()]), output_router_logits=True).router_logits
            for il, layer in enumerate(logits):
                counts[il] += np.bincount(torch.topk(layer, 2, dim=-1).indices.ravel().numpy(), minlength=N_EXPERT)
    np.testing.assert_allclose(freq, counts / sum(map(len, chunks)))
    np.testing.assert_allclose(routing_freq(out, chunks, progress=False), freq)
    split = Model(out, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((1, 1)))
    for il in range(2):
        gpu = split.weights[f"blk.{il}.ffn_exps_slots.gpu"].raw().view(np.int32)
        assert gpu[np.argmax(freq[il])] == 0 and (gpu >= 0).sum() == 1
    _same(split, Model(out, n_ctx=64, kv_type="f32", n_threads=2), TOKENS[:20])


@pytest.mark.parametrize("variant", ["mixtral", "gpt_oss"])
def test_llama_cpp_mixture_converts_and_sparsify_refuses(tiny_files, tmp_path, capsys, variant):
    """A mixture of experts as llama.cpp writes it converts to a file that loads (its experts kept as they are:
    the converter had labelled it down_t and the result did not load), and sparsify says in one line that it does
    not make experts sparse (it had named the broken conversion instead)."""
    from pyinfer.sparsity import sparsify

    path = tiny_files(variant, False)
    out = str(tmp_path / "power.gguf")
    assert conv.main([path, "-o", out]) == 0
    assert GGUFFile(out).ffn_layout == "down"
    np.testing.assert_allclose(Model(out, n_ctx=32, kv_type="f32").logits(TOKENS[:9]),
                               Model(path, n_ctx=32, kv_type="f32").logits(TOKENS[:9]), rtol=0, atol=0)
    capsys.readouterr()
    for method in ("predictors", "input"):
        assert sparsify.main([path, "--method", method, "-o", str(tmp_path / "s.gguf"), "--eval-tokens", "0"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "mixture of experts" in err[0]
    assert not (tmp_path / "s.gguf").exists()


@pytest.fixture
def moe_streamed_on_cpu(host_only, monkeypatch):
    """Prompt batches build the streamed graph (host experts in chunks of 3) but run it on the CPU: what the GPU
    computes there, chunk by chunk."""
    from pyinfer.models import moe

    monkeypatch.setattr(moe, "STREAM_EXPERTS", 3)
    streamed_graphs_on_cpu(monkeypatch)


@pytest.mark.parametrize("variant", ["qwen3moe", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("placed", [dict(plan=split_plan((1, 3))), dict(plan=split_plan((0, 2))),
                                    dict(n_gpu_layers=99, n_cpu_moe=1)])
def test_streamed_prompt_equals_the_whole_model(tiny_files, moe_streamed_on_cpu, variant, placed):
    """A prompt of >= 32 tokens computes a layer's host experts in chunks (on the GPU, streamed), each chunk over
    the experts of its own that the side holds, and the GPU's experts as they are."""
    path = tiny_files(variant, False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    model = Model(path, n_ctx=64, kv_type="f32", n_threads=2, **placed)
    assert model.streams_prompts
    np.testing.assert_allclose(model.logits(TOKENS), whole.logits(TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,value,words", [
    ("qwen3moe.expert_count", 5, "ffn_gate_inp.weight has shape"),
    ("qwen3moe.expert_used_count", 5, "expert_used_count 5 is not in"),
    ("qwen3moe.expert_feed_forward_length", 40, "ffn_gate_exps.weight has shape"),
    ("qwen3moe.expert_gating_func", 2, "expert_gating_func 2 is not supported"),
])
def test_expert_metadata_that_disagrees_is_one_line(tiny_files, tmp_path, key, value, words):
    """Expert counts and sizes that disagree with the tensors, or a gating the engine lacks, fail in one line when the
    file is opened (no tensor is read, nothing is allocated)."""
    from gguf import GGMLQuantizationType, GGUFValueType

    from pyinfer.errors import ModelFormatError, UnsupportedError
    from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically

    g = GGUFFile(tiny_files("qwen3moe", False))
    kv = [item for item in g.typed_metadata() if item[0] not in ("general.architecture", "general.alignment", key)]
    kv.append((key, value, GGUFValueType.UINT32, None))
    tensors = [OutTensor(i.name, tuple(reversed(i.ne)), GGMLQuantizationType(i.type), lambda i=i: i.data)
               for i in g.tensors.values()]
    bad = str(tmp_path / "bad.gguf")
    write_atomically([OutFile(bad, "qwen3moe", kv, tensors)])
    with pytest.raises((ModelFormatError, UnsupportedError), match=words) as err:
        GGUFFile(bad)
    assert "\n" not in str(err.value)


def test_qwen3moe_without_norm_topk_prob_reads_as_transformers(tmp_path):
    """config.json without norm_topk_prob: transformers' Qwen3-MoE then weighs the chosen experts by their softmax
    over all experts (the converter had assumed llama.cpp's renormalised weights)."""
    import json

    oracle = build("qwen3moe", str(tmp_path / "hf"))
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    del config["norm_topk_prob"]
    config_path.write_text(json.dumps(config))
    for layer in oracle.model.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    out = str(tmp_path / "m.gguf")
    assert conv.main([str(tmp_path / "hf"), "-o", out, "--outtype", "f32"]) == 0
    assert GGUFFile(out).config.expert_norm is False
    want = oracle.logits(TOKENS[:9])
    np.testing.assert_allclose(Model(out, n_ctx=32, kv_type="f32").logits(TOKENS[:9]), want, rtol=0,
                               atol=1e-4 * np.abs(want).max())


def test_streamed_chunks_cover_only_this_sides_experts(tiny_files, moe_streamed_on_cpu, monkeypatch):
    """With the GPU's experts scattered (a profile's order), a prompt streams runs of the CPU's own experts only,
    in chunks that skip the GPU's (they had been streamed with their neighbours), and equals the whole model."""
    from pyinfer.engine import offload
    from pyinfer.models import moe

    assert moe._chunks(np.array([0, 2, 3, 4, 5, 6, 9]), 3) == [(0, 1), (2, 5), (5, 7), (9, 10)]
    assert moe._chunks(np.array([], np.int64), 3) == []
    monkeypatch.setattr(offload, "expert_order", lambda file, il: np.array([1, 3, 0, 2]))
    path = tiny_files("qwen3moe", False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    model = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((1, 2)))
    gpu = [model.weights[f"blk.{il}.ffn_exps_slots.gpu"].raw().view(np.int32) for il in range(2)]
    assert list(gpu[0]) == [-1, 0, -1, -1] and list(gpu[1]) == [-1, 0, -1, 1]
    np.testing.assert_allclose(model.logits(TOKENS), whole.logits(TOKENS), rtol=1e-5, atol=1e-5)


def test_a_budgeted_model_returns_all_logits_a_reserved_batch_at_a_time(tiny_files, host_only, monkeypatch):
    """The reserve holds the logits of logit_rows tokens (placement.LOGIT_ROWS): all logits of a longer batch come
    in batches of that many, equal to the whole batch's."""
    from pyinfer.engine import placement

    monkeypatch.setattr(placement, "LOGIT_ROWS", 8)
    path = tiny_files("qwen3moe", False)
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2, n_batch=64)
    costs = model_costs(GGUFFile(path), 64, 4, False, 64)
    model = Model(path, n_ctx=64, kv_type="f32", n_threads=2, n_batch=64, vram_budget=minimum_budget(costs),
                  machine=SPLITTY)
    got, want = model.logits(TOKENS), whole.logits(TOKENS)
    assert got.shape == want.shape == (len(TOKENS), whole.config.n_vocab)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert {key[:2] for key in model._graphs} == {(8, 8)} and {key[:2] for key in whole._graphs} == {(40, 40)}
    assert model.eval(TOKENS[:20]).shape == (whole.config.n_vocab,)  # a prompt: one batch, its last token's logits
    assert (20, 1) in {key[:2] for key in model._graphs}


def test_timings_count_the_routings_the_gpus_experts_serve(tiny_files, host_only):
    """--timings: the share of decoded tokens' routings that the GPU's experts served, counted from the router's
    choices, equals what the whole model's routing of the same tokens gives with the split's experts."""
    path = tiny_files("qwen3moe", False)
    split = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((1, 3)), timed=True)
    out = list(split.generate_tokens(TOKENS[:3], 8, SamplerParams(temperature=0), stop_at_eos=False))
    x = split.timings.extra
    decoded = TOKENS[:3] + out[:-1]  # each decode step's input token, after the 3-token prompt batch
    _, captured = Model(path, n_ctx=64, kv_type="f32", n_threads=2).ffn_activations(decoded)
    ids = [captured[f"moe_ids.{il}"][3:] for il in range(2)]  # the 7 single-token steps'
    assert x["routings_total"] == sum(i.size for i in ids) == 7 * 2 * 2
    assert x["routings_gpu"] == int((ids[0] < 1).sum() + (ids[1] < 3).sum())
    assert "experts on the GPU" in split.timings.report()


def test_a_streamed_chunk_holds_at_most_64_mib_of_experts(tmp_path):
    """Mixtral-8x7B's experts (99 MB each at Q4_0) stream one at a time: 16 had made the prompt reserve 1.6 GB,
    above a third of a 4-layer file; Qwen3-30B-A3B's (2.65 MB) 16 at a time."""
    from pyinfer.converters import synthetic
    from pyinfer.models.moe import STREAM_CHUNK_BYTES, stream_experts

    assert stream_experts(99_090_432) == 1 and stream_experts(2_654_208) == 16 and stream_experts(8 << 20) == 8
    path = str(tmp_path / "mix.gguf")
    synthetic.make_moe(path, "mixtral-8x7b", synthetic.Q.Q4_0, n_layer=1, share_weights=True)
    costs = model_costs(GGUFFile(path), 592, 2, False, 512)
    expert = costs.layers[0].neuron_bytes
    assert expert > STREAM_CHUNK_BYTES and expert < costs.reserve_bytes < 6 * expert  # 488 MiB, one expert 94.5


@pytest.mark.parametrize("name,shape", [("blk.1.ffn_down_exps.bias", (4, 63)), ("blk.0.attn_sinks.weight", (5,)),
                                        ("blk.1.ffn_gate_inp.bias", None)])
def test_gpt_oss_biases_and_sinks_that_disagree_are_one_line(tiny_files, tmp_path, name, shape):
    """A gpt-oss file whose expert biases or sinks have the wrong shape, or lack one, fails in one line on opening."""
    from gguf import GGMLQuantizationType

    from pyinfer.errors import ModelFormatError
    from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically

    g = GGUFFile(tiny_files("gpt_oss", False))
    kv = [item for item in g.typed_metadata() if item[0] not in ("general.architecture", "general.alignment")]
    tensors = []
    for i in g.tensors.values():
        if i.name != name:
            tensors.append(OutTensor(i.name, tuple(reversed(i.ne)), GGMLQuantizationType(i.type), lambda i=i: i.data))
        elif shape is not None:
            tensors.append(OutTensor(name, shape, GGMLQuantizationType.F32, lambda: np.zeros(shape, np.float32)))
    bad = str(tmp_path / "bad.gguf")
    write_atomically([OutFile(bad, "gpt-oss", kv, tensors)])
    with pytest.raises(ModelFormatError, match=name.split(".", 2)[-1].replace(".", "\\.")) as err:
        GGUFFile(bad)
    assert "\n" not in str(err.value)


def test_the_expert_cache_moves_routed_experts_to_the_gpu_and_keeps_the_logits(tiny_files, moe_streamed_on_cpu):
    """--expert-cache: decoding a stream that keeps choosing the same experts moves them to the GPU side (the file's
    matrices copied into the leavers' slots, both sides' slots rewritten), and every step's logits, and a prompt
    after the moves, equal the whole model's."""
    _check_expert_cache(tiny_files("qwen3moe", False), tol=1e-4)


@needs_gpu
def test_the_expert_cache_on_the_gpu(tiny_files):
    """The same on the GPU: the moves write device memory between CUDA-graph decode steps."""
    _check_expert_cache(tiny_files("qwen3moe", False), tol=3e-2)


def _check_expert_cache(path: str, tol: float) -> None:
    whole = Model(path, n_ctx=64, kv_type="f32", n_threads=2)
    model = Model(path, n_ctx=64, kv_type="f32", n_threads=2, plan=split_plan((1, 1)), expert_cache=True)
    cache = model.expert_cache
    cache.interval, cache.margin = 2, 0.5
    prompt = whole.logits(TOKENS)
    np.testing.assert_allclose(model.logits(TOKENS), prompt, rtol=tol, atol=tol * np.abs(prompt).max())  # cached
    stream = [TOKENS[0]] * 6 + [TOKENS[1]] * 6 + [TOKENS[2]] * 6  # the same token: the same experts, for a while
    want = decode_steps(whole, stream)
    np.testing.assert_allclose(decode_steps(model, stream), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert cache.swaps > 0
    _, captured = Model(path, n_ctx=64, kv_type="f32", n_threads=2).ffn_activations(stream)
    for il in range(2):
        gpu = model.weights[f"blk.{il}.ffn_exps_slots.gpu"].numpy()
        cpu = model.weights[f"blk.{il}.ffn_exps_slots.cpu"].numpy()
        assert (gpu >= 0).sum() == 1 and ((gpu >= 0) != (cpu >= 0)).all()
        last = np.bincount(captured[f"moe_ids.{il}"][-6:].ravel(), minlength=N_EXPERT)
        assert last[np.flatnonzero(gpu >= 0)[0]] > 0  # the GPU holds one of the last token's experts
        held = int(np.flatnonzero(gpu >= 0)[0])
        mats = [model.weights[f"blk.{il}.ffn_{m}_exps.gpu.weight"].raw() for m in ("gate", "up", "down")]
        files = [np.frombuffer(GGUFFile(path).tensors[f"blk.{il}.ffn_{m}_exps.weight"].data, np.uint8).reshape(
            N_EXPERT, -1)[held] for m in ("gate", "up", "down")]
        for got, want in zip(mats, files, strict=True):
            np.testing.assert_array_equal(got.reshape(-1), want)
    np.testing.assert_allclose(model.logits(TOKENS), prompt, rtol=tol, atol=tol * np.abs(prompt).max())


def test_a_whole_gpt_oss_layer_moves_what_its_plan_counts(tiny_files, host_only, monkeypatch):
    """-ngl 99 on gpt-oss: a layer's experts go to the GPU with the one bias tensor moe_ffn reads, which the
    placement counts; the file's three expert bias tensors (read by no graph) had gone along too, 2.5 KB a tiny
    layer and ~1.1 MB a gpt-oss-20b one beyond the budget's count."""
    from pyinfer.native import ggml as g

    moved: dict[str, int] = {}
    monkeypatch.setattr(g.Tensor, "to_device", lambda self: moved.__setitem__(self.name, self.nbytes) or self)
    path = tiny_files("gpt_oss", False)
    Model(path, n_ctx=64, kv_type="f32", n_threads=2, n_gpu_layers=99)
    file = GGUFFile(path)
    for il in range(2):
        assert {k for k in moved if k.startswith(f"blk.{il}.ffn_")} == {
            f"blk.{il}.ffn_{m}_exps.weight" for m in ("gate", "up", "down")} | {
            f"blk.{il}.ffn_exps_biases", f"blk.{il}.ffn_gate_inp.weight", f"blk.{il}.ffn_gate_inp.bias"}
        assert moved[f"blk.{il}.ffn_exps_biases"] == sum(
            file.tensors[f"blk.{il}.ffn_{m}_exps.bias"].data.nbytes for m in ("gate", "up", "down"))


def test_timings_count_decoded_tokens_only(tiny_files, host_only):
    """A prompt whose last batch holds one token is not a decoded token (its routings had been counted)."""
    path = tiny_files("qwen3moe", False)
    model = Model(path, n_ctx=64, kv_type="f32", n_threads=2, n_batch=4, plan=split_plan((1, 3)), timed=True)
    model.eval(TOKENS[:5])  # batches of 4 and 1
    assert model.timings.extra.get("routings_total", 0) == 0
    model.eval(TOKENS[5:6])
    assert model.timings.extra["routings_total"] == 2 * 2  # 2 layers, 2 experts a token
