"""End to end on the GPU: whole models (-ngl 99) and partial offload against the CPU engine.
Skipped without a CUDA build and a GPU; run on the device machine (log in docs/GPU_TEST_LOG.md)."""
from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import GEMMA4_VARIANTS, N_VOCAB, QWEN35_VARIANTS, VARIANTS, build

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import Model
from pyinfer.engine.sampling import SamplerParams
from pyinfer.native import ggml
from pyinfer.native.binding import lib

pytestmark = pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")

TOKENS = np.random.default_rng(3).integers(0, N_VOCAB, 21).tolist()
VARIANT_LAYERS = 2  # layers of the tiny checkpoints: -ngl 2 is the head and the second layer, as llama.cpp counts


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(variant: str, outtype: str = "f32") -> str:
        if (variant, outtype) not in cache:
            folder = tmp_path_factory.mktemp(variant)
            tiny = build(variant, str(folder / "hf"))
            out = str(folder / "m.gguf")
            assert conv.main([tiny.folder, "-o", out, "--outtype", outtype]) == 0
            cache[(variant, outtype)] = out
        return cache[(variant, outtype)]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("ngl", [2, 99])
def test_tiny_models_on_gpu_match_cpu(converted, variant, ngl):
    path = converted(variant)
    cpu_model = Model(path, n_ctx=64, kv_type="f32")
    gpu_model = Model(path, n_ctx=64, kv_type="f32", n_gpu_layers=ngl)
    # decode steps (GEMV kernels; from the second step on, CUDA graph replays) in float32 arithmetic
    cpu_steps = np.array([cpu_model.eval([t]) for t in TOKENS[:6]])
    gpu_steps = np.array([gpu_model.eval([t]) for t in TOKENS[:6]])
    step_err = rel_err(gpu_steps, cpu_steps)
    # a prompt batch goes through cuBLAS, which runs F32 weights in TF32 (10-bit mantissa)
    batch_err = rel_err(gpu_model.logits(TOKENS), cpu_model.logits(TOKENS))
    print(f"\n{variant} ngl={ngl}: decode rel err {step_err:.2e}, prompt batch rel err {batch_err:.2e}")
    assert step_err < 1e-4, (variant, ngl, step_err)
    assert batch_err < 3e-2, (variant, ngl, batch_err)
    gpu_model.reset()
    again = np.array([gpu_model.eval([t]) for t in TOKENS[:6]])
    np.testing.assert_array_equal(gpu_steps, again)  # graph replays are deterministic
    assert gpu_model.decode_graph_replayed or ngl <= VARIANT_LAYERS, "decode steps are not replayed as a CUDA graph"
    if ngl > VARIANT_LAYERS:  # only embedding lookups stay on the CPU: the GPU part is one captured run
        graph = gpu_model._graphs[(1, 1, False)].graph
        ops = [(lib.ggml_get_op(t), lib.ggml_get_backend(t))
               for t in (lib.ggml_graph_node(graph.ptr, i) for i in range(graph.n_nodes))]
        cpu_ops = {op for op, backend in ops if backend == lib.GGML_BACKEND_CPU}
        assert cpu_ops == {lib.GGML_OP_GET_ROWS}, cpu_ops
        first_gpu = next(i for i, (_, backend) in enumerate(ops) if backend == lib.GGML_BACKEND_CUDA
                         and ops[i][0] != lib.GGML_OP_TRANSFER and i > 0)
        assert all(backend == lib.GGML_BACKEND_CUDA for _, backend in ops[first_gpu:]), "a CPU node splits the GPU run"
        # every layer fuses its two norm -> mul; rope writes the keys into the cache; gated FFNs run as one GEMV
        glu = variant in ("llama_silu", "llama_relu", "llama_geglu")
        assert decode_fused_nodes(gpu_model) >= (6 if glu else 2) * VARIANT_LAYERS


@pytest.mark.parametrize("ngl", [1, 2, 3, 4])
def test_ngl_counts_the_head_as_the_layer_after_the_last(converted, ngl):
    """-ngl N as llama.cpp's: the output head and the last N - 1 layers on the GPU, the embeddings on the host; N of
    n_layer + 1 or more is the whole model."""
    model = Model(converted("llama_silu"), n_ctx=64, kv_type="f32", n_gpu_layers=ngl)
    n = min(ngl, VARIANT_LAYERS + 1)
    assert model.n_gpu_layers == n and model.head_on_gpu
    assert model.weights["output.weight"].on_device and not model.weights["token_embd.weight"].on_device
    on_gpu = [model.weights[f"blk.{il}.attn_output.weight"].on_device and model.kv_cache.k[il].on_device
              and model.weights[f"blk.{il}.ffn_down_t.weight"].on_device for il in range(VARIANT_LAYERS)]
    assert on_gpu == [il >= VARIANT_LAYERS + 1 - n for il in range(VARIANT_LAYERS)]


@pytest.mark.parametrize("variant", sorted(GEMMA4_VARIANTS))
@pytest.mark.parametrize("ngl", [3, 99])
def test_gemma4_on_gpu_matches_cpu(converted, variant, ngl):
    """Gemma 4's per-layer head sizes, shared KV (a cache the first of its layers moves), per-layer embeddings and
    softcap on the GPU, whole and in part, against the CPU engine."""
    path = converted(variant)
    cpu_model = Model(path, n_ctx=64, kv_type="f32")
    gpu_model = Model(path, n_ctx=64, kv_type="f32", n_gpu_layers=ngl)
    step_err = rel_err([gpu_model.eval([t]) for t in TOKENS[:6]], np.array([cpu_model.eval([t]) for t in TOKENS[:6]]))
    batch_err = rel_err(gpu_model.logits(TOKENS), cpu_model.logits(TOKENS))
    assert step_err < 1e-4, (variant, ngl, step_err)
    assert batch_err < 3e-2, (variant, ngl, batch_err)


@pytest.mark.parametrize("variant", sorted(QWEN35_VARIANTS))
@pytest.mark.parametrize("ngl", [3, 99])
def test_qwen35_on_gpu_matches_cpu(converted, variant, ngl):
    """Qwen3.5's linear attention on the GPU (its states in device memory), whole and in part (-ngl 3: the head, a
    full-attention layer and a recurrent one), against the CPU engine: decode steps, a prompt batch, and a cached
    prefix restarted from a state checkpoint written back into device memory."""
    path = converted(variant)
    cpu_model = Model(path, n_ctx=64, kv_type="f32")
    gpu_model = Model(path, n_ctx=64, kv_type="f32", n_gpu_layers=ngl)
    assert any(t.on_device for t in gpu_model.kv_cache.states)
    step_err = rel_err([gpu_model.eval([t]) for t in TOKENS[:6]], np.array([cpu_model.eval([t]) for t in TOKENS[:6]]))
    batch_err = rel_err(gpu_model.logits(TOKENS), cpu_model.logits(TOKENS))
    assert step_err < 1e-4, (variant, ngl, step_err)
    assert batch_err < 3e-2, (variant, ngl, batch_err)
    gpu_model.reset()
    gpu_model.eval(TOKENS[:10])  # a checkpoint at 10
    gpu_model.eval(TOKENS[10:15])  # and at 15
    gpu_model.eval([TOKENS[15]])
    wanted = TOKENS[:12] + TOKENS[:4]
    assert gpu_model.reuse_prefix(wanted) == 10
    got = gpu_model.eval(wanted[10:])
    assert rel_err(got, cpu_model.logits(wanted)[-1]) < 3e-2


@pytest.mark.parametrize(("variant", "depth", "step_tol"),
                         [("llama_silu", 600, 1e-3), ("mistral", 600, 1e-3), ("gemma4_ple", 100, 3e-2)])
def test_default_f16_cache_long_prompt_and_deep_decode_match_cpu(converted, variant, depth, step_tol):
    """The default F16 cache: a prompt batch's attention runs on tensor cores (64 tokens a tile; Mistral's sliding
    window, Gemma 4's two head sizes and shared KV) and a decode step over a cache of 1024 slots splits them over
    blocks, merged after (at depth 600 two splits, at 100 one); both against the CPU engine with the same cache.
    (Gemma 4's tiny logits drift from the CPU's by 2.7e-2 over 600 tokens with an F32 cache already: the prompt's
    GEMMs run F32 weights in TF32; its decode steps inherit the cache the prompt wrote.)"""
    path = converted(variant)
    tokens = np.random.default_rng(5).integers(0, N_VOCAB, depth + 4).tolist()
    cpu_model, gpu_model = Model(path, n_ctx=1024), Model(path, n_ctx=1024, n_gpu_layers=99)
    batch_err = rel_err(gpu_model.logits(tokens[:depth]), cpu_model.logits(tokens[:depth]))
    steps = tokens[depth:]
    step_err = rel_err([gpu_model.eval([t]) for t in steps], np.array([cpu_model.eval([t]) for t in steps]))
    print(f"\n{variant}: prompt batch rel err {batch_err:.2e}, decode at {depth} rel err {step_err:.2e}")
    assert batch_err < 3e-2, batch_err
    assert step_err < step_tol, step_err


def decode_fused_nodes(model: Model) -> int:
    """Nodes of the model's one-token decode graph that run inside a fused CUDA kernel."""
    return model._graphs[(1, 1, False)].graph.n_fused


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_0"])
def test_quantized_tiny_model_on_gpu(converted, outtype):
    path = converted("llama_silu", outtype)
    cpu_model = Model(path, n_ctx=64, kv_type="f32")
    gpu_model = Model(path, n_ctx=64, kv_type="f32", n_gpu_layers=99)
    cpu, gpu = cpu_model.logits(TOKENS), gpu_model.logits(TOKENS)
    err = rel_err(gpu, cpu)
    # decode steps: fused GEMVs (norm weight, residual, SwiGLU); q, k, v share one quantized x
    cpu_model.reset()
    gpu_model.reset()
    cpu_steps = np.array([cpu_model.eval([t]) for t in TOKENS[:6]])
    gpu_steps = np.array([gpu_model.eval([t]) for t in TOKENS[:6]])
    step_err = rel_err(gpu_steps, cpu_steps)
    print(f"\n{outtype}: rel err GPU vs CPU: prompt batch {err:.2e}, decode {step_err:.2e}")
    # the CPU rounds activations to Q8 blocks, the GPU's GEMM dequantizes weights to F16: both err ~1e-2
    assert err < 6e-2
    assert step_err < 6e-2
    assert decode_fused_nodes(gpu_model) >= 6 * VARIANT_LAYERS  # two norm -> mul, rope -> kv_store, GLU


def test_smollm2_greedy_64_tokens_equal_cpu():
    from pyinfer.hub.pull import SMALLEST_MODEL, model_path

    path = model_path(SMALLEST_MODEL)
    if not path.is_file():  # the device machine has no network, and 98 MB do not travel to it
        pytest.skip(f"{SMALLEST_MODEL} not in {path.parent} (pyinfer pull --all)")
    params = SamplerParams(temperature=0)
    cpu = Model(path, n_ctx=256)
    gpu = Model(path, n_ctx=256, n_gpu_layers=99)
    prompt = cpu.tokenize("The capital of France is")
    a = list(cpu.generate_tokens(prompt, 64, params, stop_at_eos=False))
    b = list(gpu.generate_tokens(prompt, 64, params, stop_at_eos=False))
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 64)
    print(f"\nSmolLM2 greedy: GPU equals CPU for {same} of 64 tokens")
    if same < 64:  # allowed only where the CPU's top two logits tie within rounding
        cpu.reset()
        logits = cpu.logits(prompt + a[:same])[-1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < 0.05, f"GPU and CPU diverge at token {same} without a near tie"
