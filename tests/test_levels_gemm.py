"""Prompt matmuls as int8 tile GEMMs over the weights' levels (ggml/src/levels.h): the scalar oracle on any CPU
against numpy float64, and on a CPU with AMX the tile kernel against that oracle bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from op_harness import compute, tensor, weights
from test_ops import EMU_TOL, emulated_matmul

from pyinfer.native import ggml

LEVELS_TYPES = (ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q8_0, ggml.MXFP4, ggml.Q4_K, ggml.Q6_K)
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def levels_mul_mat(type_: int, n: int, m: int, k: int, threads: int, seed: int, mode: int, precise: bool = False):
    """(y, emulated, bound): mul_mat of an (n, k) weight of type_ by m columns through `mode`, what it computes in
    float64 (the dequantized weights times the activations as their vec_dot_type holds them; precise: as they are,
    their 16-bit form being within ~3e-5 of a block's largest) and the size of the sums' terms."""
    rng = np.random.default_rng(seed)
    ctx = ggml.Context(64 << 20)
    wt, w64 = weights(ctx, rng.standard_normal((n, k)), type_)
    x = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    y = ctx.mul_mat(wt, tensor(ctx, x), precise=precise)
    try:
        ggml.lib.ggml_cpu_set_levels_gemm(mode)
        (out,) = compute(ctx, [y], threads)
    finally:
        ggml.lib.ggml_cpu_set_levels_gemm(ggml.lib.GGML_LEVELS_GEMM_AUTO)
    want = x.astype(np.float64) @ w64.T if precise else emulated_matmul(w64, x, type_)
    return out, want, np.abs(x.astype(np.float64)) @ np.abs(w64).T


# the types with 16-bit activations: a precise mul_mat of theirs runs as two planes of bytes (MXFP4 has none)
PRECISE_TYPES = tuple(t for t in LEVELS_TYPES if t != ggml.MXFP4)
# (type, precise): every levels type rounded, and precise where it has 16-bit activations
CASES = [(t, False) for t in LEVELS_TYPES] + [(t, True) for t in PRECISE_TYPES]


def tolerance(type_: int, precise: bool) -> float:
    """Of the sums' terms: float32 rounding on the emulated activations, or precise (against x itself) the 16-bit
    activations' rounding, 1/32512 of a block's largest, as test_ops' precise mul_mat."""
    return 5e-5 if precise else EMU_TOL.get(type_, 2e-6)


@pytest.mark.parametrize("type_,precise", CASES)
@SETTINGS
@given(n=st.integers(1, 80), m=st.integers(4, 40), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31))
@example(n=16, m=16, threads=1, seed=0)  # one whole panel by one whole group
@example(n=17, m=17, threads=2, seed=1)  # one row and one column past them
@example(n=80, m=4, threads=3, seed=2)   # more panels than threads, the smallest batch
def test_levels_oracle_matches_float64(type_, precise, n, m, threads, seed):
    """Weight rows past a panel of 16 and columns past a group of 16 (both padded with zeros) on 1-3 threads:
    the oracle's sums equal float64's on the same levels and activations to float32 rounding (a level, scale,
    offset or activation in the wrong place misses by a whole term); precise, with the activations as two planes
    of bytes, 255 high + low (a plane dropped, its weight of 255 lost or its bytes misplaced miss by 1/255 of the
    terms or more)."""
    k = 2 * max(ggml.block_size(type_), 64)
    y, want, bound = levels_mul_mat(type_, n, m, k, threads, seed, ggml.lib.GGML_LEVELS_GEMM_REF, precise)
    assert np.all(np.abs(y - want) <= tolerance(type_, precise) * bound + 1e-30)


@pytest.mark.parametrize("type_", LEVELS_TYPES)
def test_levels_oracle_follows_the_tiles(type_):
    """The oracle through a real prompt's shape agrees with the 4 x 4 tiles it replaces (same activations)."""
    k = 4 * max(ggml.block_size(type_), 128)
    y, _, bound = levels_mul_mat(type_, 50, 37, k, 2, type_, ggml.lib.GGML_LEVELS_GEMM_REF)
    tiles, _, _ = levels_mul_mat(type_, 50, 37, k, 2, type_, ggml.lib.GGML_LEVELS_GEMM_OFF)
    assert np.all(np.abs(y - tiles) <= EMU_TOL.get(type_, 2e-6) * bound)


@pytest.mark.parametrize("type_", LEVELS_TYPES)
def test_simd_levels_equal_the_scalar_ones(type_):
    """The AVX2 rows of levels (Q4_0, Q5_0, Q4_K, Q6_K; the rest stay scalar) write the scalar rows' levels and
    scales: the oracle's GEMM over either gives the same bits."""
    k = 4 * max(ggml.block_size(type_), 128)
    simd, _, _ = levels_mul_mat(type_, 37, 20, k, 2, type_, ggml.lib.GGML_LEVELS_GEMM_REF)
    try:
        ggml.lib.ggml_cpu_set_simd(False)
        scalar, _, _ = levels_mul_mat(type_, 37, 20, k, 2, type_, ggml.lib.GGML_LEVELS_GEMM_REF)
    finally:
        ggml.lib.ggml_cpu_set_simd(True)
    np.testing.assert_array_equal(simd, scalar)


@pytest.mark.skipif(not ggml.lib.ggml_cpu_has_amx(), reason="needs a CPU with AMX int8 tiles")
@pytest.mark.parametrize("type_,precise", CASES)
@SETTINGS
@given(n=st.integers(1, 70), m=st.integers(4, 70), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31))
def test_amx_equals_its_oracle(type_, precise, n, m, threads, seed):
    """On AMX the tile kernel computes what the oracle does, operation for operation: equal bit for bit (precise:
    its two planes too)."""
    k = 2 * max(ggml.block_size(type_), 128)
    amx, want, bound = levels_mul_mat(type_, n, m, k, threads, seed, ggml.lib.GGML_LEVELS_GEMM_AUTO, precise)
    oracle, _, _ = levels_mul_mat(type_, n, m, k, threads, seed, ggml.lib.GGML_LEVELS_GEMM_REF, precise)
    np.testing.assert_array_equal(amx, oracle)
    assert np.all(np.abs(amx - want) <= tolerance(type_, precise) * bound + 1e-30)


@pytest.mark.skipif(not ggml.lib.ggml_cpu_has_amx(), reason="needs a CPU with AMX int8 tiles")
@pytest.mark.parametrize("type_,precise", [c for c in CASES if c[0] != ggml.MXFP4])
@pytest.mark.parametrize("n", [1, 15, 17, 40])
@pytest.mark.parametrize("m", [4, 16, 17, 32, 33, 64, 65])
def test_few_columns_straight_from_the_blocks_equal_the_tiles(type_, precise, n, m):
    """Up to 64 columns (a precise batch's 32) skip the panel of levels (quants_levels_vnni.c: 16 rows transposed in
    registers, a lane a row), rounded or precise (two planes of activation bytes): the oracle's bits, at the edges
    of a panel's rows, of a group's 16 columns and of the 32 and 64 (past them the tiles), so that a token's result
    does not depend on how many came with it."""
    seed = n * 1000 + m
    direct, want, bound = levels_mul_mat(type_, n, m, 768, 2, seed, ggml.lib.GGML_LEVELS_GEMM_AUTO, precise)
    oracle, _, _ = levels_mul_mat(type_, n, m, 768, 2, seed, ggml.lib.GGML_LEVELS_GEMM_REF, precise)
    np.testing.assert_array_equal(direct, oracle)
    assert np.all(np.abs(direct - want) <= tolerance(type_, precise) * bound + 1e-30)


@pytest.mark.skipif(not ggml.lib.ggml_cpu_has_amx(), reason="needs a CPU with AMX int8 tiles")
def test_scalar_kernels_leave_amx_aside():
    """With the SIMD kernels off (ggml_cpu_set_simd(False)) a prompt takes the scalar path even where AMX is on."""
    try:
        ggml.lib.ggml_cpu_set_simd(False)
        auto, _, _ = levels_mul_mat(ggml.Q4_0, 33, 20, 256, 2, 5, ggml.lib.GGML_LEVELS_GEMM_AUTO)
        off, _, _ = levels_mul_mat(ggml.Q4_0, 33, 20, 256, 2, 5, ggml.lib.GGML_LEVELS_GEMM_OFF)
    finally:
        ggml.lib.ggml_cpu_set_simd(True)
    np.testing.assert_array_equal(auto, off)
