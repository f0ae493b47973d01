"""CPU kernels of the dense ops against reference_ops (numpy float64).

Outputs are poisoned with NaN before each compute, so a kernel that skips an element fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_ops as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_harness import compute, pool, tensor, weights

from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUANT_TYPES = (ggml.Q8_0, ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q4_K, ggml.Q6_K, ggml.MXFP4)
# Q4_1's dot takes the activations' block sums as stored in Q8_1 (f16), the rest is float32 rounding
EMU_TOL = {ggml.Q4_1: 2e-3}
# relative error of a dot product after the activations are converted to the weight's vec_dot_type
ACT_TOL = {ggml.F32: 1e-5, ggml.F16: 2e-3, ggml.BF16: 1e-2, **{t: 0.02 for t in QUANT_TYPES}}


def rows_for(type_: int, draw, max_blocks: int = 3) -> int:
    """A row length valid for type_: whole blocks, or any length for plain types."""
    blk = ggml.block_size(type_)
    if blk == 1:
        return draw(st.integers(1, 300))
    return blk * draw(st.integers(1, max_blocks if blk < 256 else 2))


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_close(got, want, rtol: float, atol: float = 0.0) -> None:
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def emulated_matmul(w64: np.ndarray, x: np.ndarray, type_: int) -> np.ndarray:
    """What the kernel computes: dequantized weights times activations round-tripped through vec_dot_type."""
    vdt = ggml.lib.ggml_vec_dot_type(type_)
    if vdt == ggml.F32:
        xq = x.astype(np.float64)
    else:
        xq = ggml.dequantize(vdt, ggml.quantize(vdt, x), x.size).reshape(x.shape).astype(np.float64)
    return xq @ w64.T


# ---------------------------------------------------------------------------------------------------
# mul_mat
# ---------------------------------------------------------------------------------------------------

@st.composite
def matmul_case(draw):
    type_ = draw(st.sampled_from(ggml.WEIGHT_TYPES))
    return type_, rows_for(type_, draw), draw(st.integers(1, 37)), draw(st.integers(1, 5)), draw(st.integers(1, 3))


@SETTINGS
@given(case=matmul_case(), seed=st.integers(0, 2**31))
def test_mul_mat_matches_reference(case, seed):
    type_, k, n, m, n_threads = case
    rng = rng_for(seed)
    ctx = ggml.Context(32 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n, k)), type_)
    x = rng.standard_normal((m, k)).astype(np.float32)
    (y,) = compute(ctx, [ctx.mul_mat(wt, tensor(ctx, x))], n_threads)
    assert y.shape == (m, n)
    # tight: the exact arithmetic the kernel does, up to float32 summation
    bound = np.abs(emulated_matmul(np.abs(w64), np.abs(x), type_))
    assert np.all(np.abs(y - emulated_matmul(w64, x, type_)) <= EMU_TOL.get(type_, 2e-5) * bound + 1e-6)
    # loose: against float64 activations, the cost of converting them, relative to the sums' size without
    # cancellation (the root of the summed squared terms: |want| on average; one short dot can cancel to ~0)
    want = ref.mul_mat(w64, x)
    size = np.sqrt(np.square(x.astype(np.float64)) @ np.square(w64).T)
    assert np.linalg.norm(y - want) <= ACT_TOL[type_] * np.linalg.norm(size) + 1e-6


# precise mul_mat: float32 summation of two dots, about float32's own error for the 8-bit activation types
PRECISE_TOL = {ggml.F16: 1e-4, ggml.BF16: 1e-4}  # else 5e-5: two 8-bit roundings, (1/254)^2 of a block's largest


@SETTINGS
@given(case=matmul_case(), seed=st.integers(0, 2**31), scale=st.sampled_from([0.1, 1.0, 1e3]))
def test_mul_mat_precise_matches_float64(case, seed, scale):
    """ggml_mul_mat_precise against float64 on the same dequantized weights, at 5e-5 of the magnitudes,
    whatever the activation type (ACT_TOL: the plain op, 0.02). Blocks whose values are all below ~0.01
    are outside this: the residual's f16 block scale is then subnormal."""
    type_, k, n, m, n_threads = case
    rng = rng_for(seed)
    ctx = ggml.Context(32 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n, k)), type_)
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    xt = tensor(ctx, x)
    (y,) = compute(ctx, [ctx.mul_mat(wt, xt, precise=True)], n_threads)
    bound = np.abs(w64) @ np.abs(x.astype(np.float64)).T  # (n, m): the size of the sum's terms
    err = np.abs(y - ref.mul_mat(w64, x))
    assert np.all(err <= PRECISE_TOL.get(type_, 5e-5) * bound.T + 1e-30), (err / bound.T).max()


@pytest.mark.parametrize("m", [4, 7, 13])
@pytest.mark.parametrize("type_", QUANT_TYPES)
def test_precise_mul_mat_of_a_batch_matches_scalar_and_float64(type_, m):
    """Batches of 4+ columns go through the GEMM tiles (16-bit activations where the type has them, the last tile
    overlapping the one before where 4 does not divide m); 10 rows leave two to the row dots. The SIMD result
    equals the scalar one to 1e-5 of the terms (a type with only an 8-bit tile, Q6_K, takes the residual form,
    whose rounding differs at that level; a broken tile misses by ~1/255) and float64 on x itself to 5e-5."""
    rng = rng_for(m * 100 + type_)
    k = 2 * max(ggml.block_size(type_), 64)
    ctx = ggml.Context(32 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((10, k)), type_)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = ctx.mul_mat(wt, tensor(ctx, x), precise=True)
    try:
        ggml.lib.ggml_cpu_set_simd(False)
        (scalar,) = compute(ctx, [y], 2)
    finally:
        ggml.lib.ggml_cpu_set_simd(True)
    (simd,) = compute(ctx, [y], 2)
    bound = np.abs(x.astype(np.float64)) @ np.abs(w64).T  # (m, n): the size of the sums' terms
    assert np.all(np.abs(simd - scalar) <= 1e-5 * bound)
    assert np.all(np.abs(simd - ref.mul_mat(w64, x)) <= 5e-5 * bound)


@pytest.mark.parametrize("type_", ggml.WEIGHT_TYPES)
@SETTINGS
@given(n=st.integers(1, 23), blocks=st.integers(1, 11), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31))
def test_gemv_rows_equal_their_vec_dot(type_, n, blocks, threads, seed):
    """A decoded token's GEMV (4 rows at a time where the type has a 4-row dot: Q4_0 and Q5_0 on VNNI hosts) gives
    each row what that row's vec_dot gives, bit for bit, whatever the number of rows, of blocks (1-3 left past the
    4-row dots' groups of 4) and of threads (which move where each thread's rows start)."""
    rng = rng_for(seed)
    k = blocks * ggml.block_size(type_)
    ctx = ggml.Context(8 << 20)
    wt, _ = weights(ctx, rng.standard_normal((n, k)), type_)
    x = rng.standard_normal((1, k)).astype(np.float32)
    (y,) = compute(ctx, [ctx.mul_mat(wt, tensor(ctx, x))], threads)
    vdt = ggml.lib.ggml_vec_dot_type(type_)
    xq = x if vdt == ggml.F32 else ggml.quantize(vdt, x)
    rows = wt.raw().reshape(n, -1)
    for r in range(n):
        s = ggml.ffi.new("float *")
        assert ggml.lib.ggml_vec_dot(type_, k, s, ggml.ffi.from_buffer(np.ascontiguousarray(rows[r])),
                                     ggml.ffi.from_buffer(np.ascontiguousarray(xq))) == 0
        assert np.float32(s[0]).tobytes() == np.float32(y[0, r]).tobytes(), r


@pytest.mark.parametrize("type_", ggml.WEIGHT_TYPES)
def test_mul_mat_simd_matches_scalar(type_):
    rng = rng_for(type_)
    k = 512
    ctx = ggml.Context(32 << 20)
    wt, _ = weights(ctx, rng.standard_normal((45, k)), type_)
    x = tensor(ctx, rng.standard_normal((3, k)).astype(np.float32))
    y = ctx.mul_mat(wt, x)
    try:
        ggml.lib.ggml_cpu_set_simd(False)
        (scalar,) = compute(ctx, [y], 2)
    finally:
        ggml.lib.ggml_cpu_set_simd(True)
    (simd,) = compute(ctx, [y], 3)
    assert_close(simd, scalar, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_", [*QUANT_TYPES, ggml.F16, ggml.BF16])
@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 40), m=st.integers(2, 11), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31))
def test_mul_mat_tiles_match_scalar(type_, n, m, threads, seed):
    """Several columns: 4 x 4 GEMM tiles plus their ragged row/column edges against the scalar vec_dot_ref
    (F16 and BF16 rows of 111 values: six 16-value steps of their tile and a tail)."""
    rng = rng_for(seed)
    block = ggml.block_size(type_)
    k = 111 if block == 1 else 2 * block if block == 256 else 6 * block
    ctx = ggml.Context(32 << 20)
    wt, _ = weights(ctx, rng.standard_normal((n, k)), type_)
    y = ctx.mul_mat(wt, tensor(ctx, (rng.standard_normal((m, k)) * 3).astype(np.float32)))
    try:
        ggml.lib.ggml_cpu_set_simd(False)
        (scalar,) = compute(ctx, [y], threads)
    finally:
        ggml.lib.ggml_cpu_set_simd(True)
    (simd,) = compute(ctx, [y], threads)
    # same quantized activations (the SIMD quantizer is exact), so only the summation order differs
    assert_close(simd, scalar, rtol=1e-4, atol=1e-4 * np.abs(scalar).max())


@pytest.mark.parametrize("type_", [ggml.Q8_0, ggml.Q4_K])
def test_mul_mat_large_activations(type_):
    # 1e6: near the largest Q8_0 can hold (its f16 scale overflows past 65504 * 127)
    rng = rng_for(1)
    ctx = ggml.Context(8 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((8, 256)), type_)
    x = (rng.standard_normal((2, 256)) * 1e6).astype(np.float32)
    (y,) = compute(ctx, [ctx.mul_mat(wt, tensor(ctx, x))], 2)
    want = ref.mul_mat(w64, x)
    assert np.linalg.norm(y - want) <= 0.02 * np.linalg.norm(want)


# ---------------------------------------------------------------------------------------------------
# get_rows, cpy
# ---------------------------------------------------------------------------------------------------

@SETTINGS
@given(type_=st.sampled_from(ggml.WEIGHT_TYPES), data=st.data(), seed=st.integers(0, 2**31))
def test_get_rows_every_type(type_, data, seed):
    rng = rng_for(seed)
    k, n = rows_for(type_, data.draw), data.draw(st.integers(1, 20))
    ids = np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12)), np.int32)
    ctx = ggml.Context(16 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n, k)) * 3, type_)
    (y,) = compute(ctx, [ctx.get_rows(wt, tensor(ctx, ids))], data.draw(st.integers(1, 3)))
    np.testing.assert_array_equal(y, ref.get_rows(w64, ids).astype(np.float32))


@pytest.mark.parametrize("bad", [-1, 7, 1 << 30])
def test_get_rows_rejects_bad_id(bad):
    ctx = ggml.Context(1 << 20)
    w = tensor(ctx, np.ones((7, 4), np.float32))
    y = ctx.get_rows(w, tensor(ctx, np.array([0, bad, 2], np.int32)))
    with pytest.raises(InvalidArgumentError, match="id"):
        compute(ctx, [y], 3)


@pytest.mark.parametrize("type_", [ggml.F16, ggml.BF16, *QUANT_TYPES])
def test_cpy_quantizes_like_quantize(type_):
    rng = rng_for(type_)
    x = (rng.standard_normal((5, 512)) * 10).astype(np.float32)
    ctx = ggml.Context(8 << 20)
    y = ctx.cpy(tensor(ctx, x), type_)
    g = ggml.Graph(ctx, [y]).plan()
    y.raw()[...] = 0xFF
    g.compute(pool(3))
    np.testing.assert_array_equal(y.raw(), ggml.quantize(type_, x).reshape(-1))


@pytest.mark.parametrize("type_", [ggml.F16, ggml.BF16, *QUANT_TYPES])
def test_cpy_dequantizes_to_f32(type_):
    rng = rng_for(type_)
    ctx = ggml.Context(8 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((3, 256)), type_)
    (y,) = compute(ctx, [ctx.cpy(wt, ggml.F32)], 2)
    np.testing.assert_array_equal(y, w64.astype(np.float32))


def swapped_view(ctx: ggml.Context, t: ggml.Tensor, a: np.ndarray) -> ggml.Tensor:
    """A view of t (holding a (p, q, r)) that is a.transpose(1, 0, 2): outer strides only, rows stay whole."""
    return ctx.view(t, (a.shape[1], a.shape[0], a.shape[2]), (a.strides[1], a.strides[0], a.strides[2]))


@SETTINGS
@given(shape=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 40)), seed=st.integers(0, 2**31),
       threads=st.integers(1, 3))
def test_cpy_of_strided_view(shape, seed, threads):
    rng = rng_for(seed)
    a = (rng.standard_normal(shape) * 100).astype(np.float32)
    ctx = ggml.Context(8 << 20)
    tv = swapped_view(ctx, tensor(ctx, a), a)
    y32, y16 = compute(ctx, [ctx.cpy(tv, ggml.F32), ctx.cpy(tv, ggml.F16)], threads, ndim=3)
    np.testing.assert_array_equal(y32, a.transpose(1, 0, 2))
    np.testing.assert_array_equal(y16, a.transpose(1, 0, 2).astype(np.float16))


def test_cpy_same_type_i32_exact():
    ids = np.arange(-5, 40, dtype=np.int32).reshape(5, 9) * 977
    ctx = ggml.Context(1 << 20)
    (y,) = compute(ctx, [ctx.cpy(tensor(ctx, ids), ggml.I32)], 2)
    np.testing.assert_array_equal(y, ids)


# ---------------------------------------------------------------------------------------------------
# elementwise
# ---------------------------------------------------------------------------------------------------

EXTREMES = np.array([0.0, -0.0, 1e-38, -1e-38, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e10, -1e10,
                     1e30, -1e30], np.float32)


@st.composite
def float_arrays(draw, shape):
    values = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=1))
    rng = rng_for(draw(st.integers(0, 2**31)))
    a = rng.standard_normal(shape).astype(np.float32) * np.float32(abs(values[0]) + 1)
    flat = a.reshape(-1)
    k = draw(st.integers(0, min(len(EXTREMES), flat.size)))
    flat[:k] = EXTREMES[:k]
    return a


@SETTINGS
@given(data=st.data(), shape=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 70)),
       broadcast=st.sampled_from(["none", "row", "per_row"]), op=st.sampled_from(["add", "mul"]),
       threads=st.integers(1, 3))
def test_binary_ops(data, shape, broadcast, op, threads):
    """Same shapes, one row for all, or one value for each row."""
    a = data.draw(float_arrays(shape))
    b = data.draw(float_arrays({"none": shape, "row": (1, 1, shape[2]), "per_row": (*shape[:2], 1)}[broadcast]))
    ctx = ggml.Context(8 << 20)
    (y,) = compute(ctx, [getattr(ctx, op)(tensor(ctx, a), tensor(ctx, b))], threads, ndim=3)
    with np.errstate(over="ignore", invalid="ignore"):
        want = getattr(ref, op)(a, b).astype(np.float32)
    np.testing.assert_array_equal(y, want)  # one float32 operation each: exact


@SETTINGS
@given(data=st.data(), shape=st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 30)),
       threads=st.integers(1, 3))
def test_binary_ops_on_views(data, shape, threads):
    # src0 a strided view; the broadcast row a row inside another matrix (a view at an offset)
    a = data.draw(float_arrays(shape))
    rows = data.draw(float_arrays((3, shape[2])))
    ctx = ggml.Context(8 << 20)
    av = swapped_view(ctx, tensor(ctx, a), a)
    row = ctx.view(tensor(ctx, rows), (1, shape[2]), None, offset=rows.strides[0] * 2)
    y_add, y_mul = compute(ctx, [ctx.add(av, av), ctx.mul(av, row)], threads, ndim=3)
    at = a.transpose(1, 0, 2)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(y_add, at + at)
        np.testing.assert_array_equal(y_mul, at * rows[2])


@SETTINGS
@given(data=st.data(), shape=st.tuples(st.integers(1, 5), st.integers(1, 90)),
       op=st.sampled_from(["silu", "gelu", "gelu_erf", "relu", "tanh", "abs", "sigmoid", "softplus", "step", "scale"]),
       s=st.floats(-1e3, 1e3, width=32), threads=st.integers(1, 3))
def test_unary_ops(data, shape, op, s, threads):
    a = data.draw(float_arrays(shape))
    ctx = ggml.Context(8 << 20)
    at = tensor(ctx, a)
    node = ctx.scale(at, s) if op == "scale" else getattr(ctx, op)(at)
    (y,) = compute(ctx, [node], threads)
    with np.errstate(over="ignore"):
        want = ref.scale(a, s) if op == "scale" else getattr(ref, op)(a)
    # silu and gelu cancel (1 + tanh) or divide near 0: their error is relative to x, not to the result
    want = want.astype(np.float32).astype(np.float64)
    assert np.all(np.abs(y - want) <= 2e-6 * np.abs(want) + 5e-7 * np.abs(a) + 1e-37)


def test_unary_op_on_view():
    a = np.arange(120, dtype=np.float32).reshape(3, 4, 10) - 60
    ctx = ggml.Context(1 << 20)
    (y,) = compute(ctx, [ctx.relu(swapped_view(ctx, tensor(ctx, a), a))], 3, ndim=3)
    np.testing.assert_array_equal(y, np.maximum(a.transpose(1, 0, 2), 0))


# ---------------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------------

@SETTINGS
@given(shape=st.tuples(st.integers(1, 7), st.integers(1, 300)), magnitude=st.sampled_from([1e-20, 1.0, 1e5, 1e25]),
       eps=st.sampled_from([0.0, 1e-6, 1e-5]), op=st.sampled_from(["rms_norm", "layer_norm"]),
       threads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_norms(shape, magnitude, eps, op, threads, seed):
    rng = rng_for(seed)
    a = (rng.standard_normal(shape) * magnitude + magnitude * 0.5).astype(np.float32)
    ctx = ggml.Context(8 << 20)
    (y,) = compute(ctx, [getattr(ctx, op)(tensor(ctx, a), eps)], threads)
    want = getattr(ref, op)(a, eps)
    assert_close(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=0))


@SETTINGS
@given(rows=st.integers(1, 5), cols=st.integers(1, 70), gap=st.integers(1, 9),
       op=st.sampled_from(["rms_norm", "layer_norm"]), threads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_norms_of_rows_apart(rows, cols, gap, op, threads, seed):
    """Rows spaced wider than they are (q's heads in a fused projection's rows) are normed where they lie."""
    rng = rng_for(seed)
    a = rng.standard_normal((rows, cols + gap)).astype(np.float32)
    ctx = ggml.Context(8 << 20)
    view = ctx.view(tensor(ctx, a), (rows, cols), (4 * (cols + gap), 4), offset=4 * gap)
    (y,) = compute(ctx, [getattr(ctx, op)(view, 1e-5)], threads)
    want = getattr(ref, op)(a[:, gap:], 1e-5)
    assert_close(y.reshape(want.shape), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=0))


# ---------------------------------------------------------------------------------------------------
# rope, soft_max
# ---------------------------------------------------------------------------------------------------

# YaRN's arguments of the rope op, or none: trained contexts that put the ramp anywhere in the pairs
YARN = st.one_of(st.just({}), st.fixed_dictionaries({
    "n_ctx_orig": st.sampled_from([16, 1024, 4096, 131072]), "ext_factor": st.sampled_from([1.0, 0.5]),
    "attn_factor": st.sampled_from([1.0, 0.7]), "beta_fast": st.sampled_from([32.0, 4.0]),
    "beta_slow": st.sampled_from([1.0, 0.25])}))


@SETTINGS
@given(n_tokens=st.integers(1, 5), n_head=st.integers(1, 4), half_hd=st.integers(1, 40), data=st.data(),
       mode=st.sampled_from([ggml.ROPE_NORMAL, ggml.ROPE_NEOX]), base=st.sampled_from([10000.0, 1e6, 500.0]),
       fscale=st.sampled_from([1.0, 0.25]), threads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_rope(n_tokens, n_head, half_hd, data, mode, base, fscale, threads, seed):
    rng = rng_for(seed)
    hd = 2 * half_hd + data.draw(st.integers(0, 1))
    n_dims = 2 * data.draw(st.integers(1, half_hd))
    x = rng.standard_normal((n_tokens, n_head, hd)).astype(np.float32)
    pos = rng.integers(0, 40000, n_tokens).astype(np.int32)
    # Llama 3's per-frequency factors (1 to 8), or none
    factors = rng.uniform(1.0, 8.0, n_dims // 2).astype(np.float32) if data.draw(st.booleans()) else None
    yarn = data.draw(YARN)
    ctx = ggml.Context(8 << 20)
    node = ctx.rope(tensor(ctx, x), tensor(ctx, pos), n_dims, mode, base, fscale,
                    tensor(ctx, factors) if factors is not None else None, **yarn)
    (y,) = compute(ctx, [node], threads, ndim=3)
    assert_close(y, ref.rope(x, pos, n_dims, mode, base, fscale, factors, **yarn), rtol=0, atol=1e-5)


@SETTINGS
@given(n_rows=st.integers(1, 9), n_cols=st.integers(1, 80), use_pos=st.booleans(),
       scale=st.sampled_from([1.0, 0.125, 30.0]), spread=st.sampled_from([1.0, 100.0, 1e4]),
       threads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_soft_max(n_rows, n_cols, use_pos, scale, spread, threads, seed):
    rng = rng_for(seed)
    a = (rng.standard_normal((n_rows, n_cols)) * spread).astype(np.float32)
    pos = rng.integers(0, n_cols + 3, n_rows).astype(np.int32) if use_pos else None
    ctx = ggml.Context(8 << 20)
    node = ctx.soft_max(tensor(ctx, a), tensor(ctx, pos) if use_pos else None, scale)
    (y,) = compute(ctx, [node], threads)
    assert_close(y, ref.soft_max(a, pos, scale), rtol=1e-5, atol=1e-7)


def test_soft_max_rejects_negative_position():
    ctx = ggml.Context(1 << 20)
    node = ctx.soft_max(tensor(ctx, np.ones((3, 4), np.float32)),
                        tensor(ctx, np.array([0, -1, 2], np.int32)))
    with pytest.raises(InvalidArgumentError, match="position"):
        compute(ctx, [node], 3)


# ---------------------------------------------------------------------------------------------------
# kv_store + attention
# ---------------------------------------------------------------------------------------------------

@SETTINGS
@given(cache_type=st.sampled_from([ggml.F32, ggml.F16]), n_kv=st.integers(1, 3),
       group=st.one_of(st.integers(1, 3), st.integers(4, 20)), hd=st.integers(1, 40), n_ctx=st.integers(1, 40),
       data=st.data(), threads=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_kv_store_and_attention(cache_type, n_kv, group, hd, n_ctx, data, threads, seed):
    """A work unit takes up to 16 rows (a KV head's query heads times tokens): groups of up to 20 heads split over
    units, fewer heads a unit where threads would idle; head sizes of 8s take the AVX2 kernels, the others scalar."""
    window = data.draw(st.integers(0, n_ctx))  # 0: every earlier slot, else a sliding window
    with_sinks = data.draw(st.booleans())  # gpt-oss' attention sinks
    rng = rng_for(seed)
    n_head = n_kv * group
    n_tokens = data.draw(st.integers(1, n_ctx))
    p0 = data.draw(st.integers(0, n_ctx - n_tokens))
    pos = np.arange(p0, p0 + n_tokens, dtype=np.int32)
    np_type = np.float16 if cache_type == ggml.F16 else np.float32
    k0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np_type)  # earlier tokens
    v0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np_type)
    k_new = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    v_new = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    q = (rng.standard_normal((n_tokens, n_head, hd)) * 2).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ctx = ggml.Context(16 << 20)
    kc, vc = tensor(ctx, k0, cache_type), tensor(ctx, v0, cache_type)
    post = tensor(ctx, pos)
    ks = ctx.kv_store(kc, tensor(ctx, k_new), post)
    vs = ctx.kv_store(vc, tensor(ctx, v_new), post)
    sinks = (rng.standard_normal(n_head) * 3).astype(np.float32) if with_sinks else None
    (y,) = compute(ctx, [ctx.attention(tensor(ctx, q), ks, vs, post, scale, window,
                                       tensor(ctx, sinks) if with_sinks else None)], threads)
    k_want = ref.kv_store(k0, k_new.astype(np_type), pos)
    v_want = ref.kv_store(v0, v_new.astype(np_type), pos)
    np.testing.assert_array_equal(kc.numpy().reshape(k0.shape), k_want.astype(np_type))  # in place, rounded as numpy
    np.testing.assert_array_equal(vc.numpy().reshape(v0.shape), v_want.astype(np_type))
    assert_close(y, ref.attention(q, k_want, v_want, pos, scale, window, sinks), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("n_kv, group", [(1, 1), (1, 4), (3, 3)])
@pytest.mark.parametrize("window, with_sinks", [(0, False), (700, True)])
def test_decode_attention_deep_in_the_cache_splits_the_slots(threads, n_kv, group, window, with_sinks):
    """A decoded token's few units (a KV head each) on more threads than they divide: each unit's slots split into
    segments of 256 or more, merged after a barrier (its max, exp-sum and output per segment); one and two tokens,
    F16 cache, against float64."""
    rng = rng_for(threads * 100 + n_kv * 10 + group + window)
    n_ctx, hd, n_head = 1300, 64, n_kv * group
    for n_tokens in (1, 2):
        pos = np.arange(1250, 1250 + n_tokens, dtype=np.int32)
        k0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)  # earlier tokens
        v0 = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float16)
        k_new = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
        v_new = rng.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
        q = (rng.standard_normal((n_tokens, n_head, hd)) * 2).astype(np.float32)
        sinks = (rng.standard_normal(n_head) * 3).astype(np.float32) if with_sinks else None
        ctx = ggml.Context(32 << 20)
        post = tensor(ctx, pos)
        ks = ctx.kv_store(tensor(ctx, k0, ggml.F16), tensor(ctx, k_new), post)
        vs = ctx.kv_store(tensor(ctx, v0, ggml.F16), tensor(ctx, v_new), post)
        node = ctx.attention(tensor(ctx, q), ks, vs, post, 0.125, window, tensor(ctx, sinks) if with_sinks else None)
        (y,) = compute(ctx, [node], threads)
        k, v = ref.kv_store(k0, k_new.astype(np.float16), pos), ref.kv_store(v0, v_new.astype(np.float16), pos)
        assert_close(y, ref.attention(q, k, v, pos, 0.125, window, sinks), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 8])
def test_attention_rejects_position_outside_cache(bad):
    ctx = ggml.Context(1 << 20)
    cache = ctx.new_tensor(ggml.F32, (8, 1, 4))
    pos = tensor(ctx, np.array([3, bad], np.int32))
    ks = ctx.kv_store(cache, tensor(ctx, np.ones((2, 1, 4), np.float32)), pos)
    out = ctx.attention(tensor(ctx, np.ones((2, 2, 4), np.float32)), ks, ks, pos, 0.5)
    with pytest.raises(InvalidArgumentError, match="position"):
        compute(ctx, [out], 3)
