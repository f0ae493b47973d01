"""The native engine end to end (converter -> GGUF -> graphs -> driver loop) against transformers."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hf_tiny import GEMMA4_VARIANTS, N_VOCAB, QWEN35_VARIANTS, VARIANTS, roundtrip_weights

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import Model
from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import ContextFullError, InvalidArgumentError

RNG = np.random.default_rng(7)
PROMPTS = [[5], RNG.integers(0, N_VOCAB, 9).tolist(), RNG.integers(0, N_VOCAB, 23).tolist()]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("variant", sorted(VARIANTS) + sorted(GEMMA4_VARIANTS) + sorted(QWEN35_VARIANTS))
def test_f32_logits_match_transformers(tiny, variant):
    oracle, power, _ = tiny(variant)
    model = Model(power, n_ctx=64, kv_type="f32", n_threads=2)
    for tokens in PROMPTS:
        want = oracle.logits(tokens)
        got = model.logits(tokens)
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-4, (variant, len(tokens))


@pytest.mark.parametrize("variant", ["llama_silu", "llama_relu", "qwen2", "qwen3", "gemma3", "mistral", "llama3_rope",
                                     "qwen3moe", "mixtral", "olmoe", "gpt_oss",
                                     "llama_yarn", "falcon_7b", "falcon_40b", "opt", *sorted(GEMMA4_VARIANTS),
                                     *sorted(QWEN35_VARIANTS)])
def test_greedy_32_steps_equal_transformers(tiny, variant):
    """Greedy decoding through the KV cache equals argmax of the float64 oracle recomputed from scratch;
    a difference is allowed only where the oracle's top two logits tie within float32 rounding."""
    oracle, power, _ = tiny(variant)
    model = Model(power, n_ctx=64, kv_type="f32", n_threads=2)
    prompt = PROMPTS[1]
    ours = list(model.generate_tokens(prompt, 32, SamplerParams(temperature=0), stop_at_eos=False))
    oracle.assert_greedy(prompt, ours, variant)
    assert len(ours) == 32


@pytest.mark.parametrize("outtype,qtype,bound", [("f16", Q.F16, 2e-3), ("bf16", Q.BF16, 1.5e-2), ("q8_0", Q.Q8_0, 5e-2),
                                                 ("q4_0", Q.Q4_0, 8e-2)])
def test_quantized_logits_within_bounds(tiny, outtype, qtype, bound):
    """Against the oracle whose weights went through the same rounding: what remains is our arithmetic
    (activations rounded to F16 / BF16 / Q8 blocks for the dot products, as llama.cpp does); precise
    matmuls take that rounding's residual too, and come within float32's own error."""
    oracle, power, _ = tiny("llama_silu", outtype)
    roundtrip_weights(oracle, qtype)
    model = Model(power, n_ctx=64, kv_type="f32", n_threads=2, precise=False)
    precise = Model(power, n_ctx=64, kv_type="f32", n_threads=2, precise=True)
    for tokens in PROMPTS[1:]:
        want = oracle.logits(tokens)
        assert rel_err(model.logits(tokens), want) < bound
        assert rel_err(precise.logits(tokens), want) < 3e-4


@pytest.mark.parametrize("variant", ["gemma3", "mistral", "llama3_rope", "llama_yarn", "gpt_oss",
                                     *sorted(GEMMA4_VARIANTS), *sorted(QWEN35_VARIANTS)])
def test_long_context_beyond_the_window(tiny, variant):
    """2000 tokens, far past the sliding window (8) or the rope scaling's original context (16; YaRN's 1024),
    through the KV cache (and Qwen3.5's recurrent states) in prompt batches of 300 and then one token at a time: the
    last positions' logits equal transformers' over the whole sequence."""
    oracle, power, _ = tiny(variant)
    tokens = np.random.default_rng(3).integers(0, N_VOCAB, 2000).tolist()
    want = oracle.logits(tokens)[-8:]
    model = Model(power, n_ctx=2048, n_batch=300, kv_type="f32", n_threads=2)
    model.eval(tokens[:-8])
    got = np.stack([model.eval([t]).reshape(-1) for t in tokens[-8:]])
    assert rel_err(got, want) < 1e-4


# Gemma 4: shared layers read earlier batches; Qwen3.5: recurrent states carry them
@pytest.mark.parametrize("variant", ["qwen2", *sorted(GEMMA4_VARIANTS), *sorted(QWEN35_VARIANTS)])
def test_batches_and_cache_reuse_give_the_same_logits(tiny, variant):
    _, power, _ = tiny(variant)
    whole = Model(power, n_ctx=64, kv_type="f32").logits(PROMPTS[2])
    batched = Model(power, n_ctx=64, n_batch=4, kv_type="f32").logits(PROMPTS[2])
    np.testing.assert_allclose(batched, whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    model = Model(power, n_ctx=64, kv_type="f32")
    model.eval(PROMPTS[2][:10])
    last = model.eval(PROMPTS[2][10:], all_logits=True)
    np.testing.assert_allclose(last, whole[10:], rtol=0, atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("mix,qtype", [(None, Q.Q4_1), (None, Q.Q5_0), (None, Q.Q8_0), ("q4_k_m", Q.Q4_K)])
@pytest.mark.parametrize("precise", [False, True])
def test_a_tokens_logits_do_not_depend_on_where_its_batch_starts(tmp_path, mix, qtype, precise):
    """Exactly, quantized: a prompt after a cached prefix (a server's next request, a chat's next turn) gives the
    logits the same prompt gives in one batch. The CPU's GEMM tiles took 4 columns at a time and the leftovers went
    through vec_dot, so a token's rounding depended on its column in the batch: eight concurrent clients of `pyinfer
    serve` once got another answer than the same question asked alone."""
    from pyinfer.converters import synthetic

    path = str(tmp_path / "m.gguf")
    synthetic.make_llama(path, "small", qtype, n_layer=2, dense=True, share_weights=True, mix=mix)
    tokens = np.random.default_rng(4).integers(0, 2048, 13).tolist()
    whole = Model(path, n_ctx=64, kv_type="f32", precise=precise, n_threads=2).logits(tokens)
    model = Model(path, n_ctx=64, kv_type="f32", precise=precise, n_threads=2)
    model.eval(tokens[:6])
    rest = model.eval(tokens[6:], all_logits=True)
    np.testing.assert_array_equal(rest, whole[6:])


@pytest.mark.parametrize("variant", ["llama_silu", "qwen3", "mistral", "gemma3", *sorted(GEMMA4_VARIANTS),
                                     *sorted(QWEN35_VARIANTS)])
def test_plain_gguf_runs_like_powergguf(tiny, tmp_path, variant):
    """A llama.cpp GGUF (ffn_down, no pyinfer keys), as real files of these families come, runs directly and
    converts (GGUF input) to a PowerGGUF that runs the same; llama.cpp's format has no activation key, so this
    holds for the architectures' own FFNs (SwiGLU; Gemma's GeGLU)."""
    _, power, dense = tiny(variant)
    again = str(tmp_path / "again.gguf")
    assert conv.main([dense, "-o", again]) == 0
    a = Model(power, n_ctx=64, kv_type="f32").logits(PROMPTS[2])
    for path in (dense, again):
        b = Model(path, n_ctx=64, kv_type="f32").logits(PROMPTS[2])
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(a).max())


def test_f16_kv_cache_close_to_f32(tiny):
    _, power, _ = tiny("llama_silu")
    a = Model(power, n_ctx=64, kv_type="f32").logits(PROMPTS[2])
    b = Model(power, n_ctx=64, kv_type="f16").logits(PROMPTS[2])
    assert rel_err(b, a) < 5e-3


def test_bad_calls_raise_clear_errors(tiny):
    _, power, _ = tiny("llama_silu")
    model = Model(power, n_ctx=16, kv_type="f32")
    with pytest.raises(ContextFullError, match="context"):
        model.eval(list(range(17)))
    with pytest.raises(InvalidArgumentError, match="token ids"):
        model.eval([N_VOCAB])
    with pytest.raises(InvalidArgumentError):
        Model(power, kv_type="q4_0")
    model.eval(list(range(10)))  # still usable after the errors
    assert model.n_past == 10
