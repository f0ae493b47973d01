"""CUDA kernels against the CPU backend (the same graph built twice) and reference_ops (float64).

Every op, every weight type, hypothesis-drawn shapes (row lengths that are not multiples of a warp, of
16 bytes or of a 256-value unit, so the unaligned kernel paths run too), masks of density 0..1, index
lists with terminators and repeats, row ranges. Outputs are poisoned (NaN) on the device before each run.
Skipped without a GPU.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import reference_ops as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyinfer.native import ggml
from pyinfer.native.binding import check, ffi, lib

pytestmark = pytest.mark.skipif(lib.ggml_cuda_device_count() == 0, reason="no CUDA device")

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUANT_TYPES = (ggml.Q8_0, ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q4_K, ggml.Q6_K, ggml.MXFP4)
# error of a dot product relative to sum |w| |x|: activations quantized to 8 bits (quants), x as F16
# in the GEMM, TF32 for F32 weights in the GEMM
DOT_TOL = {ggml.F32: 2e-3, ggml.F16: 2e-3, ggml.BF16: 1e-2, **{t: 0.02 for t in QUANT_TYPES}}
_POOL: list[ggml.ThreadPool] = []


def pool() -> ggml.ThreadPool:
    if not _POOL:
        _POOL.append(ggml.ThreadPool(2))
    return _POOL[0]


def tensor(ctx: ggml.Context, arr: np.ndarray, type_: int | None = None) -> ggml.Tensor:
    arr = np.asarray(arr)
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    return ctx.tensor_from_numpy(arr, type_)


def read(t: ggml.Tensor) -> np.ndarray:
    """An output's values (wherever it lives) in numpy order, 2-D or more as given by ne."""
    raw = np.empty(t.nbytes, dtype=np.uint8)
    check(lib.ggml_tensor_read(t.ptr, ffi.from_buffer(raw), 0, t.nbytes))
    return raw.view(np.float32).reshape(tuple(reversed(t.ne))).copy()


def run(build, backend: str, n_fused: list | None = None, mem: int = 64 << 20) -> list[np.ndarray]:
    """build(ctx) -> outputs; planned, poisoned with NaN, computed on `backend`; appends the graph's
    count of fused nodes to n_fused if given."""
    ctx = ggml.Context(mem)
    outputs = build(ctx)
    g = ggml.Graph(ctx, outputs, backend=backend).plan()
    for t in outputs:
        nan = np.full(t.nbytes // 4, np.nan, dtype=np.float32)
        check(lib.ggml_tensor_write(t.ptr, ffi.from_buffer(nan), 0, t.nbytes))
    g.compute(pool())
    if n_fused is not None:
        n_fused.append(g.n_fused)
    return [read(t) for t in outputs]


def both(build) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(cuda results, cpu results) of the same graph."""
    return run(build, "cuda"), run(build, "cpu")


def weight_values(type_: int, w: np.ndarray) -> np.ndarray:
    """The float64 values a weight of type_ really holds."""
    raw = ggml.quantize(type_, w.astype(np.float32)) if type_ not in (ggml.F32, ggml.F16) else None
    if raw is None:
        return w.astype(np.float32 if type_ == ggml.F32 else np.float16).astype(np.float64)
    return ggml.dequantize(type_, raw, w.size).reshape(w.shape).astype(np.float64)


def row_len(type_: int, draw, max_blocks: int = 4) -> int:
    blk = ggml.block_size(type_)
    if blk == 1:
        return draw(st.sampled_from([1, 7, 31, 33, 64, 100, 257, 576, 1000]))
    # 576 / 32 = 18 blocks: rows not 16-byte aligned for the 18/22/34-byte blocks
    return blk * draw(st.integers(1, max_blocks if blk < 256 else 3)) if draw(st.booleans()) else (
        576 if blk == 32 else 512)


def assert_dot_close(got, want, bound, type_):
    tol = DOT_TOL[type_] * bound + 1e-4
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{bad.sum()} of {bad.size} values off, e.g. got {got[bad][:4]} want {want[bad][:4]}"


# ---------------------------------------------------------------------------------------------------
# elementwise, norms, rope, softmax, attention
# ---------------------------------------------------------------------------------------------------

@SETTINGS
@given(rows=st.integers(1, 9), cols=st.integers(1, 700), seed=st.integers(0, 2**31),
       op=st.sampled_from(["add", "mul", "add_b", "mul_b", "scale", "silu", "gelu", "gelu_erf", "relu", "tanh",
                           "abs", "sigmoid", "softplus", "step", "view_add", "mul_per_row"]))
def test_elementwise(rows, cols, seed, op):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    b = rng.standard_normal((1 if op.endswith("_b") else rows, 1 if op == "mul_per_row" else cols)).astype(np.float32)

    def build(ctx):
        ta, tb = tensor(ctx, a), tensor(ctx, b)
        if op == "view_add":  # every other row of a 2x taller tensor: outer stride twice the row
            big = tensor(ctx, np.repeat(a, 2, axis=0))
            ta = ctx.view(big, (rows, cols), strides=(8 * cols, 4))
            return [ctx.add(ta, tensor(ctx, a))]
        if op.startswith("add"):
            return [ctx.add(ta, tb)]
        if op.startswith("mul"):
            return [ctx.mul(ta, tb)]
        if op == "scale":
            return [ctx.scale(ta, -1.75)]
        return [getattr(ctx, op)(ta)]

    (got,), (cpu,) = both(build)
    want = {"add": lambda: ref.add(a, b), "mul": lambda: ref.mul(a, b), "add_b": lambda: ref.add(a, b),
            "mul_b": lambda: ref.mul(a, b), "mul_per_row": lambda: ref.mul(a, b),
            "scale": lambda: ref.scale(a, -1.75), "silu": lambda: ref.silu(a),
            "gelu": lambda: ref.gelu(a), "gelu_erf": lambda: ref.gelu_erf(a), "relu": lambda: ref.relu(a),
            "tanh": lambda: ref.tanh(a), "abs": lambda: ref.abs(a), "sigmoid": lambda: ref.sigmoid(a),
            "softplus": lambda: ref.softplus(a), "step": lambda: ref.step(a),
            "view_add": lambda: 2.0 * a}[op]()
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-6)


CPY_CASES = [(ggml.F32, t) for t in (ggml.F32, ggml.F16, ggml.BF16)] + [
    (t, ggml.F32) for t in (ggml.F16, ggml.BF16, *QUANT_TYPES)]


@pytest.mark.parametrize(("src_type", "dst_type"), CPY_CASES)
def test_cpy_converts(src_type, dst_type):
    rng = np.random.default_rng(src_type * 100 + dst_type)
    x = rng.standard_normal((3, 512)).astype(np.float32)

    def build(ctx):
        t = ctx.cpy(tensor(ctx, x, src_type), dst_type)
        return [ctx.cpy(t, ggml.F32)] if dst_type != ggml.F32 else [t]  # read 16-bit results back as F32

    (got,), (cpu,) = both(build)
    vals = weight_values(src_type if src_type != ggml.F32 else dst_type, x)
    np.testing.assert_array_equal(got.reshape(vals.shape), vals.astype(np.float32))  # both round to nearest even
    np.testing.assert_array_equal(got, cpu)


@pytest.mark.parametrize("type_", [ggml.F32, ggml.F16, ggml.BF16, *QUANT_TYPES])
def test_get_rows_every_type(type_):
    rng = np.random.default_rng(type_)
    k = 2 * max(ggml.block_size(type_), 33)
    k -= k % ggml.block_size(type_)
    w = rng.standard_normal((11, k)).astype(np.float32)
    ids = np.array([3, 0, 10, 3, 7], dtype=np.int32)
    vals = weight_values(type_, w)
    (got,), (cpu,) = both(lambda ctx: [ctx.get_rows(tensor(ctx, w, type_), tensor(ctx, ids))])
    np.testing.assert_allclose(got.reshape(len(ids), k), ref.get_rows(vals, ids), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, cpu)


@SETTINGS
@given(rows=st.integers(1, 6), cols=st.one_of(st.integers(1, 3000), st.integers(1, 5000).map(lambda c: 4 * c)),
       seed=st.integers(0, 2**31),
       layer=st.booleans(), offset=st.sampled_from([0.0, 100.0]))
def test_norms(rows, cols, seed, layer, offset):
    a = (np.random.default_rng(seed).standard_normal((rows, cols)) + offset).astype(np.float32)
    op = "layer_norm" if layer else "rms_norm"
    (got,), (cpu,) = both(lambda ctx: [getattr(ctx, op)(tensor(ctx, a), 1e-5)])
    want = getattr(ref, op)(a, 1e-5)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(rows=st.integers(1, 6), cols=st.sampled_from([4, 64, 128, 300]), gap=st.sampled_from([0, 1, 4, 96]),
       seed=st.integers(0, 2**31), layer=st.booleans())
def test_norms_of_rows_apart(rows, cols, gap, seed, layer):
    """Norms of rows spaced wider than they are (a head of q in a fused projection's rows, whose norm reads the
    view itself: it had been copied first), against float64 and the CPU."""
    a = np.random.default_rng(seed).standard_normal((rows, cols + gap)).astype(np.float32)
    op = "layer_norm" if layer else "rms_norm"

    def build(ctx):
        wide = ctx.scale(tensor(ctx, a), 1.0)
        return [getattr(ctx, op)(ctx.view(wide, (rows, cols), (4 * (cols + gap), 4), offset=4 * gap), 1e-5)]

    (got,), (cpu,) = both(build)
    want = getattr(ref, op)(a[:, gap:], 1e-5)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cpu.reshape(want.shape), want, rtol=1e-4, atol=1e-4)


@SETTINGS
@given(n_tokens=st.integers(1, 5), n_head=st.integers(1, 4),
       half_hd=st.one_of(st.integers(1, 40), st.sampled_from([64, 128, 256])), seed=st.integers(0, 2**31),
       mode=st.sampled_from([ggml.ROPE_NORMAL, ggml.ROPE_NEOX]), partial=st.booleans(), scaled=st.booleans(),
       yarn=st.sampled_from([{}, {"n_ctx_orig": 1024, "ext_factor": 1.0, "attn_factor": 0.9},
                             {"n_ctx_orig": 64, "ext_factor": 0.5, "beta_fast": 4.0, "beta_slow": 0.25}]))
def test_rope(n_tokens, n_head, half_hd, seed, mode, partial, scaled, yarn):
    """scaled: Llama 3's per-frequency factors; yarn: YaRN's arguments (positions interpolated 4x), or none."""
    fscale = 0.25 if yarn else 1.0
    rng = np.random.default_rng(seed)
    hd = 2 * half_hd
    n_dims = 2 * max(1, half_hd // 2) if partial else hd
    x = rng.standard_normal((n_tokens, n_head, hd)).astype(np.float32)
    pos = rng.integers(0, 5000, n_tokens).astype(np.int32)
    factors = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if scaled else None

    def build(ctx):
        tx = ctx.reshape(tensor(ctx, x.reshape(n_tokens * n_head, hd)), (n_tokens, n_head, hd))
        return [ctx.rope(tx, tensor(ctx, pos), n_dims, mode, 10000.0, fscale,
                         tensor(ctx, factors) if scaled else None, **yarn)]

    (got,), (cpu,) = both(build)
    want = ref.rope(x, pos, n_dims, mode, 10000.0, fscale, factors, **yarn)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(rows=st.integers(1, 7), cols=st.integers(1, 2000), use_pos=st.booleans(), seed=st.integers(0, 2**31))
def test_soft_max(rows, cols, use_pos, seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, cols)) * 5).astype(np.float32)
    pos = rng.integers(0, cols + 3, rows).astype(np.int32)

    def build(ctx):
        return [ctx.soft_max(tensor(ctx, a), tensor(ctx, pos) if use_pos else None, 0.7)]

    (got,), (cpu,) = both(build)
    want = ref.soft_max(a, pos if use_pos else None, 0.7)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-6)


@SETTINGS
@given(cache_type=st.sampled_from([ggml.F32, ggml.F16]), n_kv=st.integers(1, 3), group=st.integers(1, 3),
       hd=st.sampled_from([8, 16, 32, 40, 64, 80, 96, 128, 256, 264, 512]),
       n_ctx=st.one_of(st.integers(1, 700), st.integers(3000, 4500)),
       n_tokens=st.sampled_from([1, 2, 3, 4, 8, 16, 33, 70, 130]), seed=st.integers(0, 2**31), rope_k=st.booleans(),
       window=st.sampled_from([0, 1, 5, 64, 512]), with_sinks=st.booleans())
def test_kv_store_and_attention(cache_type, n_kv, group, hd, n_ctx, n_tokens, seed, rope_k, window, with_sinks):
    """With rope_k the new keys are rotated first: on CUDA rope writes them into the cache (one fused kernel);
    window > 0: a sliding-window layer's attention; 16 tokens or more: a prompt batch (over an F16 cache on tensor
    cores, in tiles of 64 tokens); a cache of thousands of slots: a decode step's slots split over several blocks."""
    rng = np.random.default_rng(seed)
    n_tokens = min(n_tokens, n_ctx)
    n_head = n_kv * group
    cache0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32)  # earlier tokens already stored
    knew = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    vnew = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((n_tokens, n_head, hd)).astype(np.float32)
    pos = np.sort(rng.choice(n_ctx, n_tokens, replace=False)).astype(np.int32)
    scale = 1.0 / np.sqrt(hd)
    sinks = (rng.standard_normal(n_head) * 3).astype(np.float32) if with_sinks else None  # gpt-oss'

    def build(ctx):
        kc = tensor(ctx, cache0, cache_type)
        vc = tensor(ctx, cache0[::-1].copy(), cache_type)
        p = tensor(ctx, pos)
        tk = tensor(ctx, knew.reshape(n_tokens * n_kv, hd))
        tk = ctx.reshape(tk, (n_tokens, n_kv, hd))
        k = ctx.kv_store(kc, ctx.rope(tk, p, hd, ggml.ROPE_NEOX, 10000.0) if rope_k else tk, p)
        v = ctx.kv_store(vc, tensor(ctx, vnew), p)
        return [ctx.attention(tensor(ctx, q), k, v, p, scale, window, tensor(ctx, sinks) if with_sinks else None)]

    n_fused = []
    (got,), (cpu,) = run(build, "cuda", n_fused), run(build, "cpu")
    assert n_fused == [int(rope_k)]
    cast = (lambda a: a.astype(np.float16).astype(np.float64)) if cache_type == ggml.F16 else np.float64
    kc, vc = cast(cache0).copy(), cast(cache0[::-1]).copy()
    kc[pos] = cast(ref.rope(knew, pos, hd, ggml.ROPE_NEOX, 10000.0).astype(np.float32) if rope_k else knew)
    vc[pos] = cast(vnew)
    want = ref.attention(q, kc, vc, pos, scale, window, sinks)
    # tensor cores take q and the probabilities as F16 (11 bits): an output's error grows to ~5e-4 of |v|
    atol = 1e-3 if cache_type == ggml.F16 and n_tokens >= 16 else 1e-4
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-3, atol=atol)
    np.testing.assert_allclose(got, cpu, rtol=1e-3, atol=atol)


@SETTINGS
@given(cache_type=st.sampled_from([ggml.F32, ggml.F16]), n_kv=st.integers(1, 3), group=st.integers(1, 3),
       hd=st.sampled_from([8, 40, 64, 128]), n_ctx=st.integers(4, 300), n_tokens=st.integers(1, 4),
       mode=st.sampled_from([ggml.ROPE_NORMAL, ggml.ROPE_NEOX]), partial=st.booleans(), normed=st.booleans(),
       seed=st.integers(0, 2**31))
def test_rope_and_store_of_one_projections_q_k_v(cache_type, n_kv, group, hd, n_ctx, n_tokens, mode, partial, normed,
                                                  seed):
    """q, k and v as views of one projection (models.common.fused_qkv: a layer's attention on the GPU): rope q,
    rope k into the cache and v into the cache run as one kernel, normed: q's and k's heads RMS-normed times their
    weights first (Qwen3's, Gemma 3's), in the same kernel; the attention over the caches equals float64 and the
    CPU."""
    rng = np.random.default_rng(seed)
    n_tokens = min(n_tokens, n_ctx)
    n_head = n_kv * group
    q_dim, kv_dim = n_head * hd, n_kv * hd
    n_dims = 2 * max(1, hd // 4) if partial else hd
    proj = ((3.0 if normed else 1.0) * rng.standard_normal((n_tokens, q_dim + 2 * kv_dim))).astype(np.float32)
    qw, kw = ((1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2))
    kc0, vc0 = (rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32) for _ in range(2))
    pos = np.sort(rng.choice(n_ctx, n_tokens, replace=False)).astype(np.int32)
    scale = 1.0 / np.sqrt(hd)

    def build(ctx):
        x = ctx.scale(tensor(ctx, proj), 1.0)  # made by a node, as the projection's GEMV makes it

        def heads(c0: int, n: int) -> ggml.Tensor:
            return ctx.view(x, (n_tokens, n, hd), (4 * (q_dim + 2 * kv_dim), 4 * hd, 4), offset=4 * c0)

        def heads_of(c0: int, n: int, w: np.ndarray) -> ggml.Tensor:
            return ctx.mul(ctx.rms_norm(heads(c0, n), 1e-6), tensor(ctx, w)) if normed else heads(c0, n)

        p = tensor(ctx, pos)
        q = ctx.rope(heads_of(0, n_head, qw), p, n_dims, mode, 10000.0)
        k = ctx.kv_store(tensor(ctx, kc0, cache_type), ctx.rope(heads_of(q_dim, n_kv, kw), p, n_dims, mode, 10000.0),
                         p)
        v = ctx.kv_store(tensor(ctx, vc0, cache_type), heads(q_dim + kv_dim, n_kv), p)
        return [ctx.attention(q, k, v, p, scale, 0)]

    n_fused = []
    (got,), (cpu,) = run(build, "cuda", n_fused), run(build, "cpu")
    # six nodes (rope q, k's view, rope k, its store, v's view, its store), ten with q's and k's norms: one kernel
    assert n_fused == [9 if normed else 5]
    cast = (lambda a: a.astype(np.float16).astype(np.float64)) if cache_type == ggml.F16 else np.float64
    qkv = proj.reshape(n_tokens, n_kv * (group + 2), hd)
    q64, k64 = qkv[:, :n_head], qkv[:, n_head:n_head + n_kv]
    if normed:
        q64, k64 = ref.rms_norm(q64, 1e-6) * qw, ref.rms_norm(k64, 1e-6) * kw
    kc, vc = cast(kc0), cast(vc0)
    kc[pos] = cast(ref.rope(k64, pos, n_dims, mode, 10000.0).astype(np.float32))
    vc[pos] = cast(qkv[:, n_head + n_kv:])
    want = ref.attention(ref.rope(q64, pos, n_dims, mode, 10000.0), kc, vc, pos, scale)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(got, cpu, rtol=1e-3, atol=1e-4)


@SETTINGS
@given(n_kv=st.integers(1, 3), group=st.integers(1, 3), hd=st.sampled_from([8, 40, 64, 128, 256]),
       n_tokens=st.sampled_from([1, 2, 5, 20]), mode=st.sampled_from([ggml.ROPE_NORMAL, ggml.ROPE_NEOX]),
       partial=st.booleans(), seed=st.integers(0, 2**31))
def test_q_and_k_norms_fuse_with_their_rope(n_kv, group, hd, n_tokens, mode, partial, seed):
    """Qwen3's and Gemma's attention (models.common.attention_block): q and k RMS-normed per head times a weight,
    then rotated, k into the cache. On CUDA each norm, mul and rope (and k's kv_store) is one kernel; the attention
    over the cache equals float64 and the CPU."""
    rng = np.random.default_rng(seed)
    n_ctx = 64
    n_head = n_kv * group
    n_dims = 2 * max(1, hd // 4) if partial else hd
    q0 = (3.0 * rng.standard_normal((n_tokens, n_head, hd))).astype(np.float32)
    k0 = (3.0 * rng.standard_normal((n_tokens, n_kv, hd))).astype(np.float32)
    v0 = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    qw, kw = ((1.0 + 0.3 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2))
    kc0, vc0 = (rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32) for _ in range(2))
    pos = np.sort(rng.choice(n_ctx, n_tokens, replace=False)).astype(np.int32)
    scale = 1.0 / np.sqrt(hd)

    def build(ctx):
        def made(a):  # by a node, as the projection's GEMV makes it
            return ctx.scale(tensor(ctx, a), 1.0)

        p = tensor(ctx, pos)
        q = ctx.rope(ctx.mul(ctx.rms_norm(made(q0), 1e-6), tensor(ctx, qw)), p, n_dims, mode, 10000.0)
        k = ctx.rope(ctx.mul(ctx.rms_norm(made(k0), 1e-6), tensor(ctx, kw)), p, n_dims, mode, 10000.0)
        kc = ctx.kv_store(tensor(ctx, kc0), k, p)
        vc = ctx.kv_store(tensor(ctx, vc0), tensor(ctx, v0), p)
        return [ctx.attention(q, kc, vc, p, scale, 0)]

    n_fused = []
    (got,), (cpu,) = run(build, "cuda", n_fused), run(build, "cpu")
    assert n_fused == [2 + 3]  # q's norm, mul and rope; k's norm, mul, rope and kv_store
    kc, vc = kc0.astype(np.float64), vc0.astype(np.float64)
    kc[pos] = ref.rope(ref.rms_norm(k0, 1e-6) * kw, pos, n_dims, mode, 10000.0)
    vc[pos] = v0
    want = ref.attention(ref.rope(ref.rms_norm(q0, 1e-6) * qw, pos, n_dims, mode, 10000.0), kc, vc, pos, scale)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(got, cpu, rtol=1e-3, atol=1e-4)


@SETTINGS
@given(n_tokens=st.integers(1, 5), n_head=st.integers(1, 4), hd=st.sampled_from([4, 8, 40]), part=st.integers(0, 2),
       seed=st.integers(0, 2**31))
def test_heads_of_a_fused_projection_cross_devices(n_tokens, n_head, hd, part, seed):
    """q, k or v as a view (tokens, heads, head dim) into a fused projection made on the GPU, its token rows
    spaced by the fused row, stored into a KV cache on the host (Falcon's layers whose attention is on the
    CPU while a prompt's projections run on the GPU): the view crosses as one packed copy."""
    rng = np.random.default_rng(seed)
    fused = rng.standard_normal((n_tokens, 3 * n_head * hd)).astype(np.float32)
    cache0 = rng.standard_normal((8, n_head, hd)).astype(np.float32)
    pos = np.arange(1, n_tokens + 1, dtype=np.int32)
    ctx = ggml.Context(16 << 20)
    made_on_gpu = ctx.scale(tensor(ctx, fused).to_device(), 2.0)
    row = 4 * 3 * n_head * hd
    heads = ctx.view(made_on_gpu, (n_tokens, n_head, hd), (row, 4 * hd, 4), offset=4 * part * n_head * hd)
    cache = ctx.kv_store(tensor(ctx, cache0), heads, tensor(ctx, pos))
    ggml.Graph(ctx, [cache]).plan().compute(pool())
    want = cache0.copy()
    want[pos] = 2 * fused.reshape(n_tokens, 3, n_head, hd)[:, part]
    np.testing.assert_array_equal(read(cache).reshape(want.shape), want)


# ---------------------------------------------------------------------------------------------------
# mul_mat (GEMV for m <= 8, GEMM beyond), mul_mat_rows, axpy_rows
# ---------------------------------------------------------------------------------------------------

@st.composite
def matmul_case(draw, types=ggml.WEIGHT_TYPES):
    type_ = draw(st.sampled_from(types))
    m = draw(st.sampled_from([1, 2, 3, 5, 8, 9, 17, 40]))
    return type_, row_len(type_, draw), draw(st.integers(1, 300)), m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=matmul_case(), seed=st.integers(0, 2**31))
def test_mul_mat(case, seed):
    type_, k, n, m = case
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    (got,), (cpu,) = both(lambda ctx: [ctx.mul_mat(tensor(ctx, w, type_), tensor(ctx, x))])
    w64 = weight_values(type_, w)
    want, bound = ref.mul_mat(w64, x), np.abs(x) @ np.abs(w64).T
    assert_dot_close(got.reshape(want.shape), want, bound, type_)
    assert_dot_close(got.reshape(want.shape), cpu.reshape(want.shape), 2 * bound, type_)


@st.composite
def selector(draw, n_rows: int, m: int, rng):
    kind = draw(st.sampled_from(["none", "mask", "list"]))
    begin = draw(st.integers(0, n_rows))
    end = draw(st.sampled_from([-1, draw(st.integers(begin, n_rows))]))
    if kind == "none":
        return None, begin, end
    if kind == "mask":
        density = draw(st.sampled_from([0.0, 0.05, 0.1, 0.5, 1.0]))
        return np.where(rng.random((m, n_rows)) < density, 1.0, -1.0).astype(np.float32), begin, end
    n_sel = draw(st.integers(1, n_rows))
    lists = rng.integers(0, n_rows, (m, n_sel)).astype(np.int32)  # repeats allowed
    for j in range(m):
        cut = draw(st.integers(0, n_sel))
        lists[j, cut:] = -1
        if cut < n_sel - 1:
            lists[j, cut + 1:] = rng.integers(0, n_rows, n_sel - cut - 1)  # entries after the end are ignored
    return lists, begin, end


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_=st.sampled_from(ggml.WEIGHT_TYPES), data=st.data(), seed=st.integers(0, 2**31))
def test_mul_mat_rows(type_, data, seed):
    rng = np.random.default_rng(seed)
    k = row_len(type_, data.draw)
    n = data.draw(st.integers(1, 700))
    m = data.draw(st.sampled_from([1, 1, 2, 3, 10]))
    sel, begin, end = data.draw(selector(n, m, rng))
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)

    def build(ctx):
        ts = None if sel is None else tensor(ctx, sel)
        return [ctx.mul_mat_rows(tensor(ctx, w, type_), tensor(ctx, x), ts, begin, end)]

    (got,), (cpu,) = both(build)
    w64 = weight_values(type_, w)
    want = ref.mul_mat_rows(w64, x, sel, begin, end)
    bound = np.abs(x) @ np.abs(w64).T
    got = got.reshape(want.shape)
    assert np.all(got[ref.selection(sel, n, m, begin, end) == 0] == 0)  # unselected: exact zeros
    assert_dot_close(got, want, bound, type_)
    assert_dot_close(got, cpu.reshape(want.shape), 2 * bound, type_)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_=st.sampled_from(ggml.WEIGHT_TYPES), data=st.data(), seed=st.integers(0, 2**31))
def test_axpy_rows(type_, data, seed):
    rng = np.random.default_rng(seed)
    d = row_len(type_, data.draw)
    n = data.draw(st.integers(1, 700))
    m = data.draw(st.sampled_from([1, 1, 2, 3, 9, 40]))  # beyond 8 columns a mask or none runs as GEMMs
    sel, begin, end = data.draw(selector(n, m, rng))
    wt = rng.standard_normal((n, d)).astype(np.float32)
    h = rng.standard_normal((m, n)).astype(np.float32)

    def build(ctx):
        ts = None if sel is None else tensor(ctx, sel)
        # precise: the CPU's float kernels (its 8-bit coefficients are tested in test_sparse_ops); CUDA's are float
        return [ctx.axpy_rows(tensor(ctx, wt, type_), tensor(ctx, h), ts, begin, end, precise=True)]

    (got,), (cpu,) = both(build)
    w64 = weight_values(type_, wt)
    want = ref.axpy_rows(w64, h, sel, begin, end)
    counts = ref.selection(sel, n, m, begin, end)
    bound = (np.abs(h) * counts) @ np.abs(w64)
    got = got.reshape(want.shape)
    if m > 8 and (sel is None or sel.dtype == np.float32):  # GEMM: h in 16 bits (TF32 for F32 weights)
        assert_dot_close(got, want, bound, type_)
        assert_dot_close(got, cpu.reshape(want.shape), 2 * bound, type_)
        return
    # float32 sums in a different order: relative to the sum of magnitudes
    np.testing.assert_array_less(np.abs(got - want), 1e-5 * bound + 1e-5)
    np.testing.assert_array_less(np.abs(got - cpu.reshape(want.shape)), 1e-5 * bound + 1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_=st.sampled_from(ggml.WEIGHT_TYPES), data=st.data(), seed=st.integers(0, 2**31),
       act=st.sampled_from(["silu", "gelu", "relu"]), layer=st.booleans())
def test_fused_decode_chains(type_, data, seed, act, layer):
    """The chains a decode step fuses on CUDA (norm -> mul, gate/act/up -> mul, GEMV -> add, GEMV -> act, GEMVs
    sharing one quantized x) against float64 and the unfused CPU graph."""
    rng = np.random.default_rng(seed)
    k = row_len(type_, data.draw)
    n = data.draw(st.integers(1, 700))
    d = data.draw(st.integers(1, 300))
    x = rng.standard_normal(k).astype(np.float32)
    wn = rng.standard_normal(k).astype(np.float32)
    wg, wu, wq = (rng.standard_normal((n, k)).astype(np.float32) for _ in range(3))
    wd = rng.standard_normal((d, n)).astype(np.float32)
    res = rng.standard_normal(d).astype(np.float32)
    wd_type = ggml.F32 if type_ in QUANT_TYPES else type_

    def build(ctx):
        norm = ctx.layer_norm if layer else ctx.rms_norm
        h = ctx.mul(norm(tensor(ctx, x), 1e-5), tensor(ctx, wn))
        glu = ctx.mul(getattr(ctx, act)(ctx.mul_mat(tensor(ctx, wg, type_), h)), ctx.mul_mat(tensor(ctx, wu, type_), h))
        q = getattr(ctx, act)(ctx.mul_mat(tensor(ctx, wq, type_), h))  # the GLU left h quantized in the scratch
        out = ctx.add(ctx.mul_mat(tensor(ctx, wd, wd_type), glu), tensor(ctx, res))
        return [glu, q, out]

    graphs = []
    got, cpu = ([r.reshape(-1) for r in run(build, b, graphs)] for b in ("cuda", "cpu"))

    def gemv_fuses(t, row):  # float rows fuse when 16-byte aligned
        return t in QUANT_TYPES or row % (4 if t == ggml.F32 else 8) == 0

    expected = 1 + 4 * gemv_fuses(type_, k) + gemv_fuses(wd_type, n)  # norm, GLU, GEMV + act, GEMV + add
    assert graphs == [expected, 0], graphs

    h = (ref.layer_norm if layer else ref.rms_norm)(x[None].astype(np.float64), 1e-5)[0] * wn
    wg64, wu64, wq64 = (weight_values(type_, w) for w in (wg, wu, wq))
    g, u = wg64 @ h, wu64 @ h
    tol_g, tol_u = (DOT_TOL[type_] * (np.abs(w) @ np.abs(h)) + 1e-4 for w in (wg64, wu64))
    a = getattr(ref, act)(g)
    want_glu = a * u
    # |d act| <= 1.13 |d g| for silu/gelu/relu
    tol_glu = 1.13 * tol_g * (np.abs(u) + tol_u) + np.abs(a) * tol_u + 1e-4
    want_q = getattr(ref, act)(wq64 @ h)
    wd64 = weight_values(wd_type, wd)
    want_out = wd64 @ want_glu + res
    tol_out = np.abs(wd64) @ tol_glu + DOT_TOL[type_] * (np.abs(wd64) @ np.abs(want_glu)) + 1e-4
    tol_q = 1.13 * DOT_TOL[type_] * (np.abs(wq64) @ np.abs(h)) + 1e-4
    checks = (("glu", want_glu, tol_glu), ("q", want_q, tol_q), ("out", want_out, tol_out))
    for results in (got, cpu):
        for result, (name, want, tol) in zip(results, checks, strict=True):
            bad = ~(np.abs(result - want) <= tol)
            assert not bad.any(), f"{name}: {bad.sum()} of {bad.size} off, got {result[bad][:3]} want {want[bad][:3]}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_=st.sampled_from(ggml.WEIGHT_TYPES), cache_type=st.sampled_from([ggml.F32, ggml.F16]),
       n_kv=st.integers(1, 3), hd=st.sampled_from([8, 64, 128]), biased=st.booleans(), data=st.data(),
       seed=st.integers(0, 2**31))
def test_v_projection_goes_straight_into_its_cache_slot(type_, cache_type, n_kv, hd, biased, data, seed):
    """A decode step's v (models.common.attention_block): GEMV, Qwen2's bias, its rows viewed as heads, kv_store. On
    CUDA the GEMV writes each row into the cache slot (one kernel) where its rows fuse; the slot equals float64 and
    the CPU's, the other slots untouched."""
    rng = np.random.default_rng(seed)
    k = row_len(type_, data.draw)
    n_ctx = 16
    x = rng.standard_normal(k).astype(np.float32)
    w = rng.standard_normal((n_kv * hd, k)).astype(np.float32)
    bias = rng.standard_normal(n_kv * hd).astype(np.float32)
    cache0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32)
    pos = data.draw(st.sampled_from([0, 5, n_ctx - 1]))

    def build(ctx):
        v = ctx.mul_mat(tensor(ctx, w, type_), ctx.scale(tensor(ctx, x), 1.0))
        if biased:
            v = ctx.add(v, tensor(ctx, bias))
        v = ctx.reshape(v, (1, n_kv, hd))
        store = ctx.kv_store(tensor(ctx, cache0, cache_type), v, tensor(ctx, np.array([pos], np.int32)))
        return [ctx.cpy(store, ggml.F32)]  # the whole cache, read as F32

    n_fused = []
    (got,), (cpu,) = run(build, "cuda", n_fused), run(build, "cpu")
    fuses = type_ in QUANT_TYPES or k % (4 if type_ == ggml.F32 else 8) == 0  # float rows: 16-byte aligned
    assert n_fused == [(3 if biased else 2) if fuses else 0]
    cast = (lambda a: a.astype(np.float16).astype(np.float64)) if cache_type == ggml.F16 else np.float64
    w64 = weight_values(type_, w)
    v = w64 @ x + (bias if biased else 0.0)
    want = cast(cache0)
    got, cpu = (a.reshape(want.shape).astype(np.float64) for a in (got, cpu))
    tol = DOT_TOL[type_] * (np.abs(w64) @ np.abs(x)).reshape(n_kv, hd) + 1e-3 * np.abs(v.reshape(n_kv, hd)) + 1e-4
    others = np.arange(n_ctx) != pos
    for result in (got, cpu):
        assert (np.abs(result[pos] - v.reshape(n_kv, hd)) <= tol).all()
        np.testing.assert_array_equal(result[others], want[others])


def sparse_ffn_mask(n: int, density: float, hot_first: bool, rng) -> tuple[np.ndarray, np.ndarray]:
    """(selected, predictor logits): a dense head and a sparser tail when hot_first (the hot neurons stored
    first), else scattered; some unselected logits exactly 0 (they select nothing)."""
    on = rng.random(n) < density
    if hot_first:
        head = int(n * density / 2)
        on = np.concatenate([np.ones(head, bool), rng.random(n - head) < density / 4])
    pred = np.where(on, rng.uniform(0.1, 2.0, n), -rng.uniform(0.0, 2.0, n)).astype(np.float32)
    pred[~on & (rng.random(n) < 0.1)] = 0.0
    return on, pred


def sparse_ffn_graph(x, pred, weights, type_: int, act: str, fuse: bool = True, quantize_first=None,
                     down_type: int | None = None, residual=None):
    """build(ctx) for one token's sparse FFN as sparse_ffn.rows_ffn builds it: gate rows under pred, act, up
    rows under pred or, for relu, under relu(gate), mul, axpy of down_t (of down_type, default type_).
    fuse=False also outputs the mul, which keeps the run from fusing (its activations, as the GPU computed
    them, come second); quantize_first: a weight whose quantized GEMV of x comes first (the group then finds
    x's Q8_1 copy); residual: a vector the output is added to (as a layer adds its FFN to the residual stream)."""
    wg, wu, wdt = weights

    def build(ctx):
        h, p = tensor(ctx, x), tensor(ctx, pred)
        first = [ctx.mul_mat(tensor(ctx, quantize_first, type_), h)] if quantize_first is not None else []
        a = getattr(ctx, act)(ctx.mul_mat_rows(tensor(ctx, wg, type_), h, p))
        sel = a if act == "relu" else p
        mul = ctx.mul(a, ctx.mul_mat_rows(tensor(ctx, wu, type_), h, sel))
        down = tensor(ctx, wdt, type_ if down_type is None else down_type)
        y = ctx.axpy_rows(down, mul, sel, precise=True)  # the CPU's float kernels, as CUDA's
        y = ctx.add(tensor(ctx, residual), y) if residual is not None else y
        return [*first, y, *([] if fuse else [mul])]

    return build


def assert_fused_equals_unfused(x, pred, weights, type_, act, expect_fused: int, mem: int = 64 << 20,
                                quantize_first=None, down_type: int | None = None, residual=None) -> np.ndarray:
    """The fused group on CUDA against the same ops unfused on CUDA: the same activations, down_t rows summed
    in another order, so a tolerance of float32 sums (a row dropped or added shows); returns the fused y."""
    graphs = []
    fused = run(sparse_ffn_graph(x, pred, weights, type_, act, True, quantize_first, down_type, residual), "cuda",
                graphs, mem)
    unfused = run(sparse_ffn_graph(x, pred, weights, type_, act, False, quantize_first, down_type, residual), "cuda",
                  graphs, mem)
    assert graphs == [expect_fused, 0], graphs
    got, want, act_gpu = fused[-1].reshape(-1), unfused[-2].reshape(-1), unfused[-1].reshape(-1)
    types = (type_, type_, type_ if down_type is None else down_type)
    wg64, wu64, wd64 = (weight_values(t, w) for t, w in zip(types, weights, strict=True))
    # fused, float gate rows sum in another order: a relu gate within rounding of 0 may flip, adding |g| |u| at
    # most (quantized rows sum the same way in both)
    gmag = np.abs(wg64) @ np.abs(x)
    flippable = (pred > 0) & (np.abs(wg64 @ x) < 1e-5 * gmag) & (type_ in (ggml.F32, ggml.F16, ggml.BF16))
    flip = flippable * 1e-5 * gmag * (np.abs(wu64) @ np.abs(x))
    # float32 sums of up to thousands of rows in two orders
    tol = 1e-4 * (np.abs(act_gpu) @ np.abs(wd64)) + flip @ np.abs(wd64) + 1e-6
    tol = tol + (1e-6 * np.abs(residual) if residual is not None else 0.0)
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, got {got[bad][:3]} want {want[bad][:3]}"
    return got


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_=st.sampled_from(ggml.WEIGHT_TYPES), data=st.data(), seed=st.integers(0, 2**31),
       act=st.sampled_from(["silu", "gelu", "relu"]), hot_first=st.booleans())
def test_fused_sparse_ffn(type_, data, seed, act, hot_first):
    """One token's sparse FFN runs on CUDA as one fused group: against the same ops unfused on CUDA (tight),
    float64 and the CPU graph (within the quantization's error), for masks of any density, hot-first or not,
    down_t of gate's type or of its own (llama.cpp's Q4_K_M keeps ffn_down in Q6_K: the group had not fused),
    with or without the residual added after it (the group's sum then starts from it)."""
    rng = np.random.default_rng(seed)
    down_type = data.draw(st.sampled_from([type_, *ggml.WEIGHT_TYPES]))
    # rows of both types: k a multiple of the larger block
    k = row_len(max(type_, down_type, key=ggml.block_size), data.draw)
    n = data.draw(st.integers(1, 2000))
    on, pred = sparse_ffn_mask(n, data.draw(st.sampled_from([0.0, 0.02, 0.1, 0.5, 1.0])), hot_first, rng)
    x = rng.standard_normal(k).astype(np.float32)
    weights = tuple(rng.standard_normal((n, k)).astype(np.float32) for _ in range(3))
    residual = rng.standard_normal(k).astype(np.float32) if data.draw(st.booleans()) else None
    fuses = type_ in QUANT_TYPES or k % (4 if type_ == ggml.F32 else 8) == 0  # float rows: 16-byte aligned
    expect = (4 + (residual is not None)) if fuses else 0
    got = assert_fused_equals_unfused(x, pred, weights, type_, act, expect, down_type=down_type, residual=residual)
    (cpu,) = run(sparse_ffn_graph(x, pred, weights, type_, act, down_type=down_type, residual=residual), "cpu")

    wg64, wu64 = (weight_values(type_, w) for w in weights[:2])
    wd64 = weight_values(down_type, weights[2])
    g, u = wg64 @ x, wu64 @ x
    tol_g, tol_u = (DOT_TOL[type_] * (np.abs(w) @ np.abs(x)) + 1e-4 for w in (wg64, wu64))
    a = getattr(ref, act)(g)
    computed = on & (g > 0) if act == "relu" else on
    want_act = np.where(computed, a * u, 0.0)
    # |d act| <= 1.13 |d g|; a relu row with |g| within its error may go either way
    tol_act = on * (1.13 * tol_g * (np.abs(u) + tol_u) + np.abs(a) * tol_u + 1e-4)
    want = want_act @ wd64 + (residual if residual is not None else 0.0)
    tol = tol_act @ np.abs(wd64) + DOT_TOL[down_type] * (np.abs(want_act) @ np.abs(wd64)) + 1e-4
    for name, result in (("cuda", got), ("cpu", cpu.reshape(-1))):
        bad = ~(np.abs(result - want) <= tol)
        assert not bad.any(), f"{name}: {bad.sum()} of {bad.size} off, got {result[bad][:3]} want {want[bad][:3]}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31), act=st.sampled_from(["silu", "gelu", "relu"]), flag=st.booleans())
@pytest.mark.parametrize("drawn", [test_mul_mat, test_mul_mat_rows, test_axpy_rows, test_fused_decode_chains,
                                   test_fused_sparse_ffn], ids=lambda t: t.__name__)
def test_mxfp4_through_every_path(drawn, data, seed, act, flag):
    """The tests above that draw a weight type, with MXFP4 every time (gpt-oss's experts): its 17-byte blocks lie at
    odd addresses, as no other type's do."""
    if drawn is test_mul_mat:
        drawn.hypothesis.inner_test(data.draw(matmul_case(types=[ggml.MXFP4])), seed)
    elif drawn in (test_mul_mat_rows, test_axpy_rows):
        drawn.hypothesis.inner_test(ggml.MXFP4, data, seed)
    else:
        drawn.hypothesis.inner_test(ggml.MXFP4, data, seed, act, flag)


@pytest.mark.parametrize("type_, down_type", [(ggml.F16, ggml.F16), (ggml.Q4_0, ggml.Q4_0), (ggml.Q4_K, ggml.Q4_K),
                                              (ggml.Q4_K, ggml.Q6_K), (ggml.MXFP4, ggml.MXFP4)])
@pytest.mark.parametrize("density, hot_first", [(1.0, False), (0.1, True)])
def test_fused_sparse_ffn_at_size(type_, down_type, density, hot_first):
    """A layer large enough for every path of the group's kernels: more listed rows than the rows kernel has
    warps (6000 > 32 x the SMs of an H100), several 1024-value slices of down_t with a partial last one
    (2304 values), more list groups than the down kernel's grid (its stride); for quantized weights x's Q8_1
    copy comes from the GEMV before the group."""
    rng = np.random.default_rng(int(density * 10) + hot_first)
    n, k = 6000, 2304
    _, pred = sparse_ffn_mask(n, density, hot_first, rng)
    x = rng.standard_normal(k).astype(np.float32)
    weights = tuple(rng.standard_normal((n, k)).astype(np.float32) for _ in range(3))
    first = rng.standard_normal((64, k)).astype(np.float32) if type_ in QUANT_TYPES else None
    assert_fused_equals_unfused(x, pred, weights, type_, "relu", 4, 160 << 20, first, down_type)


def test_gemm_large_quantized_and_f16():
    """A GEMM big enough for several cuBLAS tiles (and, for Q4_0 and MXFP4, the dequantize-to-F16 path)."""
    rng = np.random.default_rng(7)
    k, n, m = 1024, 600, 70
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    for type_ in (ggml.F16, ggml.Q4_0, ggml.MXFP4, ggml.BF16, ggml.F32):
        (got,) = run(lambda ctx, t=type_: [ctx.mul_mat(tensor(ctx, w, t), tensor(ctx, x))], "cuda")
        w64 = weight_values(type_, w)
        assert_dot_close(got.reshape(m, n), ref.mul_mat(w64, x), np.abs(x) @ np.abs(w64).T, type_)


@pytest.mark.parametrize("op", ["mul_mat", "axpy_rows"])
def test_a_gemms_scratch_bounds_its_dequantized_rows(op):
    """ggml_set_gemm_scratch: a matmul made after it dequantizes its quantized weight rows that many bytes at a time
    (at least 128 rows) for cuBLAS: the graph holds less device memory (a tight VRAM budget's weights get the room)
    and the product is the same, for mul_mat and axpy_rows' batch GEMM alike."""
    rng = np.random.default_rng(8)
    k, n, m = 1024, 600, 70  # 600 rows: 4 chunks of 128 and one of 88, where the default takes them at once
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k if op == "mul_mat" else n)).astype(np.float32)
    results, peaks = [], []
    for scratch in (0, 128 * 2 * k):
        def build(ctx, scratch=scratch):
            ctx.set_gemm_scratch(scratch)
            weight, act = tensor(ctx, w, ggml.Q4_0), tensor(ctx, x)
            return [ctx.mul_mat(weight, act) if op == "mul_mat" else ctx.axpy_rows(weight, act)]

        gc.collect()
        held = lib.ggml_cuda_peak_reset()
        results.append(run(build, "cuda")[0])
        peaks.append(lib.ggml_cuda_allocated_peak() - held)
    w64 = weight_values(ggml.Q4_0, w)
    for got in results:
        if op == "mul_mat":
            assert_dot_close(got.reshape(m, n), ref.mul_mat(w64, x), np.abs(x) @ np.abs(w64).T, ggml.Q4_0)
        else:
            assert_dot_close(got.reshape(m, k), ref.axpy_rows(w64, x), np.abs(x) @ np.abs(w64), ggml.Q4_0)
    assert peaks[0] - peaks[1] >= (n - 128) * 2 * k, peaks


def test_device_name():
    assert ggml.cuda_available()
    assert ffi.string(lib.ggml_cuda_device_name())


def device_tensor(n_floats: int) -> ggml.Context:
    ctx = ggml.Context(4 * n_floats + (1 << 20))
    tensor(ctx, np.zeros(n_floats, np.float32)).to_device()
    return ctx


def test_peak_counts_device_memory_already_given_back():
    # a prompt's graph buffers come and go: a VRAM budget is checked against the most held at once
    device_tensor(256)  # the device started (its first use allocates the cuBLAS workspace), then given back
    gc.collect()  # with earlier tests' garbage, before the count is taken
    held = lib.ggml_cuda_peak_reset()
    assert lib.ggml_cuda_allocated_peak() == held == lib.ggml_cuda_allocated()
    ctx = device_tensor(1 << 20)
    assert lib.ggml_cuda_allocated() >= held + (4 << 20)
    del ctx
    gc.collect()
    assert lib.ggml_cuda_allocated() == held
    assert lib.ggml_cuda_allocated_peak() >= held + (4 << 20)
    assert lib.ggml_cuda_peak_reset() == held == lib.ggml_cuda_allocated_peak()


def test_streamed_weights_take_turns_in_one_copys_memory_whatever_their_size():
    """A prompt's host weights are copied in just before their reader, into memory the next one reuses. Weights
    under 1 MiB (a profiled split's single experts) had been staged up front instead, every one of them alive
    through the whole batch: a 4.4 GiB mixture's prompt outgrew its budget's reserve at two thirds."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((64, 64)).astype(np.float32) / 8 for _ in range(12)]
    x = rng.standard_normal((40, 64)).astype(np.float32)
    ctx = ggml.Context(16 << 20)
    y = tensor(ctx, x)
    for w in ws:
        y = ctx.mul_mat(tensor(ctx, w), y)
    g = ggml.Graph(ctx, [y], stream_min_cols=32).plan()
    g.compute(pool())
    want = x.astype(np.float64)
    for w in ws:
        want = want @ w.T.astype(np.float64)
    np.testing.assert_allclose(read(y).reshape(want.shape), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())  # TF32
    assert g.device_mem_bytes < 4 * ws[0].nbytes + 3 * x.nbytes  # two copies and activations at most, not twelve


@SETTINGS
@given(n=st.integers(1, 5), k=st.integers(1, 700), seed=st.integers(0, 2**31),
       act=st.sampled_from(["silu", "gelu", "sigmoid", "softplus", "step"]), leak=st.booleans())
def test_fused_input_sparsity_chains(n, k, seed, act, leak):
    """Input sparsity's |x| - t mask (abs, then add, as models.sparse_ffn.over_threshold builds it) and act(gate) * up
    (as input_ffn orders them; sigmoid and softplus as Qwen3.5's gates, step as a prompt's channel mask) run as one
    kernel each on CUDA, against float64 and the CPU graph; chains whose intermediates are outputs too (leak) are
    left unfused."""
    from pyinfer.models.sparse_ffn import over_threshold

    rng = np.random.default_rng(seed)
    x, gate, up = (rng.standard_normal((n, k)).astype(np.float32) for _ in range(3))
    t = np.abs(rng.standard_normal(k)).astype(np.float32)

    def build(ctx):
        xt = ctx.scale(tensor(ctx, x).to_device(), 1.0)  # made on the device, as a layer's input is
        neg_t = tensor(ctx, -t)
        if leak:
            abs_x = ctx.abs(xt)
            mask = ctx.add(abs_x, neg_t)
        else:
            mask = over_threshold(ctx, xt, neg_t)
        activated = getattr(ctx, act)(ctx.scale(tensor(ctx, gate).to_device(), 1.0))
        h = ctx.mul(ctx.scale(tensor(ctx, up).to_device(), 1.0), activated)
        return [mask, h] + ([abs_x, activated] if leak else [])

    n_fused = []
    got, cpu = run(build, "cuda", n_fused), run(build, "cpu")
    assert n_fused == [0 if leak else 2]
    want_mask = np.abs(x.astype(np.float64)) - t
    want_h = getattr(ref, act)(gate.astype(np.float64)) * up
    for result in (got, cpu):
        np.testing.assert_allclose(result[0].reshape(n, k), want_mask, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(result[1].reshape(n, k), want_h, rtol=1e-5, atol=1e-6)


def test_fused_intermediates_take_no_memory():
    """A fused run's intermediates, which its kernel never writes and nothing after it reads, get no graph memory:
    a 512-token |x| - t chain holds its input and output only (its intermediates, alive to the run's end, had
    pushed a prompt's graph over a VRAM budget); one read after the run keeps its memory."""
    from pyinfer.models.sparse_ffn import over_threshold

    n, k = 512, 4096
    act_bytes = 4 * n * k
    x = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)

    def graph_bytes(leak: bool) -> int:
        ctx = ggml.Context(64 << 20)
        xt = ctx.scale(tensor(ctx, x).to_device(), 1.0)
        neg_t = tensor(ctx, np.full(k, -0.5, dtype=np.float32))
        if leak:  # the same nodes, |x| also an output
            abs_x = ctx.abs(xt)
            outputs = [ctx.add(abs_x, neg_t), abs_x]
        else:
            outputs = [over_threshold(ctx, xt, neg_t)]
        before = lib.ggml_cuda_allocated()
        g = ggml.Graph(ctx, outputs, backend="cuda").plan()
        g.compute(pool())
        used = lib.ggml_cuda_allocated() - before
        assert np.allclose(read(outputs[0]).reshape(n, k), np.abs(x) - 0.5, atol=1e-6)
        del g, ctx
        gc.collect()
        return used

    assert graph_bytes(False) <= 2 * act_bytes + (1 << 20)  # xt and the mask
    assert graph_bytes(True) >= 2 * act_bytes  # unfused: |x| and the mask, both outputs, held to the end


def test_a_refused_host_registration_leaves_no_error_behind():
    """Registering memory twice is refused (small host arrays share pages, so host_array meets it) and the refusal
    stays with the caller: the next kernel launch must not report it as its own failure."""
    buffer = np.zeros(1 << 16, np.uint8)
    ptr = ffi.from_buffer(buffer)
    assert lib.ggml_cuda_host_register(ptr, buffer.nbytes, False) == lib.GGML_STATUS_OK
    try:
        assert lib.ggml_cuda_host_register(ptr, buffer.nbytes, False) != lib.GGML_STATUS_OK
        lib.ggml_clear_error()
        a = np.arange(8, dtype=np.float32)
        (got,) = run(lambda ctx: [ctx.sigmoid(tensor(ctx, a))], "cuda")
        np.testing.assert_allclose(got.reshape(-1), ref.sigmoid(a), rtol=1e-6)
    finally:
        lib.ggml_cuda_host_unregister(ptr)
