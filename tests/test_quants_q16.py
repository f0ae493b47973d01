"""Precise matmuls' 16-bit activations (ggml/src/quants_q16.c, quants_q16_avx2.c; quants.h's block_q16 and
block_q16_K): x = d * q, q = 255 hi + lo. The quantizer against numpy's arithmetic (bit for bit, SIMD and scalar),
the dots of every weight type that has them against float64, and the SIMD kernels against the scalar ones."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quants import block, c_dequantize, c_quantize, random_blocks, rows
from test_quants import term_bound as quants_term_bound

from pyinfer.errors import UnsupportedError
from pyinfer.native.binding import check, ffi, lib

Q16_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K]
Q16_MAX = 32512


@pytest.fixture(autouse=True)
def _simd_back_on():
    yield
    lib.ggml_cpu_set_simd(True)


def c_quantize_q16(qtype, x: np.ndarray, simd: bool = True) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.full(lib.ggml_q16_row_size(int(qtype), x.size), 0xA5, dtype=np.uint8)
    lib.ggml_cpu_set_simd(simd)
    try:
        check(lib.ggml_quantize_q16(int(qtype), ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size))
    finally:
        lib.ggml_cpu_set_simd(True)
    return out


def c_vec_dot_q16(qtype, n: int, w: np.ndarray, x: np.ndarray, ref: bool) -> float:
    res = ffi.new("float *", float("nan"))
    fn = lib.ggml_vec_dot_q16_ref if ref else lib.ggml_vec_dot_q16
    check(fn(int(qtype), n, res, ffi.from_buffer(np.ascontiguousarray(w)), ffi.from_buffer(np.ascontiguousarray(x))))
    return float(res[0])


def blck(qtype) -> int:
    return 256 if qtype in (QT.Q4_K, QT.Q6_K) else 32


def decode(qtype, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(d per block, sums of q per block (per 16 for the K-quants), hi, lo) of a row of block_q16 / block_q16_K."""
    b = blck(qtype)
    nsum = 16 if b == 256 else 1
    rec = raw.reshape(-1, 4 + 4 * nsum + 2 * b)
    d = rec[:, :4].copy().view(np.float32).ravel()
    sums = rec[:, 4:4 + 4 * nsum].copy().view(np.int32)
    hi = rec[:, 4 + 4 * nsum:4 + 4 * nsum + b].view(np.int8).astype(np.int64)
    lo = rec[:, 4 + 4 * nsum + b:].view(np.int8).astype(np.int64)
    return d, sums, hi, lo


def numpy_q16(qtype, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantizer's arithmetic in numpy: d = amax / 32512 in float32, q = x * (1 / d) rounded half away from
    zero, clipped; (d per block, q)."""
    b = blck(qtype)
    xb = x.reshape(-1, b).astype(np.float32)
    d = (np.abs(xb).max(axis=1) / np.float32(Q16_MAX)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
        v = (xb * inv[:, None]).astype(np.float32).astype(np.float64)
    r = np.sign(v) * np.floor(np.abs(v) + 0.5)
    r = np.where(np.isfinite(r) & (np.abs(r) < 2.0**31), r, 0)  # C's cast of what does not fit an int: 0
    return d, np.clip(r, -Q16_MAX, Q16_MAX).astype(np.int64)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
@given(data=st.data())
def test_quantizer_is_numpys_arithmetic_in_two_bytes(qtype, data):
    x = data.draw(rows(blck(qtype), max_blocks=12 if blck(qtype) == 32 else 3))
    x = np.clip(x, -1e30, 1e30)
    raw = c_quantize_q16(qtype, x)
    np.testing.assert_array_equal(raw, c_quantize_q16(qtype, x, simd=False))  # SIMD = scalar, byte for byte
    d, sums, hi, lo = decode(qtype, raw)
    want_d, q = numpy_q16(qtype, x)
    np.testing.assert_array_equal(d.view(np.uint32), want_d.view(np.uint32))
    assert np.abs(hi).max() <= 127 and np.abs(lo).max() <= 127  # both bytes survive the sign trick's negation
    np.testing.assert_array_equal(255 * hi + lo, q)
    per = sums.shape[1]
    np.testing.assert_array_equal(sums, q.reshape(q.shape[0], per, -1).sum(axis=2))
    # what it holds: x within about half a step, where 1 / d is a float (a block of subnormals is all zeros, as Q8's)
    with np.errstate(over="ignore"):
        fine = np.isfinite(np.float32(1) / np.where(d != 0, d, 1).astype(np.float32))
    err = np.abs(x.reshape(q.shape) - d[:, None].astype(np.float64) * q)[fine]
    assert np.all(err <= 0.51 * d[fine, None] + 1e-45)  # x * (1 / d) in float32 is off by up to 32512 ulp


def test_a_type_without_them_is_refused():
    with pytest.raises(UnsupportedError, match="no 16-bit activations for f16"):
        check(lib.ggml_quantize_q16(int(QT.F16), ffi.new("float[32]"), ffi.new("char[128]"), 32))
    assert lib.ggml_q16_row_size(int(QT.MXFP4), 32) == 0
    assert lib.ggml_q16_row_size(int(QT.Q4_0), 64) == 144 and lib.ggml_q16_row_size(int(QT.Q6_K), 256) == 580


def term_bound(qtype, wq: np.ndarray, n: int) -> np.ndarray:
    """Per weight, the largest magnitude the parts its kernel sums apart can take: test_quants' bound, and for Q4_0
    and Q5_0 their offsets too (here they come off through sum(q), apart from the levels)."""
    if qtype in (QT.Q4_0, QT.Q5_0):
        top, offset = (15, 8) if qtype == QT.Q4_0 else (31, 16)
        d = wq.reshape(-1, block(qtype)[1])[:, 0:2].copy().view(np.float16).astype(np.float64).ravel()
        return np.repeat(np.abs(d) * (top + offset), 32)
    return quants_term_bound(qtype, wq, n)


@pytest.mark.parametrize("qtype", Q16_TYPES, ids=lambda t: t.name)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_vec_dot_q16_matches_float64(qtype, data):
    """The dot of quantized weights and 16-bit activations: against float64 on the same dequantized weights and
    activations (float32 summation only), and against x itself (each value within half its block's step)."""
    n_blocks = data.draw(st.integers(1, 9 if blck(qtype) == 32 else 3))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = n_blocks * blck(qtype)
    w = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal(n) * data.draw(st.sampled_from([1e-3, 1.0, 1e3]))).astype(np.float32)
    x[rng.integers(n)] *= data.draw(st.sampled_from([1.0, 30.0]))  # an outlier sets its block's step
    wq, xq = c_quantize(qtype, w), c_quantize_q16(qtype, x)
    wd = c_dequantize(qtype, wq, n).astype(np.float64)
    d, _, hi, lo = decode(qtype, xq)
    xd = (d[:, None].astype(np.float64) * (255 * hi + lo)).ravel()
    terms = float((term_bound(qtype, wq, n) * np.abs(xd)).sum())
    ref, fast = c_vec_dot_q16(qtype, n, wq, xq, ref=True), c_vec_dot_q16(qtype, n, wq, xq, ref=False)
    want = float(np.dot(wd, xd))
    assert abs(ref - want) <= 1e-5 * terms + 1e-30
    assert abs(fast - want) <= 1e-5 * terms + 1e-30
    step = np.repeat(d.astype(np.float64), blck(qtype))  # each value within about half its block's step
    assert abs(float(np.dot(wd, x)) - ref) <= float(np.abs(wd) @ (0.51 * step)) + 1e-5 * terms + 1e-30


@pytest.mark.parametrize("qtype", Q16_TYPES, ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_vec_dot_q16_random_blocks_simd_vs_scalar(qtype, n_blocks, seed):
    """Arbitrary weight bytes (every level and scale code), odd block counts included."""
    if blck(qtype) == 256:
        n_blocks = (n_blocks + 3) // 4
    n = n_blocks * blck(qtype)
    rng = np.random.default_rng(seed)
    wq = random_blocks(qtype, n_blocks, rng)
    xq = c_quantize_q16(qtype, rng.standard_normal(n).astype(np.float32))
    d, _, hi, lo = decode(qtype, xq)
    xd = (d[:, None].astype(np.float64) * (255 * hi + lo)).ravel()
    terms = float((term_bound(qtype, wq, n) * np.abs(xd)).sum())
    ref, fast = c_vec_dot_q16(qtype, n, wq, xq, ref=True), c_vec_dot_q16(qtype, n, wq, xq, ref=False)
    assert abs(ref - float(np.dot(c_dequantize(qtype, wq, n).astype(np.float64), xd))) <= 1e-5 * terms
    assert abs(fast - ref) <= 3e-6 * terms
