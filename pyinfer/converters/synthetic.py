"""SYNTHETIC PowerGGUF models for speed benchmarks, tests and the machine profile: random weights of a real
model's shape, and predictor weights built so that neuron i of every layer fires with a chosen frequency f_i
(the command: `python -m tools.make_synthetic_model`).

The frequencies follow a power law f_i = min(1, c (i+1)^-a) over neurons stored hot-first, with c and a
solved for a mean density (default 10%) and a hot share (default: 17% of neurons carry 80% of the
activations, PowerInfer's measurement on OPT-30B). Predictor, with x the FFN input:
z = relu(fc1 x), fc1 a random (r, d) projection scaled so that z's entries are ~N(0, 1); fc2 rows are
random zero-sum vectors g_i, so g_i . z ~ N(0, s_i^2) with s_i^2 = var(relu(N(0,1))) |g_i|^2; the bias
b_i = s_i Phi^-1(f_i) then makes P(logit_i > 0) = f_i. For a real model's file the biases are instead
calibrated on its own FFN inputs (pyinfer.sparsity.synthetic_predictors), since their scale is not known.
Everything comes from --seed; the files say `pyinfer.synthetic = true` and their name says synthetic.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import LlamaFileType
from scipy.special import ndtri

from pyinfer.formats.gguf_writer import OutFile, OutTensor, file_type, write_atomically
from pyinfer.native import ggml

# name -> (n_embd, n_layer, n_ff, n_head, n_head_kv, n_vocab)
SHAPES = {
    "llama-7b": (4096, 32, 11008, 32, 32, 32000),
    "llama-13b": (5120, 40, 13824, 40, 40, 32000),
    "llama-70b": (8192, 80, 28672, 64, 8, 32000),  # GQA: 8 KV heads
    "small": (1024, 4, 4096, 16, 4, 2048),
    "tiny": (128, 2, 512, 4, 4, 512),
}
# mixtures of experts: name -> (arch, n_embd, n_layer, n_head, n_head_kv, head_dim, n_vocab, n_expert, n_used, n_ff_exp)
MOE_SHAPES = {
    "qwen3-30b-a3b": ("qwen3moe", 2048, 48, 32, 4, 128, 151936, 128, 8, 768),
    "mixtral-8x7b": ("llama", 4096, 32, 32, 8, 128, 32000, 8, 2, 14336),
    "gpt-oss-20b": ("gpt-oss", 2880, 24, 64, 8, 64, 201088, 32, 4, 2880),
    "tiny-moe": ("qwen3moe", 256, 3, 4, 2, 64, 512, 32, 4, 128),  # tests
    "tiny-oss": ("gpt-oss", 256, 2, 4, 2, 64, 512, 8, 2, 128),  # tests
}
# Qwen3.5 (llama.cpp's qwen35): name -> (n_embd, n_layer, n_ff, n_head, n_head_kv, head_dim, n_vocab, tied,
# linear attention's key heads, value heads, head size); every fourth layer full attention
QWEN35_SHAPES = {
    "qwen3.5-0.8b": (1024, 24, 3584, 8, 2, 256, 248320, True, 16, 16, 128),
    "qwen3.5-9b": (4096, 32, 12288, 16, 4, 256, 248320, False, 16, 32, 128),
    "tiny-qwen35": (128, 4, 256, 4, 2, 32, 512, True, 2, 4, 32),  # tests
    # mixtures (qwen35moe): n_ff is the shared expert's, QWEN35_EXPERTS the routed ones'
    "qwen3.5-35b-a3b": (2048, 40, 512, 16, 2, 256, 248320, False, 16, 32, 128),
    "tiny-qwen35moe": (128, 4, 64, 4, 2, 32, 512, True, 2, 4, 32),  # tests
}
# name -> (n_expert, n_expert_used, the routed experts' neurons)
QWEN35_EXPERTS = {"qwen3.5-35b-a3b": (256, 8, 512), "tiny-qwen35moe": (8, 2, 64)}
# Gemma 4's mixture (llama.cpp's gemma4): name -> (n_embd, n_layer, dense n_ff, n_head, windowed layers' KV heads and
# head size, global layers' KV heads and head size, n_vocab, n_expert, n_used, the experts' neurons); the 26B-A4B's
# sizes as we read its config (they give its 25.2B weights, 3.8B a token): five windowed layers to a global one
GEMMA4_SHAPES = {
    "gemma4-26b-a4b": (2816, 30, 2112, 16, 8, 256, 2, 512, 262144, 128, 8, 704),
    "tiny-gemma4moe": (128, 6, 96, 4, 2, 32, 1, 64, 512, 8, 2, 64),  # tests
}
TYPES = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
         "mxfp4": Q.MXFP4}


def _more_bits(il: int, n_layer: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers and every third between."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int) -> Q:
    """The type llama-quantize gives a tensor of a Q4_K_M file of a llama-family model (llama_tensor_get_type):
    Q6_K for the output head, and for attn_v and ffn_down in the layers of _more_bits; Q4_K for every other
    matrix (the token embeddings included)."""
    if name == "output.weight":
        return Q.Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and _more_bits(int(parts[1]), n_layer):
        return Q.Q6_K
    return Q.Q4_K


# a mix of types as llama-quantize writes one: name -> (the type of each tensor, the file type it declares)
MIXES = {"q4_k_m": (q4_k_m_type, LlamaFileType.MOSTLY_Q4_K_M)}
MXFP4_LEVEL_RMS = 5.852  # of MXFP4's 16 levels (0, 1, 2, 3, 4, 6, 8, 12 and their negatives): sqrt(34.25)
RELU_VAR = 0.5 - 1.0 / (2.0 * math.pi)  # variance of relu(N(0, 1))
GATED_RELU = ("reglu", "drelu", "relu")


# ---------------------------------------------------------------------------------------------------
# frequencies and predictors


def power_law_freqs(n: int, mean: float = 0.10, hot_frac: float = 0.17, hot_share: float = 0.80) -> np.ndarray:
    """(n,) firing frequencies, descending: f_i = min(1, c (i+1)^-a) with mean `mean` and the first
    hot_frac of neurons carrying hot_share of the sum (a = 0, uniform, when the share is <= hot_frac)."""
    ranks = np.arange(1, n + 1, dtype=np.float64)
    n_hot = max(1, round(hot_frac * n))

    def freqs(a: float) -> np.ndarray:
        lo, hi = 0.0, float(n) ** a  # c: mean(min(1, c r^-a)) rises with c
        for _ in range(100):
            c = 0.5 * (lo + hi)
            lo, hi = (c, hi) if np.minimum(1.0, c * ranks**-a).mean() < mean else (lo, c)
        return np.minimum(1.0, lo * ranks**-a)

    def share(a: float) -> float:
        f = freqs(a)
        return float(f[:n_hot].sum() / f.sum())

    a_lo, a_hi = 0.0, 8.0
    if share(a_hi) < hot_share:
        a_lo = a_hi
    for _ in range(50):
        a = 0.5 * (a_lo + a_hi)
        a_lo, a_hi = (a, a_hi) if share(a) < hot_share else (a_lo, a)
    return freqs(a_lo)


def predictor(rng: np.random.Generator, n_embd: int, rank: int, freqs: np.ndarray,
              x_rms: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fc1 (rank, n_embd), fc2 (n_ff, rank), bias (n_ff,) with P(logit_i > 0) = freqs[i] for FFN inputs
    of isotropic direction and per-entry RMS x_rms."""
    fc1 = rng.standard_normal((rank, n_embd)) / (x_rms * math.sqrt(n_embd))  # z ~ N(0, 1) per entry
    g = rng.standard_normal((len(freqs), rank))
    g -= g.mean(axis=1, keepdims=True)  # E[relu(z)] is the same for every entry: zero-sum rows cancel it
    g /= math.sqrt(rank)
    s = np.sqrt(RELU_VAR * (g * g).sum(axis=1))  # (n_ff,)
    bias = s * ndtri(np.clip(freqs, 1e-6, 1 - 1e-6))
    return fc1.astype(np.float32), g.astype(np.float32), bias.astype(np.float32)


def predictor_tensors(il: int, fc1, fc2, bias, freqs) -> list[OutTensor]:
    def arr(a, dtype):
        return lambda: np.ascontiguousarray(a, dtype=dtype)

    return [OutTensor(f"blk.{il}.fc1.weight", fc1.shape, Q.F16, arr(fc1, np.float16)),
            OutTensor(f"blk.{il}.fc2.weight", fc2.shape, Q.F16, arr(fc2, np.float16)),
            OutTensor(f"blk.{il}.fc2.bias", bias.shape, Q.F32, arr(bias, np.float32)),
            OutTensor(f"blk.{il}.ffn_act_freq", freqs.shape, Q.F32, arr(freqs, np.float32))]


def sparsity_kv(kind: str, n_layer: int, density: float, rank: int, threshold: float) -> list:
    f32s = V.FLOAT32
    return [("pyinfer.sparsity.kind", kind, V.STRING, None),
            ("pyinfer.sparsity.thresholds", [threshold] * n_layer, V.ARRAY, f32s),
            ("pyinfer.sparsity.target", 1.0 - density, f32s, None),
            ("pyinfer.predictor.ranks", [rank] * n_layer, V.ARRAY, V.UINT32),
            ("pyinfer.synthetic", True, V.BOOL, None)]


# ---------------------------------------------------------------------------------------------------
# random weights


def random_weight(rng: np.random.Generator, qtype: Q, shape: tuple[int, int], std: float) -> np.ndarray:
    """Bytes of a (rows, k) matrix of random values of about `std`; Q4_0/Q8_0/MXFP4 blocks drawn directly, the
    other quantized types through the engine's quantizer."""
    rows, k = shape
    if qtype == Q.MXFP4:
        # any nibbles (the levels are symmetric about 0); the scale std / MXFP4_LEVEL_RMS is rarely a power of two,
        # so blocks take the two around it, 2^lo or 2^(lo + 1), mixed for a mean square scale of exactly its square
        raw = rng.integers(0, 256, size=(rows * k // 32, 17), dtype=np.uint8)
        scale = std / MXFP4_LEVEL_RMS
        lo = math.floor(math.log2(scale))
        p_lo = (4.0 ** (lo + 1) - scale**2) / (3 * 4.0**lo)  # the share of blocks at 2^lo
        raw[:, 0] = 128 + lo + (rng.random(len(raw)) >= p_lo)  # e: d = 2^(e - 128)
        return raw.reshape(rows, -1)
    if qtype in (Q.Q4_0, Q.Q8_0):
        block, size, q_std = (32, 18, 4.32) if qtype == Q.Q4_0 else (32, 34, 73.6)  # std of the quants
        raw = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
        if qtype == Q.Q8_0:
            raw[:, 2:][raw[:, 2:] == 128] = 129  # int8 -128 would skew the symmetric range
        else:  # nibbles 1..15 (levels -7..7): 0..15 would give every matrix a mean of -d/2, a direction that every
            # product shares (it routed every token of a mixture to the same experts past its first layer)
            lo, hi = (rng.integers(1, 16, size=raw[:, 2:].shape, dtype=np.uint8) for _ in range(2))
            raw[:, 2:] = lo | hi << 4
        raw[:, :2] = np.frombuffer(np.float16(std / q_std).tobytes(), dtype=np.uint8)
        return raw.reshape(rows, -1)
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    return ggml.quantize(int(qtype), values)


def _vocab_kv(n_vocab: int) -> list:
    """A byte-level vocabulary: the 256 bytes, one merge (llama.cpp requires the merges key and GGUF has
    no empty arrays), then filler tokens."""
    from pyinfer.formats.tokenizer import byte_to_unicode

    byte_chars = list(byte_to_unicode().values())
    space = byte_to_unicode()[ord(" ")]
    tokens = ["<|endoftext|>", *byte_chars, space * 2, *(f"<|syn{i}|>" for i in range(n_vocab - 258))]
    types = [3] + [1] * 257 + [4] * (n_vocab - 258)
    return [("tokenizer.ggml.model", "gpt2", V.STRING, None), ("tokenizer.ggml.pre", "default", V.STRING, None),
            ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            ("tokenizer.ggml.merges", [f"{space} {space}"], V.ARRAY, V.STRING),
            ("tokenizer.ggml.bos_token_id", 0, V.UINT32, None), ("tokenizer.ggml.eos_token_id", 0, V.UINT32, None)]


def make_llama(path: str, shape: str, qtype: Q, *, seed: int = 0, density: float = 0.10, hot_frac: float = 0.17,
               hot_share: float = 0.80, rank: int = 256, ffn_kind: str = "swiglu", n_layer: int | None = None,
               dense: bool = False, share_weights: bool = False, predictors: bool = True,
               mix: str | None = None) -> None:
    """A random LLaMA-shaped PowerGGUF with synthetic predictors, neurons hot-first; dense: a plain
    llama.cpp GGUF instead (ffn_down, no predictors, no pyinfer keys) that both engines run; predictors False:
    a PowerGGUF without them (what `pyinfer sparsify --method input` takes).
    n_layer overrides the shape's layer count (speed per layer is what such benchmarks compare).
    share_weights: every layer's matrices hold the same random values (drawn once: a large file is then as
    fast to write as its disk allows; each layer is still its own bytes, read on its own).
    mix: a name of MIXES: each matrix of the type that mix gives it (qtype unused), as llama-quantize writes
    the files users download most."""
    d, shape_layers, n_ff, n_head, n_head_kv, n_vocab = SHAPES[shape]
    n_layer = n_layer or shape_layers
    if mix:
        mix_type, declared = MIXES[mix][0], int(MIXES[mix][1])

        def type_of(name: str) -> Q:
            return mix_type(name, n_layer)
    else:
        declared = file_type(qtype)

        def type_of(name: str) -> Q:
            return qtype
    head_dim, kv_dim = d // n_head, d // n_head * n_head_kv
    rng = np.random.default_rng(seed)
    freqs = power_law_freqs(n_ff, density, hot_frac, hot_share)
    u32, f32 = V.UINT32, V.FLOAT32
    kv = [("general.name", f"synthetic {shape} (random weights)", V.STRING, None),
          ("general.file_type", declared, u32, None),
          ("llama.vocab_size", n_vocab, u32, None), ("llama.context_length", 4096, u32, None),
          ("llama.embedding_length", d, u32, None), ("llama.block_count", n_layer, u32, None),
          ("llama.feed_forward_length", n_ff, u32, None), ("llama.attention.head_count", n_head, u32, None),
          ("llama.attention.head_count_kv", n_head_kv, u32, None),
          ("llama.attention.layer_norm_rms_epsilon", 1e-5, f32, None),
          ("llama.rope.dimension_count", head_dim, u32, None), *_vocab_kv(n_vocab)]
    if not dense:
        kv += [("pyinfer.format_version", 1, u32, None), ("pyinfer.ffn_layout", "down_t", V.STRING, None),
               ("pyinfer.ffn_kind", ffn_kind, V.STRING, None)]
    if not dense and predictors:
        kv += [("pyinfer.neuron_order", "hot_first", V.STRING, None),
               *sparsity_kv("relu" if ffn_kind in GATED_RELU else "threshold", n_layer, float(freqs.mean()),
                            rank, 0.0)]

    any_type = _matrix_maker(rng, qtype, share_weights)

    def mat(name: str, shape: tuple[int, ...], std: float) -> OutTensor:
        return any_type(name, shape, std, type_of(name))

    def ones(name: str) -> OutTensor:
        return OutTensor(name, (d,), Q.F32, lambda: np.ones(d, np.float32))

    tensors = [mat("token_embd.weight", (n_vocab, d), 1.0), ones("output_norm.weight"),
               mat("output.weight", (n_vocab, d), d**-0.5)]
    for il in range(n_layer):
        b = f"blk.{il}."
        tensors += [ones(b + "attn_norm.weight"), mat(b + "attn_q.weight", (d, d), d**-0.5),
                    mat(b + "attn_k.weight", (kv_dim, d), d**-0.5), mat(b + "attn_v.weight", (kv_dim, d), d**-0.5),
                    mat(b + "attn_output.weight", (d, d), d**-0.5), ones(b + "ffn_norm.weight"),
                    mat(b + "ffn_up.weight", (n_ff, d), d**-0.5), mat(b + "ffn_gate.weight", (n_ff, d), d**-0.5)]
        if dense:
            tensors.append(mat(b + "ffn_down.weight", (d, n_ff), n_ff**-0.5))
        else:
            tensors.append(mat(b + "ffn_down_t.weight", (n_ff, d), n_ff**-0.5))
        if not dense and predictors:
            tensors += predictor_tensors(il, *predictor(rng, d, rank, freqs), freqs)
    write_atomically([OutFile(path, "llama", kv, tensors)])


def _model_kv(arch: str, shape: str, qtype: Q, n_ctx: int, sizes: tuple[int, ...], n_rot: int,
              rope_base: float) -> list:
    """The keys every synthetic file of an llama.cpp architecture has: its name and type, sizes (n_embd, n_layer,
    n_ff, n_head, n_head_kv, head_dim, n_vocab), RMS epsilon, RoPE, the byte-level vocabulary, the synthetic flag."""
    d, n_layer, n_ff, n_head, n_kv, head_dim, n_vocab = sizes
    u32, f32 = V.UINT32, V.FLOAT32
    return [("general.name", f"synthetic {shape} (random weights)", V.STRING, None),
            ("general.file_type", file_type(qtype), u32, None),
            (f"{arch}.vocab_size", n_vocab, u32, None), (f"{arch}.context_length", n_ctx, u32, None),
            (f"{arch}.embedding_length", d, u32, None), (f"{arch}.block_count", n_layer, u32, None),
            (f"{arch}.feed_forward_length", n_ff, u32, None), (f"{arch}.attention.head_count", n_head, u32, None),
            (f"{arch}.attention.head_count_kv", n_kv, u32, None), (f"{arch}.attention.key_length", head_dim, u32, None),
            (f"{arch}.attention.value_length", head_dim, u32, None),
            (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, f32, None),
            (f"{arch}.rope.dimension_count", n_rot, u32, None), (f"{arch}.rope.freq_base", rope_base, f32, None),
            *_vocab_kv(n_vocab), ("pyinfer.synthetic", True, V.BOOL, None)]


def _matrix_maker(rng: np.random.Generator, qtype: Q, share_weights: bool):
    """mat(name, shape, std, type_=qtype) -> an OutTensor of random values of about std (random_weight; the last
    axis the rows' length), seeded from rng when made; with share_weights every layer's tensor of one name and shape
    holds the values drawn for the first (see make_llama)."""
    drawn: dict[tuple, np.ndarray] = {}

    def mat(name: str, shape: tuple[int, ...], std: float, type_: Q = qtype) -> OutTensor:
        seed_i = int(rng.integers(2**63))
        key = (name.split(".", 2)[-1], shape, type_)
        rows, k = math.prod(shape[:-1]), shape[-1]

        def produce() -> np.ndarray:
            if share_weights and name.startswith("blk.") and key in drawn:
                return drawn[key]
            values = random_weight(np.random.default_rng(seed_i), type_, (rows, k), std)
            if share_weights and name.startswith("blk."):
                drawn[key] = values
            return values

        return OutTensor(name, shape, type_, produce)

    return mat


def _vector_maker(rng: np.random.Generator):
    """vector(name, n, lo, hi) -> an F32 OutTensor of n values uniform in [lo, hi], seeded from rng when made."""

    def vector(name: str, n: int, lo: float, hi: float) -> OutTensor:
        r = np.random.default_rng(int(rng.integers(2**63)))
        return OutTensor(name, (n,), Q.F32, lambda: r.uniform(lo, hi, n).astype(np.float32))

    return vector


# Random queries and keys attend about evenly, so attention adds the mean of every earlier token's values, a
# direction all tokens share; at full scale it grew layer after layer until a stream's tokens all routed alike (the
# most routed 20 % of experts took 26 % of routings in layer 0, 49 % by layer 3). A fifth keeps each token's own.
ATTN_OUT_SCALE = 0.2


def make_moe(path: str, shape: str, qtype: Q, *, seed: int = 0, n_layer: int | None = None,
             share_weights: bool = False, router_skew: float = 0.0, expert_type: Q | None = None) -> None:
    """A random mixture of experts of a real model's shape (MOE_SHAPES) as llama.cpp stores one (ffn_*_exps,
    an F32 router): a file both engines run. The router is random, so tokens go to the experts about evenly;
    router_skew s > 0 scales expert e's router row by exp(s z_e), z_e ~ N(0, 1), so experts with larger rows win
    more often (s = 0.2: the most routed 20 % of the experts take 30-40 % of random tokens' routings in every
    layer, as in the 25-40 % of published traces of real models; s = 0: 25-30 %, what sampling alone gives).
    n_layer and share_weights as make_llama's; expert_type: the experts' type (default qtype; gpt-oss' files:
    MXFP4). gpt-oss shapes get its sinks, biases (small random), windowed layers and norm names."""
    arch, d, shape_layers, n_head, n_head_kv, head_dim, n_vocab, n_expert, n_used, n_ff = MOE_SHAPES[shape]
    n_layer = n_layer or shape_layers
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    rng = np.random.default_rng(seed)
    u32 = V.UINT32
    kv = [*_model_kv(arch, shape, qtype, 4096, (d, n_layer, n_ff, n_head, n_head_kv, head_dim, n_vocab), head_dim, 1e6),
          (f"{arch}.expert_count", n_expert, u32, None), (f"{arch}.expert_used_count", n_used, u32, None),
          (f"{arch}.expert_feed_forward_length", n_ff, u32, None)]
    oss = arch == "gpt-oss"
    if oss:
        kv.append((f"{arch}.attention.sliding_window", 128, u32, None))
    expert_type = expert_type or qtype
    mat = _matrix_maker(rng, qtype, share_weights)

    def ones(name: str, n: int = d) -> OutTensor:
        return OutTensor(name, (n,), Q.F32, lambda: np.ones(n, np.float32))

    def small(name: str, shape: tuple[int, ...]) -> OutTensor:  # gpt-oss' biases and sinks
        r = np.random.default_rng(int(rng.integers(2**63)))
        return OutTensor(name, shape, Q.F32, lambda: r.standard_normal(shape, dtype=np.float32) * np.float32(0.1))

    def router(name: str) -> OutTensor:  # each layer its own skew: the popular experts differ between layers
        r = np.random.default_rng(int(rng.integers(2**63)))
        scale = np.exp(router_skew * r.standard_normal(n_expert)).astype(np.float32)[:, None]
        return OutTensor(name, (n_expert, d), Q.F32,
                         lambda: r.standard_normal((n_expert, d), dtype=np.float32) * np.float32(d**-0.5) * scale)

    tensors = [mat("token_embd.weight", (n_vocab, d), 1.0), ones("output_norm.weight"),
               mat("output.weight", (n_vocab, d), d**-0.5)]
    for il in range(n_layer):
        b = f"blk.{il}."
        tensors += [ones(b + "attn_norm.weight"), mat(b + "attn_q.weight", (q_dim, d), d**-0.5),
                    mat(b + "attn_k.weight", (kv_dim, d), d**-0.5), mat(b + "attn_v.weight", (kv_dim, d), d**-0.5),
                    mat(b + "attn_output.weight", (d, q_dim), q_dim**-0.5 * ATTN_OUT_SCALE),
                    ones(b + ("post_attention_norm" if oss else "ffn_norm") + ".weight"),
                    router(b + "ffn_gate_inp.weight"),
                    mat(b + "ffn_gate_exps.weight", (n_expert, n_ff, d), d**-0.5, expert_type),
                    mat(b + "ffn_up_exps.weight", (n_expert, n_ff, d), d**-0.5, expert_type),
                    mat(b + "ffn_down_exps.weight", (n_expert, d, n_ff), n_ff**-0.5, expert_type)]
        if oss:
            tensors += [small(b + "attn_sinks.weight", (n_head,)), small(b + "ffn_gate_inp.bias", (n_expert,)),
                        small(b + "attn_q.bias", (q_dim,)), small(b + "attn_k.bias", (kv_dim,)),
                        small(b + "attn_v.bias", (kv_dim,)), small(b + "attn_output.bias", (d,)),
                        small(b + "ffn_gate_exps.bias", (n_expert, n_ff)),
                        small(b + "ffn_up_exps.bias", (n_expert, n_ff)), small(b + "ffn_down_exps.bias", (n_expert, d))]
        if arch == "qwen3moe":
            tensors += [ones(b + "attn_q_norm.weight", head_dim), ones(b + "attn_k_norm.weight", head_dim)]
    write_atomically([OutFile(path, arch, kv, tensors)])


def make_qwen35(path: str, shape: str, qtype: Q, *, seed: int = 0, n_layer: int | None = None,
                share_weights: bool = False) -> None:
    """A random Qwen3.5 of a real model's shape (QWEN35_SHAPES) as llama.cpp stores one: a file both engines run.
    Its linear attention's decays and write strengths are drawn in the ranges a trained model's take (ssm_a in
    [-4, -1], dt_bias 0), so the recurrent states stay bounded over long sequences. n_layer and share_weights as
    make_llama's (n_layer keeps every fourth layer full attention). A mixture's shape (QWEN35_EXPERTS) has a random
    router (tokens go to the experts about evenly) and a shared expert with its gate."""
    d, shape_layers, n_ff, n_head, n_kv, head_dim, n_vocab, tied, n_k, n_v, ssm_head = QWEN35_SHAPES[shape]
    arch = "qwen35moe" if shape in QWEN35_EXPERTS else "qwen35"
    n_layer = n_layer or shape_layers
    rng = np.random.default_rng(seed)
    channels, v_dim = (2 * n_k + n_v) * ssm_head, n_v * ssm_head
    u32 = V.UINT32
    sizes = (d, n_layer, n_ff, n_head, n_kv, head_dim, n_vocab)
    kv = [*_model_kv(arch, shape, qtype, 262144, sizes, head_dim // 4, 1e7),
          (f"{arch}.rope.dimension_sections", [11, 11, 10, 0], V.ARRAY, u32),
          (f"{arch}.full_attention_interval", 4, u32, None), (f"{arch}.ssm.conv_kernel", 4, u32, None),
          (f"{arch}.ssm.state_size", ssm_head, u32, None), (f"{arch}.ssm.group_count", n_k, u32, None),
          (f"{arch}.ssm.time_step_rank", n_v, u32, None), (f"{arch}.ssm.inner_size", v_dim, u32, None)]
    n_expert, n_used, n_ff_exp = QWEN35_EXPERTS.get(shape, (0, 0, 0))
    if n_expert:
        kv += [(f"{arch}.expert_count", n_expert, u32, None), (f"{arch}.expert_used_count", n_used, u32, None),
               (f"{arch}.expert_feed_forward_length", n_ff_exp, u32, None),
               (f"{arch}.expert_shared_feed_forward_length", n_ff, u32, None)]
    mat, vector = _matrix_maker(rng, qtype, share_weights), _vector_maker(rng)

    tensors = [mat("token_embd.weight", (n_vocab, d), 1.0), vector("output_norm.weight", d, 1.0, 1.0)]
    if not tied:
        tensors.append(mat("output.weight", (n_vocab, d), d**-0.5))
    for il in range(n_layer):
        b = f"blk.{il}."
        tensors += [vector(b + "attn_norm.weight", d, 1.0, 1.0),
                    vector(b + "post_attention_norm.weight", d, 1.0, 1.0)]
        ffn = "_shexp" if n_expert else ""  # a mixture's dense FFN is its shared expert
        tensors += [mat(b + f"ffn_gate{ffn}.weight", (n_ff, d), d**-0.5),
                    mat(b + f"ffn_up{ffn}.weight", (n_ff, d), d**-0.5),
                    mat(b + f"ffn_down{ffn}.weight", (d, n_ff), n_ff**-0.5)]
        if n_expert:
            tensors += [mat(b + "ffn_gate_inp.weight", (n_expert, d), d**-0.5, Q.F32),
                        vector(b + "ffn_gate_inp_shexp.weight", d, -0.01, 0.01),
                        mat(b + "ffn_gate_exps.weight", (n_expert, n_ff_exp, d), d**-0.5),
                        mat(b + "ffn_up_exps.weight", (n_expert, n_ff_exp, d), d**-0.5),
                        mat(b + "ffn_down_exps.weight", (n_expert, d, n_ff_exp), n_ff_exp**-0.5)]
        if (il + 1) % 4:
            tensors += [mat(b + "attn_qkv.weight", (channels, d), d**-0.5),
                        mat(b + "attn_gate.weight", (v_dim, d), d**-0.5),
                        mat(b + "ssm_beta.weight", (n_v, d), d**-0.5), mat(b + "ssm_alpha.weight", (n_v, d), d**-0.5),
                        mat(b + "ssm_conv1d.weight", (channels, 4), 0.5, Q.F32),
                        vector(b + "ssm_dt.bias", n_v, 0.0, 0.0),
                        vector(b + "ssm_a", n_v, -4.0, -1.0), vector(b + "ssm_norm.weight", ssm_head, 1.0, 1.0),
                        mat(b + "ssm_out.weight", (d, v_dim), v_dim**-0.5 * ATTN_OUT_SCALE)]
        else:
            q_dim = n_head * head_dim
            tensors += [mat(b + "attn_q.weight", (2 * q_dim, d), d**-0.5),
                        mat(b + "attn_k.weight", (n_kv * head_dim, d), d**-0.5),
                        mat(b + "attn_v.weight", (n_kv * head_dim, d), d**-0.5),
                        mat(b + "attn_output.weight", (d, q_dim), q_dim**-0.5 * ATTN_OUT_SCALE),
                        vector(b + "attn_q_norm.weight", head_dim, 1.0, 1.0),
                        vector(b + "attn_k_norm.weight", head_dim, 1.0, 1.0)]
    write_atomically([OutFile(path, arch, kv, tensors)])


def make_gemma4(path: str, shape: str, qtype: Q, *, seed: int = 0, n_layer: int | None = None,
                share_weights: bool = False) -> None:
    """A random Gemma 4 mixture of a real model's shape (GEMMA4_SHAPES) as llama.cpp's converter writes one: every
    layer's dense FFN beside its experts (gate and up in one ffn_gate_up_exps tensor), the router's scale vector and
    per-expert scales, windowed layers of one head size and global ones of another whose values are their keys'
    projection (no attn_v), proportional RoPE on a quarter of the global heads, tied embeddings, the final softcap.
    The router is random, so tokens go to the experts about evenly. n_layer and share_weights as make_llama's."""
    d, shape_layers, n_ff, n_head, kv_swa, hd_swa, kv_full, hd_full, n_vocab, n_expert, n_used, n_ff_exp = (
        GEMMA4_SHAPES[shape])
    n_layer = n_layer or shape_layers
    windowed = [il % 6 != 5 for il in range(n_layer)]
    rng = np.random.default_rng(seed)
    u32, f32, arr = V.UINT32, V.FLOAT32, V.ARRAY
    sizes = (d, n_layer, n_ff, n_head, kv_swa, hd_full, n_vocab)
    kv = [(k, [kv_swa if w else kv_full for w in windowed], arr, u32) if k == "gemma4.attention.head_count_kv"
          else (k, v, t, e) for k, v, t, e in _model_kv("gemma4", shape, qtype, 262144, sizes, hd_full, 1e6)]
    kv += [("gemma4.attention.key_length_swa", hd_swa, u32, None), ("gemma4.attention.value_length_swa", hd_swa, u32,
                                                                    None),
           ("gemma4.rope.dimension_count_swa", hd_swa, u32, None), ("gemma4.rope.freq_base_swa", 1e4, f32, None),
           ("gemma4.attention.sliding_window", 1024, u32, None),
           ("gemma4.attention.sliding_window_pattern", windowed, arr, V.BOOL),
           ("gemma4.attention.shared_kv_layers", 0, u32, None),
           ("gemma4.embedding_length_per_layer_input", 0, u32, None),
           ("gemma4.final_logit_softcapping", 30.0, f32, None), ("gemma4.expert_count", n_expert, u32, None),
           ("gemma4.expert_used_count", n_used, u32, None),
           ("gemma4.expert_feed_forward_length", n_ff_exp, u32, None)]
    mat, vector = _matrix_maker(rng, qtype, share_weights), _vector_maker(rng)

    rotated = hd_full // 8  # a quarter of the global head's pairs
    factors = np.array([1.0] * rotated + [1e30] * (hd_full // 2 - rotated), np.float32)
    tensors = [mat("token_embd.weight", (n_vocab, d), 1.0), vector("output_norm.weight", d, 1.0, 1.0),
               OutTensor("rope_freqs.weight", factors.shape, Q.F32, lambda: factors)]
    for il in range(n_layer):
        b = f"blk.{il}."
        n_kv, hd = (kv_swa, hd_swa) if windowed[il] else (kv_full, hd_full)
        q_dim = n_head * hd
        tensors += [vector(b + name, d, 1.0, 1.0) for name in (
            "attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
            "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight", "ffn_gate_inp.scale")]
        tensors += [mat(b + "attn_q.weight", (q_dim, d), d**-0.5), mat(b + "attn_k.weight", (n_kv * hd, d), d**-0.5),
                    vector(b + "attn_q_norm.weight", hd, 1.0, 1.0), vector(b + "attn_k_norm.weight", hd, 1.0, 1.0),
                    mat(b + "attn_output.weight", (d, q_dim), q_dim**-0.5 * ATTN_OUT_SCALE),
                    mat(b + "ffn_gate.weight", (n_ff, d), d**-0.5), mat(b + "ffn_up.weight", (n_ff, d), d**-0.5),
                    mat(b + "ffn_down.weight", (d, n_ff), n_ff**-0.5),
                    mat(b + "ffn_gate_inp.weight", (n_expert, d), 1.0, Q.F32),
                    mat(b + "ffn_gate_up_exps.weight", (n_expert, 2 * n_ff_exp, d), d**-0.5),
                    mat(b + "ffn_down_exps.weight", (n_expert, d, n_ff_exp), n_ff_exp**-0.5),
                    vector(b + "ffn_down_exps.scale", n_expert, 0.5, 1.5)]
        if windowed[il]:
            tensors.append(mat(b + "attn_v.weight", (n_kv * hd, d), d**-0.5))
    write_atomically([OutFile(path, "gemma4", kv, tensors)])
