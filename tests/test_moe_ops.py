"""The mixture-of-experts ops (top_k, moe_ffn) on the CPU and the GPU against float64 numpy.

Every weight type, hypothesis-drawn shapes and routings (ties, every token to one expert, experts no token
picks, a share of the experts held by the op through slots), 1..3 threads, outputs poisoned first. The GPU
cases skip without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_harness import compute, pool, tensor, weights

from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml
from pyinfer.native.binding import check, ffi, lib

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
needs_gpu = pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")


def compute_on_gpu(ctx: ggml.Context, outputs: list[ggml.Tensor]) -> list[np.ndarray]:
    """The graph of outputs with every leaf on the GPU, outputs poisoned (NaN) there first."""
    g = ggml.Graph(ctx, outputs, backend="cuda").plan()
    for t in outputs:
        poison = np.full(t.nbytes // 4, np.nan, np.float32).view(np.uint8 if t.type == ggml.F32 else np.int32)
        check(lib.ggml_tensor_write(t.ptr, ffi.from_buffer(poison), 0, t.nbytes))
    g.compute(pool(2))
    results = []
    for t in outputs:
        raw = np.empty(t.nbytes, np.uint8)
        check(lib.ggml_tensor_read(t.ptr, ffi.from_buffer(raw), 0, t.nbytes))
        results.append(raw.view(np.float32 if t.type == ggml.F32 else np.int32).reshape(tuple(reversed(t.ne))[2:]))
    return results


def top_k_reference(a: np.ndarray, k: int) -> np.ndarray:
    """(m, n) -> (m, k): largest first, ties to the lower index (a stable sort of -a)."""
    return np.argsort(-a, axis=1, kind="stable")[:, :k].astype(np.int32)


def as_kernel_sees(x: np.ndarray, weight_type: int) -> np.ndarray:
    """x (float32) round-tripped through weight_type's vec_dot_type, in float64."""
    vdt = ggml.lib.ggml_vec_dot_type(weight_type)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if vdt == ggml.F32:
        return x.astype(np.float64)
    return ggml.dequantize(vdt, ggml.quantize(vdt, x), x.size).reshape(x.shape).astype(np.float64)


def act64(kind: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    if kind == "swiglu":
        return g / (1.0 + np.exp(-g)) * u
    if kind == "swiglu_oai":  # gpt-oss (transformers' GptOssExperts._apply_gate)
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)
    return 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u


def moe_reference(x, ids, logits, slots, gate, up, down, kind, norm, gate_type, down_type, biases=None, scales=None):
    """(m, d) float64: each token's experts held here (slots[e] >= 0), weighted by the logits' softmax (times the
    expert's scale); biases (n_expert, 2 n_ff + d) and scales (n_expert,) by expert."""
    n_ff = gate.shape[1]
    m, k = ids.shape
    y = np.zeros((m, x.shape[1]))
    bound = np.zeros_like(y)  # sum of |weight| |down| |act|: the scale of the rounding error
    xs = as_kernel_sees(x, gate_type)
    for j in range(m):
        chosen = logits[j, ids[j]].astype(np.float64)
        pool = chosen if norm else logits[j].astype(np.float64)
        top = pool.max()
        z = np.exp(pool - top).sum()
        for s in range(k):
            e = slots[ids[j, s]] if slots is not None else ids[j, s]
            if e < 0:
                continue
            w = np.exp(chosen[s] - top) / z * (scales[ids[j, s]] if scales is not None else 1.0)
            b = biases[ids[j, s]] if biases is not None else np.zeros(2 * n_ff + x.shape[1])
            a = act64(kind, gate[e] @ xs[j] + b[:n_ff], up[e] @ xs[j] + b[n_ff:2 * n_ff])
            a_seen = as_kernel_sees(a.astype(np.float32)[None], down_type)[0]
            y[j] += w * (down[e] @ a_seen + b[2 * n_ff:])
            bound[j] += abs(w) * (np.abs(down[e]) @ np.abs(a) + np.abs(b[2 * n_ff:]))
    return y, bound


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@given(n=st.integers(1, 40), m=st.integers(1, 9), n_threads=st.integers(1, 3), seed=st.integers(0, 2**31))
@SETTINGS
def test_top_k_matches_a_stable_sort(backend, n, m, n_threads, seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, n + 1))
    a = rng.normal(size=(m, n)).astype(np.float32)
    a[rng.random((m, n)) < 0.3] = 0.5  # ties
    if m > 1:
        a[0] = 1.0  # a row of equal values
    ctx = ggml.Context(1 << 20)
    out = ctx.top_k(tensor(ctx, a), k)
    (got,) = compute(ctx, [out], n_threads) if backend == "cpu" else compute_on_gpu(ctx, [out])
    np.testing.assert_array_equal(got.reshape(m, k), top_k_reference(a, k))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("n", [512, 700])  # the GPU's warp per row up to 512 values, its thread per row past
def test_top_k_of_long_rows(backend, n):
    rng = np.random.default_rng(n)
    a = rng.normal(size=(5, n)).astype(np.float32)
    a[:, ::7] = 2.5  # ties among the largest
    a[1, 3] = np.nan
    ctx = ggml.Context(1 << 20)
    out = ctx.top_k(tensor(ctx, a), 20)
    (got,) = compute(ctx, [out], 2) if backend == "cpu" else compute_on_gpu(ctx, [out])
    np.testing.assert_array_equal(got.reshape(5, 20), top_k_reference(np.nan_to_num(a, nan=-np.inf), 20))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_top_k_of_signed_zeros_infinities_and_nans(backend):
    """-0 ties +0 (the lower index first), a NaN ranks as -inf (ties with it likewise), infinities at the ends; k = n
    takes every value (the GPU's warp kernel compares order-preserving bit patterns, where -0 sorts below +0)."""
    a = np.array([[-0.0, 0.0, np.nan, -np.inf, np.inf, 0.0, -0.0, -1.0, np.nan, -np.inf, 3.0, -0.0],
                  [np.nan, -np.inf, -0.0, np.nan, 0.0, -np.inf, np.inf, np.inf, 1e-38, -1e-38, 0.0, -0.0]], np.float32)
    ctx = ggml.Context(1 << 20)
    out = ctx.top_k(tensor(ctx, a), a.shape[1])
    (got,) = compute(ctx, [out], 2) if backend == "cpu" else compute_on_gpu(ctx, [out])
    np.testing.assert_array_equal(got.reshape(a.shape), top_k_reference(np.where(np.isnan(a), -np.inf, a), a.shape[1]))


def test_top_k_rejects_k_outside_the_row():
    ctx = ggml.Context(1 << 20)
    a = tensor(ctx, np.zeros((2, 4), np.float32))
    for k in (0, 5):
        with pytest.raises(InvalidArgumentError, match="top_k"):
            ctx.top_k(a, k)
    with pytest.raises(InvalidArgumentError, match="outside \\[1, 64\\]"):  # GGML_TOP_K_MAX, whatever the row
        ctx.top_k(tensor(ctx, np.zeros((2, 100), np.float32)), 65)


@st.composite
def moe_case(draw, types=ggml.WEIGHT_TYPES, max_blocks=2):
    gate_type = draw(st.sampled_from(types))
    down_type = draw(st.sampled_from(types))
    blk = max(ggml.block_size(gate_type), ggml.block_size(down_type))
    d = blk * draw(st.integers(1, max_blocks)) if blk > 1 else draw(st.integers(1, 40))
    n_ff = blk * draw(st.integers(1, max_blocks)) if blk > 1 else draw(st.integers(1, 40))
    n_expert = draw(st.integers(1, 9))
    k = draw(st.integers(1, n_expert))
    m = draw(st.sampled_from([1, 1, 2, 5, 17, 40]))  # past 8 tokens the GPU's grouped GEMMs, past 32 two tiles
    routing = draw(st.sampled_from(["random", "one expert", "ties"]))
    held = draw(st.sampled_from(["all", "some", "none"]))
    return gate_type, down_type, d, n_ff, n_expert, k, m, routing, held, draw(st.booleans()), draw(
        st.sampled_from(["swiglu", "geglu", "swiglu_oai"])), draw(st.booleans()), draw(st.booleans()), draw(
        st.integers(1, 3)), draw(st.integers(0, 2**31))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@given(case=moe_case())
@SETTINGS
def test_moe_ffn_matches_float64(backend, case):
    gate_type, down_type, d, n_ff, n_expert, k, m, routing, held, norm, kind, biased, scaled, n_threads, seed = case
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(m, n_expert)).astype(np.float32)
    if routing == "ties":
        logits[:, : n_expert // 2 + 1] = 0.25
    ids = top_k_reference(logits, k)
    if routing == "one expert":  # every token to expert 0 first (the rest of its k as chosen)
        logits[:, 0] = logits.max() + 1.0
        ids = top_k_reference(logits, k)
    slots = None
    n_local = n_expert
    if held != "all":
        mine = rng.random(n_expert) < 0.5 if held == "some" else np.zeros(n_expert, bool)
        slots = np.full(n_expert, -1, np.int32)
        slots[mine] = np.arange(mine.sum())
        n_local = max(int(mine.sum()), 1)  # no expert held: one matrix nobody routes to
    x = rng.normal(size=(m, d)).astype(np.float32)
    ctx = ggml.Context(16 << 20)
    gate_t, gate64 = weights(ctx, rng.normal(size=(n_local, n_ff, d)) / np.sqrt(d), gate_type)
    up_t, up64 = weights(ctx, rng.normal(size=(n_local, n_ff, d)) / np.sqrt(d), gate_type)
    down_t, down64 = weights(ctx, rng.normal(size=(n_local, d, n_ff)) / np.sqrt(n_ff), down_type)
    if gate_t.ne[2] != n_local:  # ggml drops an outer axis of 1
        gate_t, up_t, down_t = (ctx.reshape(t, (n_local, *reversed(t.ne[:2]))) for t in (gate_t, up_t, down_t))
    # gpt-oss' experts carry biases (by expert, whichever matrix holds it); its gate values run past the clamp
    biases = rng.normal(size=(n_expert, 2 * n_ff + d)).astype(np.float32) * 2.0 if biased else None
    # Gemma 4's per-expert scales (by expert), of either sign
    scales = rng.normal(size=n_expert).astype(np.float32) if scaled else None
    out = ctx.moe_ffn(gate_t, up_t, down_t, tensor(ctx, x), ctx.tensor_from_numpy(ids), tensor(ctx, logits),
                      ctx.tensor_from_numpy(slots) if slots is not None else None, kind, norm,
                      tensor(ctx, biases) if biased else None, tensor(ctx, scales) if scaled else None)
    (got,) = compute(ctx, [out], n_threads) if backend == "cpu" else compute_on_gpu(ctx, [out])
    want, bound = moe_reference(x, ids, logits, slots, gate64, up64, down64, kind, norm, gate_type, down_type,
                                biases, scales)
    # the GPU quantizes activations for every quantized type to Q8_1 and keeps x in F32 for float weights (the CPU
    # converts both to the type's vec_dot_type, which the reference follows)
    tols = {ggml.F32: 1e-5, ggml.F16: 2e-3, ggml.BF16: 1e-2}
    tol = max(tols.get(t, 1e-2 if backend == "cpu" else 3e-2) for t in (gate_type, down_type))
    if backend == "cuda" and m > 8:  # the grouped GEMMs take their inputs (x, act) in F16
        tol = max(tol, 4e-3)
    np.testing.assert_allclose(got.reshape(m, d), want, rtol=0, atol=1e-5 + tol * bound.max())


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@given(case=moe_case(types=[ggml.MXFP4], max_blocks=9))
@SETTINGS
def test_moe_ffn_of_mxfp4_experts(backend, case):
    """gpt-oss's experts (MXFP4 gate, up and down) every time, not only when the types are drawn; rows of up to 9
    blocks (the CPU's dot takes 4 at a time)."""
    test_moe_ffn_matches_float64.hypothesis.inner_test(backend, case)


@needs_gpu
@pytest.mark.parametrize("gate_type", [ggml.Q4_0, ggml.Q8_0, ggml.F16])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_a_layers_mixture_fuses_on_the_gpu(gate_type, m):
    """The chain a layer's FFN builds (models/moe.py): RMS norm times its weight, the router (precise F32), top_k,
    moe_ffn and the residual's add. On CUDA the norm runs as one kernel that leaves its output quantized for the
    experts across the router and top_k (a decoded token's), and the add is the experts' sum's: two nodes fused;
    against float64 and the CPU's graph."""
    rng = np.random.default_rng(m)
    d, n_ff, n_expert, k = 64, 96, 8, 3
    h = rng.normal(size=(m, d)).astype(np.float32)
    norm_w = (1.0 + 0.1 * rng.normal(size=d)).astype(np.float32)
    router = (3.0 * rng.normal(size=(n_expert, d)) / np.sqrt(d)).astype(np.float32)  # logits far from ties
    mats = [rng.normal(size=(n_expert, n_ff, d)) / np.sqrt(d), rng.normal(size=(n_expert, n_ff, d)) / np.sqrt(d),
            rng.normal(size=(n_expert, d, n_ff)) / np.sqrt(n_ff)]

    def build(ctx):
        hh = tensor(ctx, h)
        xn = ctx.mul(ctx.rms_norm(hh, 1e-6), tensor(ctx, norm_w))
        logits = ctx.mul_mat(tensor(ctx, router), xn, True)
        ids = ctx.top_k(logits, k)
        gate, up, down = (weights(ctx, w, gate_type)[0] for w in mats)
        return ctx.add(hh, ctx.moe_ffn(gate, up, down, xn, ids, logits, None, "swiglu", True))

    ctx = ggml.Context(16 << 20)
    (cpu,) = compute(ctx, [build(ctx)], 2)
    ctx = ggml.Context(16 << 20)
    out = build(ctx)
    g = ggml.Graph(ctx, [out], backend="cuda").plan()
    assert g.n_fused == 2
    g.compute(pool(2))
    raw = np.empty(out.nbytes, np.uint8)
    check(lib.ggml_tensor_read(out.ptr, ffi.from_buffer(raw), 0, out.nbytes))
    got = raw.view(np.float32).reshape(m, d)

    h64 = h.astype(np.float64)
    xn = h64 / np.sqrt((h64**2).mean(axis=1, keepdims=True) + 1e-6) * norm_w
    logits = (xn @ router.T.astype(np.float64)).astype(np.float32)
    gate64, up64, down64 = (weights(ggml.Context(16 << 20), w, gate_type)[1] for w in mats)
    want, bound = moe_reference(xn.astype(np.float32), top_k_reference(logits, k), logits, None, gate64, up64, down64,
                                "swiglu", True, gate_type, gate_type)
    for y, tol in ((cpu.reshape(m, d), 1e-2), (got, 3e-2)):
        np.testing.assert_allclose(y, h64 + want, rtol=0, atol=1e-5 + tol * bound.max())


LEVELS_TYPES = (ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q8_0, ggml.MXFP4, ggml.Q4_K, ggml.Q6_K)  # test_levels_gemm's


@pytest.mark.parametrize("mode", ["REF", pytest.param("AUTO", marks=pytest.mark.skipif(
    not ggml.lib.ggml_cpu_has_amx(), reason="needs a CPU with AMX int8 tiles"))])
@given(case=moe_case(types=LEVELS_TYPES, max_blocks=3), m=st.sampled_from([4, 17, 40]))
@SETTINGS
def test_a_batchs_experts_through_levels_gemms(mode, case, m):
    """A batch's expert with 4 pairs or more runs as int8 tile GEMMs over its rows' levels (levels.h), its pairs' x and
    activations packed in groups of 16: through the oracle kernel (REF, on any host) and the AMX tiles (AUTO), against
    float64 as the tiles' and dots' path is."""
    case = (*case[:6], m, *case[7:])
    try:
        ggml.lib.ggml_cpu_set_levels_gemm(getattr(ggml.lib, "GGML_LEVELS_GEMM_" + mode))
        test_moe_ffn_matches_float64.hypothesis.inner_test("cpu", case)
    finally:
        ggml.lib.ggml_cpu_set_levels_gemm(ggml.lib.GGML_LEVELS_GEMM_AUTO)


@pytest.mark.skipif(not ggml.lib.ggml_cpu_has_amx(), reason="needs a CPU with AMX int8 tiles")
@pytest.mark.parametrize("type_", [ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q8_0, ggml.Q4_K, ggml.Q6_K])
@pytest.mark.parametrize("m", [12, 90])
def test_a_batchs_few_pairs_straight_from_the_blocks_equal_the_tiles(type_, m):
    """An expert with at most 64 pairs skips the panel of levels (levels_direct_for, as a small prompt's mul_mat):
    bit for bit the oracle's sums, with experts on both paths in one batch (90 tokens: a few have more than 64)."""
    rng = np.random.default_rng(m)
    d, n_ff, n_expert, k = 256, 512, 4, 3
    logits = rng.normal(size=(m, n_expert)).astype(np.float32)
    logits[:, 0] += 2.0  # expert 0 in every token's choice: 90 pairs there, fewer for the others
    ctx = ggml.Context(64 << 20)
    x_t, l_t = tensor(ctx, rng.normal(size=(m, d)).astype(np.float32)), tensor(ctx, logits)
    ids_t = ctx.tensor_from_numpy(top_k_reference(logits, k))
    ws = [tensor(ctx, rng.normal(size=shape).astype(np.float32), type_)
          for shape in ((n_expert, n_ff, d), (n_expert, n_ff, d), (n_expert, d, n_ff))]
    y = ctx.moe_ffn(*ws, x_t, ids_t, l_t, None, "swiglu", True)
    outs = []
    for mode in ("AUTO", "REF"):
        try:
            ggml.lib.ggml_cpu_set_levels_gemm(getattr(ggml.lib, "GGML_LEVELS_GEMM_" + mode))
            outs.append(compute(ctx, [y], 2)[0].copy())
        finally:
            ggml.lib.ggml_cpu_set_levels_gemm(ggml.lib.GGML_LEVELS_GEMM_AUTO)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_moe_ffn_halves_add_up_to_the_whole():
    """Two ops holding complementary experts (a CPU and a GPU share) sum to the op that holds all."""
    rng = np.random.default_rng(7)
    d, n_ff, n_expert, k, m = 64, 96, 8, 3, 6
    logits = rng.normal(size=(m, n_expert)).astype(np.float32)
    ids = top_k_reference(logits, k)
    mats = [rng.normal(size=shape) for shape in ((n_expert, n_ff, d), (n_expert, n_ff, d), (n_expert, d, n_ff))]
    first = np.array([0, 2, 5, 7])
    slots_a = np.full(n_expert, -1, np.int32)
    slots_a[first] = np.arange(len(first))
    rest = np.setdiff1d(np.arange(n_expert), first)
    slots_b = np.full(n_expert, -1, np.int32)
    slots_b[rest] = np.arange(len(rest))
    ctx = ggml.Context(16 << 20)
    x_t = tensor(ctx, rng.normal(size=(m, d)).astype(np.float32))
    ids_t, l_t = ctx.tensor_from_numpy(ids), tensor(ctx, logits)

    def op(which, slots):
        ws = [tensor(ctx, w[which].astype(np.float32), ggml.Q8_0) for w in mats]
        slots_t = ctx.tensor_from_numpy(slots) if slots is not None else None
        return ctx.moe_ffn(*ws, x_t, ids_t, l_t, slots_t, "swiglu", True)

    whole, a, b = compute(ctx, [op(np.arange(n_expert), None), op(first, slots_a), op(rest, slots_b)], 2)
    np.testing.assert_allclose(a + b, whole, rtol=1e-5, atol=1e-5)


def test_moe_ffn_rejects_bad_shapes_and_ids():
    ctx = ggml.Context(1 << 20)
    d, n_ff, n_expert = 32, 16, 4
    g = ctx.new_tensor(ggml.F32, (n_expert, n_ff, d))
    down = ctx.new_tensor(ggml.F32, (n_expert, d, n_ff))
    x = ctx.new_tensor(ggml.F32, (2, d))
    logits = ctx.new_tensor(ggml.F32, (2, n_expert))
    ids = ctx.tensor_from_numpy(np.array([[0, 1], [2, 9]], np.int32))
    with pytest.raises(InvalidArgumentError, match="expert tensor"):
        ctx.moe_ffn(g, g, ctx.new_tensor(ggml.F32, (n_expert - 1, d, n_ff)), x, ids, logits, None, "swiglu", True)
    with pytest.raises(InvalidArgumentError, match="need slots"):
        ctx.moe_ffn(g, g, down, x, ids, ctx.new_tensor(ggml.F32, (2, n_expert + 1)), None, "swiglu", True)
    with pytest.raises(InvalidArgumentError, match="kind"):
        ctx.moe_ffn(g, g, down, x, ids, logits, None, "relu", True)
    with pytest.raises(InvalidArgumentError, match="ids must be"):  # ids of more than two dimensions
        ctx.moe_ffn(g, g, down, x, ctx.new_tensor(ggml.I32, (2, 2, 2)), logits, None, "swiglu", True)
    with pytest.raises(InvalidArgumentError, match="scales must be"):  # one scale short
        ctx.moe_ffn(g, g, down, x, ids, logits, None, "swiglu", True, scales=ctx.new_tensor(ggml.F32, (n_expert - 1,)))
    out = ctx.moe_ffn(g, g, down, x, ids, logits, None, "swiglu", True)
    graph = ggml.Graph(ctx, [out]).plan()
    with pytest.raises(InvalidArgumentError, match="expert id 9"):
        graph.compute(ggml.ThreadPool(2))


def test_the_kernel_bench_reads_the_tensor_struct_as_built():
    """tools.bench_cuda_kernels declares struct ggml_tensor to cffi: it had kept GGML_MAX_SRC at 6 when it became 8,
    so every field after src[] was read at the wrong offset."""
    from tools.bench_cuda_kernels import _tensor_struct

    assert f"src[{lib.GGML_MAX_SRC}]" in _tensor_struct()
