"""Neuron-aware sparse kernels (mul_mat_rows, axpy_rows) against reference_ops.

Every weight type, selectors of every kind (none, F32 masks of density 0..1, I32 index lists),
row ranges, 1..3 threads, outputs poisoned with NaN first.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_ops as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_harness import compute, tensor, weights

from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def activations_as_kernel_sees(x: np.ndarray, type_: int) -> np.ndarray:
    """x round-tripped through type_'s vec_dot_type: what mul_mat_rows really multiplies."""
    vdt = ggml.lib.ggml_vec_dot_type(type_)
    if vdt == ggml.F32:
        return x.astype(np.float64)
    return ggml.dequantize(vdt, ggml.quantize(vdt, x), x.size).reshape(x.shape).astype(np.float64)


@st.composite
def selectors(draw, n_rows: int, m: int, rng: np.random.Generator):
    """(numpy selector or None, kind): a mask (m, n_rows) or an index list (m, n_sel)."""
    kind = draw(st.sampled_from(["none", "mask", "mask", "index"]))
    if kind == "none":
        return None, kind
    if kind == "mask":
        density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9, 1.0]))
        mask = np.where(rng.random((m, n_rows)) < density, rng.random((m, n_rows)) + 0.01, -rng.random((m, n_rows)))
        mask[rng.random((m, n_rows)) < 0.05] = 0.0  # 0 is not selected
        return mask.astype(np.float32), kind
    n_sel = draw(st.integers(1, n_rows))
    lists = np.full((m, n_sel), -1, np.int32)
    for j in range(m):
        take = draw(st.integers(0, n_sel))
        lists[j, :take] = rng.permutation(n_rows)[:take]
        if take < n_sel and draw(st.booleans()):
            lists[j, take + 1:] = rng.integers(0, 2 * n_rows, n_sel - take - 1)  # after the terminator: ignored
    return lists, kind


@st.composite
def sparse_case(draw, block_axis_max: int = 3):
    type_ = draw(st.sampled_from(ggml.WEIGHT_TYPES))
    blk = ggml.block_size(type_)
    width = draw(st.integers(1, 200)) if blk == 1 else blk * draw(st.integers(1, block_axis_max if blk < 256 else 2))
    n_rows = draw(st.integers(1, 70))
    m = draw(st.sampled_from([1, 1, 2, 3, 6]))  # axpy_rows splits rows up to 4 columns, d beyond
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    sel, kind = draw(selectors(n_rows, m, rng))
    begin = draw(st.integers(0, n_rows))
    end = draw(st.sampled_from([-1, draw(st.integers(begin, n_rows))]))
    return type_, width, n_rows, m, sel, kind, begin, end, draw(st.integers(1, 3)), rng


def selector_tensor(ctx: ggml.Context, sel):
    return None if sel is None else tensor(ctx, sel)


@SETTINGS
@given(case=sparse_case())
def test_mul_mat_rows(case):
    type_, k, n_rows, m, sel, _, begin, end, threads, rng = case
    ctx = ggml.Context(32 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n_rows, k)), type_)
    x = rng.standard_normal((m, k)).astype(np.float32)
    node = ctx.mul_mat_rows(wt, tensor(ctx, x), selector_tensor(ctx, sel), begin, end)
    (y,) = compute(ctx, [node], threads)
    chosen = ref.selection(sel, n_rows, m, begin, end) > 0
    np.testing.assert_array_equal(y[~chosen], 0.0)  # unselected: exactly zero, no NaN left from the poison
    xq = activations_as_kernel_sees(x, type_)
    want = ref.mul_mat_rows(w64, xq, sel, begin, end)
    bound = np.abs(xq) @ np.abs(w64).T
    assert np.all(np.abs(y - want) <= (2e-3 if type_ == ggml.Q4_1 else 2e-5) * bound + 1e-6)  # Q4_1: f16 block sums
    # against float64 activations, relative to the sums' size without cancellation (as test_ops' mul_mat)
    loose = ref.mul_mat_rows(w64, x, sel, begin, end)
    size = ref.mul_mat_rows(np.square(w64), np.square(x.astype(np.float64)), sel, begin, end) ** 0.5
    assert np.linalg.norm(y - loose) <= 0.02 * np.linalg.norm(size) + 1e-6


def rounded_bound(w64: np.ndarray, h: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(m, d) what rounding axpy_rows' coefficients to 8 bits may add (groups of 8 rows of one column, their
    coefficients in units of the largest / 127; a Q4_K level times its scale is at most twice the largest
    weight in magnitude, min included): half a unit per row taken, of the largest coefficient."""
    per_row = 2 * np.abs(w64).max(initial=0.0) * np.abs(h * counts).max(axis=1, keepdims=True)  # (m, 1)
    return counts.sum(axis=1, keepdims=True) * per_row / 254 * np.ones((1, w64.shape[1]))


@SETTINGS
@given(case=sparse_case(), precise=st.booleans())
def test_axpy_rows(case, precise):
    """precise: within float rounding of float64; else the coefficients may be rounded to 8 bits (the integer
    kernels of one column), within that rounding's bound and 2 % of the result's norm."""
    type_, d, n_rows, m, sel, _, begin, end, threads, rng = case
    ctx = ggml.Context(32 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n_rows, d)), type_)
    h = rng.standard_normal((m, n_rows)).astype(np.float32)
    h[rng.random(h.shape) < 0.3] = 0.0  # ReLU-like zeros among the selected
    node = ctx.axpy_rows(wt, tensor(ctx, h), selector_tensor(ctx, sel), begin, end, precise=precise)
    (y,) = compute(ctx, [node], threads)
    want = ref.axpy_rows(w64, h, sel, begin, end)
    counts = ref.selection(sel, n_rows, m, begin, end)
    bound = 1e-5 * ((np.abs(h) * counts) @ np.abs(w64)) + 1e-30  # exact zeros where nothing is selected
    if not precise:
        bound = bound + rounded_bound(w64, h, counts)
        assert np.linalg.norm(y - want) <= 0.02 * np.linalg.norm(want) + 1e-30
    assert np.all(np.abs(y - want) <= bound)


@pytest.mark.parametrize("type_", ggml.WEIGHT_TYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("precise", [True, False])
def test_axpy_rows_of_a_channel_major_matrix(type_, threads, precise):
    """A channel-major gate (n_embd rows of n_ff): rows longer than there are rows take the threads' slices of d,
    a group of rows at a time for one column; against float64, under a mask and with every row."""
    rng = np.random.default_rng(type_ * 10 + threads)
    n_rows, d = 48, 1024
    ctx = ggml.Context(32 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n_rows, d)), type_)
    h = rng.standard_normal((1, n_rows)).astype(np.float32)
    mask = np.where(rng.random((1, n_rows)) < 0.6, 1.0, -1.0).astype(np.float32)
    masked = ctx.axpy_rows(wt, tensor(ctx, h), tensor(ctx, mask), precise=precise)
    whole = ctx.axpy_rows(wt, tensor(ctx, h), precise=precise)
    y_masked, y_whole = compute(ctx, [masked, whole], threads)
    for y, keep in ((y_masked, mask > 0), (y_whole, np.ones_like(mask, bool))):
        want = np.where(keep, h, 0.0) @ w64
        tol = 1e-5 * (np.abs(h) @ np.abs(w64)).max()
        if not precise:
            tol += rounded_bound(w64, h, keep.astype(np.float64)).max()
            assert np.linalg.norm(y - want) <= 0.02 * np.linalg.norm(want)
        np.testing.assert_allclose(y, want, atol=tol)


@pytest.mark.parametrize("type_", ggml.WEIGHT_TYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_axpy_rows_of_a_prompt_batch(type_, threads):
    """Many columns (a prompt batch): the rows are summed a chunk at a time, dequantized once a piece of the
    thread's slice, into every column that takes them. Rows past one chunk (64), slices past one piece (128 values,
    or a K-quant's block), densities from none to all, every row, and a weight row of inf that no column takes:
    against float64; the AVX-512, AVX2 and plain forms bit for bit."""
    rng = np.random.default_rng(type_ * 10 + threads)
    blk = ggml.block_size(type_)
    n_rows, d, m = 150, 3 * max(blk, 128) + (blk if blk > 1 else 5), 23
    ctx = ggml.Context(64 << 20)
    w = rng.standard_normal((n_rows, d))
    w[7] = np.inf if type_ in (ggml.F32, ggml.F16) else w[7]
    wt, w64 = weights(ctx, w, type_)
    h = rng.standard_normal((m, n_rows)).astype(np.float32)
    density = np.linspace(0.0, 1.0, m)[:, None]
    mask = np.where(rng.random((m, n_rows)) < density, 1.0, -1.0).astype(np.float32)
    mask[:, 7] = -1.0
    masked = ctx.axpy_rows(wt, tensor(ctx, h), tensor(ctx, mask))
    finite = np.isfinite(w64).all(axis=1)
    whole = ctx.axpy_rows(wt, tensor(ctx, np.where(finite, h, 0.0).astype(np.float32)), None, 8, n_rows)
    y_masked, y_whole = compute(ctx, [masked, whole], threads)
    w_finite = np.where(finite[:, None], w64, 0.0)
    for y, coef in ((y_masked, np.where(mask > 0, h, 0.0)), (y_whole, np.where(np.arange(n_rows) >= 8, h, 0.0))):
        want = coef @ w_finite
        np.testing.assert_allclose(y, want, atol=1e-5 * (np.abs(coef) @ np.abs(w_finite)).max())
    np.testing.assert_array_equal(y_masked[0], 0.0)  # a column that takes no row
    for switch in (ggml.lib.ggml_cpu_set_avx512, ggml.lib.ggml_cpu_set_simd):  # the same sums on every ISA
        try:
            switch(False)
            again = compute(ctx, [masked, whole], threads)
        finally:
            switch(True)
        for got, first in zip(again, (y_masked, y_whole), strict=True):
            np.testing.assert_array_equal(got, first)


@pytest.mark.parametrize("op", ["mul_mat_rows", "axpy_rows"])
def test_index_list_entry_out_of_range_is_an_error(op):
    ctx = ggml.Context(4 << 20)
    w = tensor(ctx, np.ones((10, 64), np.float32), ggml.Q8_0)
    act = tensor(ctx, np.ones((1, 64 if op == "mul_mat_rows" else 10), np.float32))
    sel = tensor(ctx, np.array([[3, 10, -1]], np.int32))
    node = getattr(ctx, op)(w, act, sel)
    with pytest.raises(InvalidArgumentError, match="index"):
        compute(ctx, [node], 3)
    # the pool survives the error: the next graph runs
    ok = getattr(ctx, op)(w, act, tensor(ctx, np.array([[3, 9, -1]], np.int32)))
    compute(ctx, [ok], 3)


def test_axpy_rows_counts_repeated_index():
    ctx = ggml.Context(1 << 20)
    wt = np.arange(16, dtype=np.float32).reshape(4, 4)
    h = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    sel = np.array([[1, 1, 2, -1]], np.int32)
    (y,) = compute(ctx, [ctx.axpy_rows(tensor(ctx, wt), tensor(ctx, h),
                                       tensor(ctx, sel))], 2)
    np.testing.assert_array_equal(y, [2 * 2 * wt[1] + 3 * wt[2]])  # row 3 after the terminator


@pytest.mark.parametrize("type_", ggml.WEIGHT_TYPES)
@pytest.mark.parametrize("op", ["mul_mat_rows", "axpy_rows"])
def test_simd_matches_scalar(type_, op):
    rng = np.random.default_rng(type_)
    n_rows, width = 40, 512
    ctx = ggml.Context(16 << 20)
    wt, _ = weights(ctx, rng.standard_normal((n_rows, width)), type_)
    mask = (rng.random((2, n_rows)) < 0.4).astype(np.float32)
    act = rng.standard_normal((2, width if op == "mul_mat_rows" else n_rows)).astype(np.float32)
    node = getattr(ctx, op)(wt, tensor(ctx, act), tensor(ctx, mask), 3, 37)
    try:
        ggml.lib.ggml_cpu_set_simd(False)
        (scalar,) = compute(ctx, [node], 2)
    finally:
        ggml.lib.ggml_cpu_set_simd(True)
    (simd,) = compute(ctx, [node], 3)
    np.testing.assert_allclose(simd, scalar, rtol=1e-4, atol=1e-4)


def test_sparse_matches_dense_at_full_density():
    # all rows selected: the sparse ops are mul_mat and its transpose
    rng = np.random.default_rng(7)
    ctx = ggml.Context(16 << 20)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    wt = tensor(ctx, w, ggml.Q4_0)
    x = tensor(ctx, rng.standard_normal((1, 256)).astype(np.float32))
    ones = tensor(ctx, np.ones((1, 96), np.float32))
    dense, sparse = compute(ctx, [ctx.mul_mat(wt, x), ctx.mul_mat_rows(wt, x, ones)], 3)
    np.testing.assert_array_equal(sparse, dense)


@st.composite
def ffn_case(draw):
    type_, d, n_ff, m, sel, _, _, _, threads, rng = draw(sparse_case())
    kind = draw(st.sampled_from(ggml.SPARSE_FFN_KINDS))
    threshold = draw(st.sampled_from([0.0, 0.0, 0.5, 2.0]))
    return type_, d, n_ff, m, sel, kind, threshold, threads, rng


def ffn_ambiguity(kind: str, g, u, dg, du, threshold: float):
    """(act's worst change, whether the keep decision may flip) when g and u move by up to dg, du and the
    activation is evaluated in float32 (whose gelu/silu of a large negative gate is exactly 0)."""
    act = ref.ffn_act(kind, g, u)
    keep = np.abs(act) > threshold
    worst = 1e-6 * (np.abs(g) + 1) * (np.abs(u) + 1)
    flips = np.abs(np.abs(act) - threshold) <= worst
    for sg in (-1, 0, 1):
        for su in (-1, 0, 1):
            moved = ref.ffn_act(kind, g + sg * dg, u + su * du)
            worst = np.maximum(worst, np.abs(moved - act))
            flips |= (np.abs(moved) > threshold) != keep
    return worst, flips


@SETTINGS
@given(case=ffn_case())
def test_sparse_ffn(case):
    check_sparse_ffn(*case)


@pytest.mark.parametrize("type_", ggml.WEIGHT_TYPES)
def test_sparse_ffn_of_a_prompt_batch(type_):
    """Many columns: down's rows summed a chunk at a time (as axpy_rows' prompt batches) past one chunk of neurons
    and one piece of d, under a mask and without one."""
    rng = np.random.default_rng(type_)
    blk = ggml.block_size(type_)
    d, n_ff, m = 2 * max(blk, 128) + (blk if blk > 1 else 7), 90, 9
    mask = np.where(rng.random((m, n_ff)) < 0.4, 1.0, -1.0).astype(np.float32)
    for sel in (mask, None):
        check_sparse_ffn(type_, d, n_ff, m, sel, "swiglu", 0.05, 3, rng)


def check_sparse_ffn(type_, d, n_ff, m, sel, kind, threshold, threads, rng):
    r = 2 if kind == "relu" else 3
    ctx = ggml.Context(32 << 20)
    bundle, b64 = weights(ctx, rng.standard_normal((r * n_ff, d)), type_)
    x = rng.standard_normal((m, d)).astype(np.float32)
    (y,) = compute(ctx, [ctx.sparse_ffn(bundle, tensor(ctx, x), selector_tensor(ctx, sel), kind, threshold)], threads)
    out, flags = y[:, :d], y[:, d:]
    xq = activations_as_kernel_sees(x, type_)
    rows = b64.reshape(n_ff, r, d)
    g = xq @ rows[:, 0].T if r == 3 else np.zeros((m, n_ff))
    u = xq @ rows[:, r - 2].T
    tol = 2e-3 if type_ == ggml.Q4_1 else 2e-5  # of |x|.|w|, as test_mul_mat_rows (Q4_1: f16 block sums)
    dg, du = (tol * np.abs(xq) @ np.abs(rows[:, k]).T + 1e-6 for k in (0, r - 2))
    worst, flips = ffn_ambiguity(kind, g, u, dg if r == 3 else 0.0, du, threshold)
    counts = ref.selection(sel, n_ff, m)
    want = ref.sparse_ffn(b64, xq, kind, sel, threshold)
    # a neuron is summed as the reference says, but for those within rounding of the threshold
    assert set(np.unique(flags)) <= {0.0, 1.0}
    np.testing.assert_array_equal(flags[~flips], want[:, d:][~flips])
    assert np.all(flags[counts == 0] == 0.0)
    # the output, with the kernel's own decisions for those neurons
    taken = counts * flags
    act = ref.ffn_act(kind, g, u)
    expect = ref.axpy_rows(rows[:, r - 1], act * taken, taken)
    bound = (worst * taken) @ np.abs(rows[:, r - 1]) + 1e-5 * (np.abs(act) * taken) @ np.abs(rows[:, r - 1])
    assert np.all(np.abs(out - expect) <= bound + 1e-6)


def test_sparse_ffn_equals_the_separate_ops():
    # SwiGLU at full density through both paths: the same float32 operations, so the same values
    rng = np.random.default_rng(3)
    n_ff, d = 64, 256
    ctx = ggml.Context(16 << 20)
    mats = [rng.standard_normal((n_ff, d)).astype(np.float32) for _ in range(3)]  # gate, up, down_t
    bundle = tensor(ctx, np.stack(mats, 1).reshape(3 * n_ff, d), ggml.Q4_0)
    gate, up, down_t = (tensor(ctx, w, ggml.Q4_0) for w in mats)
    x = tensor(ctx, rng.standard_normal((1, d)).astype(np.float32))
    act = ctx.mul(ctx.silu(ctx.mul_mat(gate, x)), ctx.mul_mat(up, x))
    split, fused = compute(ctx, [ctx.axpy_rows(down_t, act), ctx.sparse_ffn(bundle, x, None, "swiglu")], 2)
    np.testing.assert_allclose(fused[:, :d], split, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fused[:, d:], 1.0)


@pytest.mark.parametrize("bad, match", [("kind", "unknown FFN kind"), ("rows", "multiple of 3"),
                                        ("threshold", "< 0")])
def test_sparse_ffn_rejects_bad_arguments(bad, match):
    ctx = ggml.Context(4 << 20)
    bundle = tensor(ctx, np.ones((10 if bad == "rows" else 12, 64), np.float32), ggml.Q8_0)
    x = tensor(ctx, np.ones((1, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match=match):
        ctx.sparse_ffn(bundle, x, None, "tanh" if bad == "kind" else "swiglu", -1.0 if bad == "threshold" else 0.0)


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("density", [0.03, 0.5])
@pytest.mark.parametrize("type_", [ggml.Q4_0, ggml.Q5_0])
def test_sums_do_not_depend_on_threads(m, density, type_):
    # rows are summed per chunk of the mask and the chunks added in order: bit for bit the same output
    # at every thread count and run, however the chunks were shared out (greedy decoding repeats itself);
    # a few selected rows (a split layer's cold neurons) are cut into smaller chunks than many, and short rows
    # into longer ones (Q5_0's one-column axpy groups 8 rows with coefficients rounded per group)
    rng = np.random.default_rng(m)
    n_ff, d = 1000, 256
    ctx = ggml.Context(32 << 20)
    bundle = tensor(ctx, rng.standard_normal((3 * n_ff, d)).astype(np.float32), type_)
    down_t = tensor(ctx, rng.standard_normal((n_ff, d)).astype(np.float32), type_)
    x = tensor(ctx, rng.standard_normal((m, d)).astype(np.float32))
    h = tensor(ctx, rng.standard_normal((m, n_ff)).astype(np.float32))
    mask = tensor(ctx, (rng.random((m, n_ff)) < density).astype(np.float32))
    nodes = [ctx.sparse_ffn(bundle, x, mask, "swiglu"), ctx.axpy_rows(down_t, h, mask)]
    runs = [compute(ctx, nodes, threads) for threads in (1, 2, 3, 16, 3, 2)]
    for run in runs[1:]:
        for got, first in zip(run, runs[0], strict=True):
            np.testing.assert_array_equal(got, first)
