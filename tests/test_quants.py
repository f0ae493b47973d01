"""Quantized types of ggml (ggml/src/quants.c, quants_avx2.c) against independent oracles: gguf.quants
(bit-exact quantizers and dequantizers), numpy float64 (dot products, axpy), and the scalar kernels
(the SIMD kernels must agree with them).

NaN/Inf behaviour (stated, and tested below):
- conversions: F16/BF16 keep Inf and NaN (a NaN stays a NaN, quieted); values beyond the F16 range
  become Inf, as numpy's astype(float16).
- Q8_0/Q4_0/Q4_1/Q5_0 quantizers: bit-exact with gguf.quants on non-finite input too (x86 numpy): a block
  holding Inf gets an Inf scale, a block holding NaN a NaN scale, and levels that numpy's casts of
  NaN/Inf give (0); other blocks of the row are unaffected. (Only the sign of a NaN scale
  made from a negative NaN may differ: numpy's min/max reductions drop it.) No C undefined behaviour on the way.
- MXFP4 quantizer: bit-exact with gguf.quants too (a block holding Inf or NaN gets e = 0 and level 0 throughout,
  as numpy's casts give), except in blocks whose largest magnitude is below 2^-125: there e = 0, the smallest
  scale, where gguf.quants' uint8 cast wraps the negative exponent around to a huge one.
- dequantizers: a scale that is Inf/NaN gives Inf/NaN values, exactly as gguf.quants does.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.errors import InvalidArgumentError, UnsupportedError
from pyinfer.native import ggml
from pyinfer.native.binding import check, ffi, lib

QT = GGMLQuantizationType
EXACT_QUANT = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.MXFP4]  # quantizers bit-exact with gguf.quants
FILE_QUANTS = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.MXFP4]  # weight types with a vec_dot
WEIGHT_TYPES = [QT.F32, QT.F16, QT.BF16, *FILE_QUANTS]
ALL_TYPES = [QT.F32, QT.F16, QT.BF16, *FILE_QUANTS, QT.Q8_1, QT.Q8_K, QT.I8, QT.I32]

# relative RMS round-trip error on standard-normal data; measured: Q8_0 .0054, Q4_0 .086, Q4_1 .079,
# Q5_0 .043, Q4_K .080 (our simpler quantizer; llama.cpp's search gets ~.07), Q6_K .019, Q8_K .007, MXFP4 .116
# (E2M1 levels under a power-of-two scale: the top two are 8 d and 12 d)
RMS_BOUND = {QT.Q8_0: 0.008, QT.Q8_1: 0.008, QT.Q8_K: 0.01, QT.Q4_0: 0.11, QT.Q4_1: 0.10, QT.Q5_0: 0.055,
             QT.Q4_K: 0.10, QT.Q6_K: 0.025, QT.MXFP4: 0.135}


@pytest.fixture(autouse=True)
def _simd_back_on():
    """Tests switch the SIMD kernels off and on; leave them on for whoever runs next."""
    yield
    lib.ggml_cpu_set_simd(True)


# --- thin wrappers over the C API; outputs are poisoned before the kernels write ---

def block(qtype) -> tuple[int, int]:
    return int(lib.ggml_blck_size(int(qtype))), int(lib.ggml_type_size(int(qtype)))


def c_quantize(qtype, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    bs, ts = block(qtype)
    out = np.full(x.size // bs * ts, 0xA5, dtype=np.uint8)
    check(lib.ggml_quantize(int(qtype), ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size))
    return out


def c_dequantize(qtype, data: np.ndarray, n: int) -> np.ndarray:
    data = np.ascontiguousarray(data).view(np.uint8)
    out = np.full(n, np.nan, dtype=np.float32)
    check(lib.ggml_dequantize(int(qtype), ffi.from_buffer(data), ffi.from_buffer("float[]", out), n))
    return out


def c_vec_dot(qtype, n: int, w: np.ndarray, x: np.ndarray, ref: bool) -> float:
    res = ffi.new("float *", float("nan"))
    fn = lib.ggml_vec_dot_ref if ref else lib.ggml_vec_dot
    check(fn(int(qtype), n, res, ffi.from_buffer(np.ascontiguousarray(w)), ffi.from_buffer(np.ascontiguousarray(x))))
    return float(res[0])


def c_axpy(qtype, n: int, y: np.ndarray, a: float, row: np.ndarray, ref: bool) -> np.ndarray:
    y = np.array(y, dtype=np.float32)
    fn = lib.ggml_axpy_ref if ref else lib.ggml_axpy
    check(fn(int(qtype), n, ffi.from_buffer("float[]", y), a, ffi.from_buffer(np.ascontiguousarray(row))))
    return y


def to_bytes(qtype, x: np.ndarray) -> np.ndarray:
    """Any type's row as bytes: plain types by numpy, quantized ones by our quantizer."""
    if qtype == QT.F32:
        return x.astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        return x.astype(np.float16).view(np.uint8)
    return c_quantize(qtype, x)


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """float32 arrays equal bit for bit, except that any NaN matches any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


# --- strategies ---

MAGNITUDES = st.sampled_from([0.0, 1e-40, 1e-36, 1e-20, 1e-3, 1.0, 7.0, 1e3, 6e4, 1e5])


@st.composite
def rows(draw, blck: int, max_blocks: int = 20):
    """A row of whole blocks: normal values at a drawn magnitude, with some zeros, exact ties and
    block-wide repeats mixed in."""
    n_blocks = draw(st.integers(1, max_blocks))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(MAGNITUDES)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n_blocks * blck) * scale).astype(np.float32)
    kind = draw(st.sampled_from(["plain", "zeros", "ties", "const", "sparse"]))
    if kind == "zeros":
        x[rng.random(x.size) < 0.5] = 0.0
    elif kind == "ties":  # small integers: many exact .5 cases after scaling
        x = (rng.integers(-16, 17, x.size) * max(scale, 1.0) / 2).astype(np.float32)
    elif kind == "const":
        x[:] = np.float32(scale)
    elif kind == "sparse":
        x = np.where(rng.random(x.size) < 0.1, x, np.float32(0)).astype(np.float32)
    return x


# --- sizes ---

def test_block_sizes_match_gguf():
    for t in ALL_TYPES:
        assert bool(lib.ggml_type_is_valid(int(t)))
        want = GGML_QUANT_SIZES[t]
        if t == QT.Q8_1:
            # gguf-py's table still says 40 (the old float d, float s); llama.cpp's block is
            # { half d, half s, int8 qs[32] } = 36, never stored in files
            want = (32, 36)
        assert block(t) == want, t.name
        assert ffi.string(lib.ggml_type_name(int(t))).decode().lower() == t.name.lower()
    assert lib.ggml_row_size(int(QT.Q4_K), 512) == 288
    assert lib.ggml_vec_dot_type(int(QT.Q4_0)) == QT.Q8_0
    assert lib.ggml_vec_dot_type(int(QT.Q4_1)) == QT.Q8_1
    assert lib.ggml_vec_dot_type(int(QT.Q6_K)) == QT.Q8_K
    assert lib.ggml_vec_dot_type(int(QT.BF16)) == QT.BF16
    assert lib.ggml_vec_dot_type(int(QT.MXFP4)) == QT.Q8_0


# --- conversions ---

@pytest.mark.parametrize("simd", [True, False])
def test_f16_all_halves_exact(simd):
    lib.ggml_cpu_set_simd(simd)
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = c_dequantize(QT.F16, halves, halves.size)
    assert_bits_equal(got, halves.view(np.float16).astype(np.float32))
    back = c_quantize(QT.F16, got).view(np.uint16)
    finite = ~np.isnan(got)
    np.testing.assert_array_equal(back[finite], halves[finite])
    assert np.isnan(back.view(np.float16)[~finite]).all()


@pytest.mark.parametrize("simd", [True, False])
@given(seed=st.integers(0, 2**32 - 1))
def test_f16_bf16_rounding_matches_numpy_and_gguf(simd, seed):
    lib.ggml_cpu_set_simd(simd)
    rng = np.random.default_rng(seed)
    # random bit patterns cover every exponent: subnormals, ties, overflow to inf, inf, nan
    x = rng.integers(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x[:8] = [65504.0, 65519.996, 65520.0, 2.0**-25, 2.0**-24 * 1.5, -(2.0**-25) * 1.0001, np.inf, -0.0]
    with np.errstate(over="ignore"):
        want16 = x.astype(np.float16)
    got16 = c_quantize(QT.F16, x).view(np.float16)
    ok = ~np.isnan(want16)
    np.testing.assert_array_equal(got16.view(np.uint16)[ok], want16.view(np.uint16)[ok])
    assert np.isnan(got16[~ok]).all()
    want_bf = gq.quantize(x, QT.BF16)
    np.testing.assert_array_equal(c_quantize(QT.BF16, x), want_bf)
    assert_bits_equal(c_dequantize(QT.BF16, want_bf, x.size), gq.dequantize(want_bf, QT.BF16))


# --- quantizers bit-exact with gguf.quants ---

@pytest.mark.parametrize("qtype", EXACT_QUANT, ids=lambda t: t.name)
@given(data=st.data())
def test_quantize_bit_exact(qtype, data):
    x = data.draw(rows(32))
    if qtype == QT.Q4_1:
        # numpy's min/max pick among +0 and -0 by its SIMD lane order; that only flips the sign of a
        # zero d or m (same dequantized values), checked below
        assert_bits_equal(c_dequantize(qtype, c_quantize(qtype, x), x.size) + 0.0,
                          gq.dequantize(gq.quantize(x, qtype), qtype) + np.float32(0.0))
        x = x + np.float32(0.0)  # -0 -> +0
    with np.errstate(all="ignore"):
        want = gq.quantize(x, qtype)
    got = c_quantize(qtype, x)
    if qtype == QT.MXFP4:  # blocks of magnitudes below 2^-125: see the module's docstring, and test_mxfp4_sound
        tiny = np.abs(x.reshape(-1, 32)).max(axis=1) < 2.0**-125
        assert (got.reshape(-1, 17)[tiny, 0] == 0).all()
        got, want = got.reshape(-1, 17)[~tiny], want.reshape(-1, 17)[~tiny]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", EXACT_QUANT, ids=lambda t: t.name)
def test_quantize_inf_and_nan(qtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(160).astype(np.float32)
    x[3], x[40] = np.inf, -np.inf  # blocks 0 and 1 hold Inf
    x[70] = np.nan                 # block 2 holds NaN
    x[100], x[101] = np.nan, np.inf  # block 3: NaN first
    x[128:] = 0.0                  # block 4: clean
    with np.errstate(all="ignore"):
        want = gq.quantize(x, qtype)
    np.testing.assert_array_equal(c_quantize(qtype, x), want)


# --- dequantizers bit-exact with gguf.quants ---

@pytest.mark.parametrize("qtype", [*FILE_QUANTS, QT.F16, QT.BF16], ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 20), seed=st.integers(0, 2**32 - 1), finite=st.booleans())
def test_dequantize_bit_exact(qtype, n_blocks, seed, finite):
    bs, ts = block(qtype)
    if bs == 256:
        n_blocks = (n_blocks + 3) // 4
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n_blocks * ts, dtype=np.uint8)  # any bytes are a valid block
    raw = data.reshape(n_blocks, ts)
    if finite and qtype == QT.MXFP4:  # E8M0 exponents up to 252: 12 * 2^124 is a float, 12 * 2^125 is not
        raw[:, 0] = np.minimum(raw[:, 0], 252)
    elif finite:  # keep every f16 scale finite: exponent bits below 31
        offsets = {QT.Q6_K: [208], QT.Q4_K: [0, 2], QT.Q4_1: [0, 2]}.get(qtype, [0] if bs > 1 else range(0, ts, 2))
        for off in offsets:
            raw[:, off + 1] &= 0x7B  # the byte holding the f16's sign and exponent (little endian)
    with np.errstate(all="ignore"):
        want = gq.dequantize(data, qtype).ravel()
    for simd in (True, False):
        lib.ggml_cpu_set_simd(simd)
        assert_bits_equal(c_dequantize(qtype, data, n_blocks * bs), want)


@given(x=rows(32))
def test_q8_1_block_and_sum(x):
    q = c_quantize(QT.Q8_1, x).reshape(-1, 36)
    d = q[:, 0:2].copy().view(np.float16).astype(np.float32)
    s = q[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = q[:, 4:].view(np.int8).astype(np.float32)
    np.testing.assert_array_equal(c_quantize(QT.Q8_0, x).reshape(-1, 34)[:, 2:], q[:, 4:])  # same levels as Q8_0
    assert_bits_equal(c_dequantize(QT.Q8_1, q, x.size), (qs * d).ravel())
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(s.ravel(), (d.ravel() * qs.sum(axis=1)).astype(np.float16).astype(np.float32))


@given(x=rows(256, max_blocks=4))
def test_q8_K_block_and_bsums(x):
    q = c_quantize(QT.Q8_K, x).reshape(-1, 292)
    d = q[:, :4].copy().view(np.float32)
    qs = q[:, 4:260].view(np.int8).astype(np.int32)
    bsums = q[:, 260:].copy().view(np.int16)
    np.testing.assert_array_equal(bsums, qs.reshape(-1, 16, 16).sum(axis=2))
    assert np.abs(qs).max() <= 127
    assert_bits_equal(c_dequantize(QT.Q8_K, q, x.size), (qs.astype(np.float32) * d).ravel())


ACT_TYPES = [QT.F16, QT.Q8_0, QT.Q8_1, QT.Q8_K]  # what mul_mat converts activations to


def c_quantize_act(qtype, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    bs, ts = block(qtype)
    out = np.full(x.size // bs * ts, 0xA5, dtype=np.uint8)
    check(lib.ggml_quantize_act(int(qtype), ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size))
    return out


@pytest.mark.parametrize("qtype", ACT_TYPES, ids=lambda t: t.name)
@given(data=st.data(), special=st.sampled_from([None, np.inf, -np.inf, np.nan]))
def test_quantize_act_equals_reference(qtype, data, special):
    """The SIMD activation quantizer does the reference arithmetic (roundf ties included): same bytes,
    also with Inf/NaN in a block; with SIMD off it is the reference itself."""
    bs = int(lib.ggml_blck_size(int(qtype)))
    x = data.draw(rows(bs, max_blocks=8 if qtype != QT.Q8_K else 3))
    if data.draw(st.booleans()):  # amax 127 makes the scale 1: every k + 0.5 is an exact rounding tie
        x[:bs] = np.resize(np.arange(-127, 127) + 0.5, bs)
        x[0] = 127.0
    if special is not None:
        x[data.draw(st.integers(0, x.size - 1))] = special
    want = c_quantize(qtype, x)
    for simd in (True, False):
        lib.ggml_cpu_set_simd(simd)
        np.testing.assert_array_equal(c_quantize_act(qtype, x), want)


# --- round trip ---

QUANT_TYPES = [*FILE_QUANTS, QT.Q8_1, QT.Q8_K]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_round_trip_rms(qtype, seed, scale):
    bs = block(qtype)[0]
    x = (np.random.default_rng(seed).standard_normal(bs * 64) * scale).astype(np.float32)
    y = c_dequantize(qtype, c_quantize(qtype, x), x.size)
    rel = np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
    assert rel <= RMS_BOUND[qtype]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_round_trip_ggml_metric(qtype):
    """ggml's test-quantize-fns: data 0.1 + 2 cos(i + offset), error sqrt(sum d^2) / n <= 0.002."""
    n = 32 * 128
    x = (0.1 + 2 * np.cos(np.arange(n, dtype=np.float64))).astype(np.float32)
    y = c_dequantize(qtype, c_quantize(qtype, x), n)
    assert np.sqrt(np.sum((y.astype(np.float64) - x) ** 2)) / n <= 0.002


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@given(x=rows(256, max_blocks=4))
def test_k_quants_sound(qtype, x):
    """Our Q4_K/Q6_K quantizers: finite, zeros stay near zero, every value within a step of its level."""
    y = c_dequantize(qtype, c_quantize(qtype, x), x.size).astype(np.float64)
    assert np.isfinite(y).all()
    amax = np.abs(x.reshape(-1, 256)).max(axis=1, keepdims=True).astype(np.float64)
    # a level step is at most (range of a sub-block) / 15 (Q4_K) or amax / 31.5 (Q6_K), plus scale rounding
    step = amax * (2 / 15 if qtype == QT.Q4_K else 1 / 31) * 1.1 + 1e-7
    assert (np.abs(y - x).reshape(-1, 256) <= step).all()


@given(x=rows(32))
def test_mxfp4_sound(x):
    """Our MXFP4 quantizer: the scale d = 2^(e - 128) puts a block's largest magnitude in [8 d, 16 d) (the top
    level is 12 d: saturation costs at most the top step, 4 d), or is the smallest (e = 0) for a block below
    2^-125; every value takes the level nearest it."""
    q = c_quantize(QT.MXFP4, x).reshape(-1, 17)
    blocks = x.reshape(-1, 32).astype(np.float64)
    d = np.exp2(q[:, 0].astype(np.float64) - 128)[:, None]
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    tiny = (amax < 2.0**-125)[:, 0]
    assert (q[tiny, 0] == 0).all()
    # log2f may round up to the next power of two for an amax a few ulps below it: amax / d is then just below 8
    spans = (8 * d * (1 - 2.0**-16) <= amax) & (amax < 16 * d)
    assert spans[~tiny & (amax[:, 0] > 0)].all()
    levels = d[:, :, None] * np.array(gq.MXFP4.kvalues, np.float64)  # (blocks, 1, 16)
    nearest = np.abs(blocks[:, :, None] - levels).min(axis=2)
    y = c_dequantize(QT.MXFP4, q, x.size).reshape(-1, 32).astype(np.float64)
    assert (np.abs(blocks - y) <= nearest + 2.0**-24 * np.abs(blocks)).all()  # float32 rounds the errors compared


# --- dot products ---

def activation(qtype, x: np.ndarray) -> np.ndarray:
    return to_bytes(QT(lib.ggml_vec_dot_type(int(qtype))), x)


def dequant_any(qtype, data: np.ndarray, n: int) -> np.ndarray:
    return c_dequantize(qtype, data, n).astype(np.float64)


def term_bound(qtype, wq: np.ndarray, n: int) -> np.ndarray:
    """Per weight, the largest magnitude its block's parts can take: for Q4_1, Q4_K and Q6_K the level
    part and the min/offset part cancel inside the kernels, so rounding scales with them."""
    def f16(col):
        return col.copy().view(np.float16).astype(np.float64).ravel()

    if qtype == QT.Q4_1:
        b = wq.reshape(-1, 20)
        return np.repeat(np.abs(f16(b[:, 0:2])) * 15 + np.abs(f16(b[:, 2:4])), 32)
    if qtype == QT.Q4_K:
        b = wq.reshape(-1, 144)
        return np.repeat(np.abs(f16(b[:, 0:2])) * 63 * 15 + np.abs(f16(b[:, 2:4])) * 63, 256)
    if qtype == QT.Q6_K:  # levels q - 32: the SIMD path adds q and the -32 offset separately
        b = wq.reshape(-1, 210)
        return np.repeat(np.abs(f16(b[:, 208:210]))[:, None] * np.abs(b[:, 192:208].view(np.int8)) * 64.0, 16)
    return np.abs(dequant_any(qtype, wq, n))


@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: t.name)
@given(data=st.data())
def test_vec_dot_matches_float64(qtype, data):
    bs = 256 if qtype in (QT.Q4_K, QT.Q6_K) else 32
    w = data.draw(rows(bs, max_blocks=20 if bs == 32 else 5))
    seed = data.draw(st.integers(0, 2**32 - 1))
    w = np.clip(w, -6e4, 6e4)  # keep f16 scales and mins finite
    if bs == 1 or qtype in (QT.F16, QT.BF16):
        w = w[: data.draw(st.integers(1, w.size))]  # plain types: any length
    n = w.size
    x_scale = data.draw(st.sampled_from([1e-2, 1.0, 30.0]))
    x = (np.random.default_rng(seed).standard_normal(n) * x_scale).astype(np.float32)
    wq, xq = to_bytes(qtype, w), activation(qtype, x)
    vdt = QT(lib.ggml_vec_dot_type(int(qtype)))
    wd, xd = dequant_any(qtype, wq, n), dequant_any(vdt, xq, n)
    want = float(np.dot(wd, xd))
    # scale of the terms summed (for Q4_1 the minimum's share enters through an f16-rounded sum)
    terms = float((term_bound(qtype, wq, n) * np.abs(xd)).sum())
    ref = c_vec_dot(qtype, n, wq, xq, ref=True)
    fast = c_vec_dot(qtype, n, wq, xq, ref=False)
    assert abs(ref - want) <= 2e-3 * terms + 1e-30
    assert abs(fast - want) <= 2e-3 * terms + 1e-30
    assert abs(fast - ref) <= 3e-5 * terms + 1e-30  # SIMD vs scalar: only the summation order differs


def random_blocks(qtype, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Arbitrary block bytes (every level and scale/min code) with finite f16 scales in [-2, 2]; MXFP4: E8M0
    exponents 0..220 (scales 2^-128, subnormal, to 2^92; past that a row's dot products overflow), 0 and 1 often."""
    ts = block(qtype)[1]
    wq = rng.integers(0, 256, n_blocks * ts, dtype=np.uint8).reshape(n_blocks, ts)
    if qtype == QT.MXFP4:
        wq[:, 0] = np.where(rng.random(n_blocks) < 0.25, rng.integers(0, 2, n_blocks), rng.integers(0, 221, n_blocks))
        return wq.ravel()
    for off in {QT.Q6_K: [208], QT.Q4_K: [0, 2], QT.Q4_1: [0, 2]}.get(qtype, [0]):
        wq[:, off:off + 2] = np.float16(rng.uniform(-2, 2, n_blocks)).view(np.uint8).reshape(n_blocks, 2)
    return wq.ravel()


@pytest.mark.parametrize("qtype", FILE_QUANTS, ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 20), seed=st.integers(0, 2**32 - 1))
def test_vec_dot_random_blocks_simd_vs_scalar(qtype, n_blocks, seed):
    """Arbitrary block bytes (all levels, all scale/min codes) with finite small scales (MXFP4: extreme ones)."""
    bs = block(qtype)[0]
    if bs == 256:
        n_blocks = (n_blocks + 3) // 4
    n = n_blocks * bs
    rng = np.random.default_rng(seed)
    wq = random_blocks(qtype, n_blocks, rng)
    xq = activation(qtype, rng.standard_normal(n).astype(np.float32))
    wd, xd = dequant_any(qtype, wq, n), dequant_any(QT(lib.ggml_vec_dot_type(int(qtype))), xq, n)
    terms = float((term_bound(qtype, wq, n) * np.abs(xd)).sum())
    ref = c_vec_dot(qtype, n, wq, xq, ref=True)
    fast = c_vec_dot(qtype, n, wq, xq, ref=False)
    assert abs(ref - float(np.dot(wd, xd))) <= 2e-3 * terms
    assert abs(fast - ref) <= 3e-5 * terms


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_k_quant_vec_dot_vnni_equals_avx2(qtype, n_blocks, seed):
    """Q4_K's and Q6_K's VNNI row dots (where the CPU has AVX512-VNNI; elsewhere both tables hold the AVX2 ones) sum
    the same integers and take the same float steps as the AVX2 ones: bit for bit the same dot, on arbitrary
    blocks."""
    rng = np.random.default_rng(seed)
    n = n_blocks * 256
    wq = random_blocks(qtype, n_blocks, rng)
    xq = activation(qtype, rng.standard_normal(n).astype(np.float32))
    vnni = c_vec_dot(qtype, n, wq, xq, ref=False)
    try:
        lib.ggml_cpu_set_avx512(False)
        avx2 = c_vec_dot(qtype, n, wq, xq, ref=False)
    finally:
        lib.ggml_cpu_set_avx512(True)
    assert np.float32(vnni).tobytes() == np.float32(avx2).tobytes()


def test_vec_dot_zeros_and_empty():
    for t in WEIGHT_TYPES:
        bs = block(t)[0] if t not in (QT.F16, QT.BF16, QT.F32) else 32
        n = max(bs, 32)
        z = np.zeros(n, np.float32)
        assert c_vec_dot(t, n, to_bytes(t, z), activation(t, z + 1), ref=False) == 0.0
        assert c_vec_dot(t, 0, to_bytes(t, z), activation(t, z), ref=False) == 0.0


# --- axpy ---

@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda t: t.name)
@given(data=st.data())
def test_axpy_matches_float64(qtype, data):
    bs = 256 if qtype in (QT.Q4_K, QT.Q6_K) else 32
    w = np.clip(data.draw(rows(bs, max_blocks=20 if bs == 32 else 5)), -6e4, 6e4)
    if qtype in (QT.F32, QT.F16, QT.BF16):
        w = w[: data.draw(st.integers(1, w.size))]
    n = w.size
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    y0 = rng.standard_normal(n).astype(np.float32)
    a = float(np.float32(data.draw(st.sampled_from([0.0, -1.0, 0.37, 1e3]))))
    wq = to_bytes(qtype, w)
    row = dequant_any(qtype, wq, n)
    want = y0 + a * row
    tol = 4 * np.finfo(np.float32).eps * (np.abs(y0) + np.abs(a * row)) + 1e-37
    ref = c_axpy(qtype, n, y0, a, wq, ref=True)
    fast = c_axpy(qtype, n, y0, a, wq, ref=False)
    assert (np.abs(ref - want) <= tol).all()
    assert (np.abs(fast - want) <= tol).all()


AXPY_SIMD_TYPES = [QT.Q4_0, QT.Q8_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q6_K]  # quants_axpy_avx2.c: axpy and axpy4


def c_axpy_guarded(qtype, n: int, y: np.ndarray, a: float, row: np.ndarray, ref: bool) -> np.ndarray:
    """c_axpy on y inside a NaN-poisoned buffer: the kernel must leave the poison around [0, n) alone."""
    buf = np.full(n + 64, np.nan, np.float32)
    buf[32:32 + n] = y
    fn = lib.ggml_axpy_ref if ref else lib.ggml_axpy
    check(fn(int(qtype), n, ffi.from_buffer("float[]", buf[32:]), a, ffi.from_buffer(np.ascontiguousarray(row))))
    assert np.isnan(buf[:32]).all() and np.isnan(buf[32 + n:]).all()
    return buf[32:32 + n].copy()


@pytest.mark.parametrize("qtype", AXPY_SIMD_TYPES, ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 20), seed=st.integers(0, 2**32 - 1), a=st.sampled_from([0.0, -1.0, 0.37, 1e3]))
def test_axpy_random_blocks_simd_vs_scalar(qtype, n_blocks, seed, a):
    """Arbitrary blocks: SIMD and scalar axpy each within 4 roundings of float64 numpy on the dequantized
    row (the C dequantizer is bit-exact with gguf.quants), and within 4 roundings of each other."""
    rng = np.random.default_rng(seed)
    n = n_blocks * block(qtype)[0]
    wq = random_blocks(qtype, n_blocks, rng)
    y0 = rng.standard_normal(n).astype(np.float32)
    a = float(np.float32(a))
    row = dequant_any(qtype, wq, n)
    want = y0 + a * row
    tol = 4 * np.finfo(np.float32).eps * (np.abs(y0) + np.abs(a * row)) + 1e-37
    ref = c_axpy_guarded(qtype, n, y0, a, wq, ref=True)
    fast = c_axpy_guarded(qtype, n, y0, a, wq, ref=False)
    assert (np.abs(ref - want) <= tol).all()
    assert (np.abs(fast - want) <= tol).all()
    assert (np.abs(fast - ref) <= tol).all()


def c_axpy_group(fn, qtype, n: int, y: np.ndarray, a: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    """fn (ggml_axpy4 or ggml_axpy8_rounded) on y inside a NaN-poisoned buffer, which it must leave alone."""
    buf = np.full(n + 64, np.nan, np.float32)
    buf[32:32 + n] = y
    keep = [np.ascontiguousarray(r) for r in rows]
    ptrs = ffi.new(f"void *[{len(rows)}]", [ffi.from_buffer(r) for r in keep])
    check(fn(int(qtype), n, ffi.from_buffer("float[]", buf[32:]),
             ffi.from_buffer("float[]", np.ascontiguousarray(a, np.float32)), ptrs))
    assert np.isnan(buf[:32]).all() and np.isnan(buf[32 + n:]).all()
    return buf[32:32 + n].copy()


def c_axpy4(qtype, n: int, y: np.ndarray, a: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    return c_axpy_group(lib.ggml_axpy4, qtype, n, y, a, rows)


@pytest.mark.parametrize("qtype", [*AXPY_SIMD_TYPES, QT.F16, QT.BF16], ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 20), seed=st.integers(0, 2**32 - 1))
def test_axpy4_is_four_axpys(qtype, n_blocks, seed):
    """axpy4 gives bit for bit what four SIMD axpy calls give (F16 and BF16 rows of any length: their tails
    too), and stays within 4 roundings per row of the scalar axpy and of float64 numpy."""
    rng = np.random.default_rng(seed)
    n = n_blocks * max(block(qtype)[0], 32)
    if qtype in (QT.F16, QT.BF16):
        n += seed % 8
        rows = [to_bytes(qtype, rng.standard_normal(n).astype(np.float32)) for _ in range(4)]
    else:
        rows = [random_blocks(qtype, n_blocks * max(block(qtype)[0], 32) // block(qtype)[0], rng) for _ in range(4)]
    a = (rng.standard_normal(4) * np.array([1.0, 1e-3, 1e3, 0.0])).astype(np.float32)
    y0 = rng.standard_normal(n).astype(np.float32)
    got = c_axpy4(qtype, n, y0, a, rows)
    seq, seq_ref = y0.copy(), y0.copy()
    for r in range(4):
        seq = c_axpy(qtype, n, seq, float(a[r]), rows[r], ref=False)
        seq_ref = c_axpy(qtype, n, seq_ref, float(a[r]), rows[r], ref=True)
    assert_bits_equal(got, seq)
    deq = [dequant_any(qtype, r, n) for r in rows]
    want = y0 + sum(float(a[r]) * deq[r] for r in range(4))
    scale = np.abs(y0) + sum(np.abs(float(a[r]) * deq[r]) for r in range(4))
    tol = 8 * np.finfo(np.float32).eps * scale + 1e-37
    assert (np.abs(got - want) <= tol).all()
    assert (np.abs(got - seq_ref) <= tol).all()


def q4_K_unit_scales(wq: np.ndarray, n: int) -> np.ndarray:
    """d * sc of every value of Q4_K blocks, by gguf.quants: the blocks with every level 1, less every level 0."""
    b = wq.reshape(-1, 144).copy()
    b[:, 16:] = 0x11
    ones = gq.dequantize(b.ravel(), QT.Q4_K).astype(np.float64)
    b[:, 16:] = 0
    return (ones - gq.dequantize(b.ravel(), QT.Q4_K).astype(np.float64)).ravel()[:n]


def c_axpy8_rounded(qtype, n: int, y: np.ndarray, a: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    return c_axpy_group(lib.ggml_axpy8_rounded, qtype, n, y, a, rows)


def q5_0_unit_scales(wq: np.ndarray, n: int) -> np.ndarray:
    """|d| of every value of Q5_0 blocks (its levels' unit)."""
    return np.abs(wq.reshape(-1, 22)[:, :2].copy().view(np.float16).astype(np.float64)).repeat(32)[:n]


# the types with a rounded kernel: (values a block, the largest unsigned level, each value's unit d * sc or d)
ROUNDED = {QT.Q4_K: (256, 15, q4_K_unit_scales), QT.Q5_0: (32, 31, q5_0_unit_scales)}


@pytest.mark.parametrize("qtype", list(ROUNDED), ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 20), seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([1.0, 1e-3, 1e3]))
def test_axpy8_rounded_within_its_rounding(qtype, n_blocks, seed, spread):
    """Eight rows of arbitrary blocks on the integer units (Q5_0: 8 blocks a round, a ragged last one), against
    float64 numpy (gguf.quants' dequantizer): per value, within half a unit of each row's rounded coefficient
    (a * d * sc for Q4_K, a * d for Q5_0; the unit: the largest of the 8 in that group of 32 values / 127) times
    its unsigned level, plus float rounding; coefficients of very different sizes among the rows (spread)
    included, and a zero one. A fifth bit or an offset lost misses by far more."""
    block_values, top_level, unit_scales = ROUNDED[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = n_blocks if block_values == 32 else (n_blocks + 3) // 4
    n = n_blocks * block_values
    rows = [random_blocks(qtype, n_blocks, rng) for _ in range(8)]
    a = (rng.standard_normal(8) * spread ** rng.uniform(0, 1, 8)).astype(np.float32)
    a[seed % 8] = 0.0
    y0 = rng.standard_normal(n).astype(np.float32)
    got = c_axpy8_rounded(qtype, n, y0, a, rows)
    deq = [gq.dequantize(r, qtype).astype(np.float64).ravel() for r in rows]
    want = y0 + sum(float(a[r]) * deq[r] for r in range(8))
    coef = np.abs(np.stack([float(a[r]) * unit_scales(rows[r], n) for r in range(8)]))  # (8, n)
    unit = coef.reshape(8, -1, 32).max(axis=(0, 2)).repeat(32) / 127  # (n,) per group of 32
    scale = np.abs(y0) + sum(np.abs(float(a[r]) * deq[r]) for r in range(8)) + 8 * top_level * coef.max(axis=0)
    tol = 8 * (unit / 2) * top_level + 16 * np.finfo(np.float32).eps * scale + 1e-37
    assert (np.abs(got - want) <= tol).all()


@pytest.mark.parametrize("qtype", list(ROUNDED), ids=lambda t: t.name)
@given(n_blocks=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([1.0, 1e-3, 1e3]))
def test_axpy8_rounded_vnni_equals_avx2(qtype, n_blocks, seed, spread):
    """The AVX512-VNNI kernels (where the CPU has VNNI and VBMI; elsewhere both tables hold the AVX2 ones) round
    the same coefficients and sum the same integers as the AVX2 ones: bit for bit the same y, for rows of any
    length (Q5_0's ragged last group of blocks and its masked last block)."""
    block_values = ROUNDED[qtype][0]
    rng = np.random.default_rng(seed)
    n_blocks = n_blocks if block_values == 32 else (n_blocks + 3) // 4
    n = n_blocks * block_values
    rows = [random_blocks(qtype, n_blocks, rng) for _ in range(8)]
    a = (rng.standard_normal(8) * spread ** rng.uniform(0, 1, 8)).astype(np.float32)
    y0 = rng.standard_normal(n).astype(np.float32)
    vnni = c_axpy8_rounded(qtype, n, y0, a, rows)
    try:
        ggml.lib.ggml_cpu_set_avx512(False)
        avx2 = c_axpy8_rounded(qtype, n, y0, a, rows)
    finally:
        ggml.lib.ggml_cpu_set_avx512(True)
    assert_bits_equal(vnni, avx2)
    assert not np.array_equal(vnni, y0)


def test_axpy8_rounded_falls_back_where_no_kernel():
    """Types without an integer kernel give 8 axpy calls' result (what axpy_rows runs for them)."""
    rng = np.random.default_rng(3)
    n = 64
    rows = [random_blocks(QT.Q8_0, 2, rng) for _ in range(8)]
    a = rng.standard_normal(8).astype(np.float32)
    y0 = rng.standard_normal(n).astype(np.float32)
    seq = y0.copy()
    for r in range(8):
        seq = c_axpy(QT.Q8_0, n, seq, float(a[r]), rows[r], ref=False)
    assert_bits_equal(c_axpy8_rounded(QT.Q8_0, n, y0, a, rows), seq)


# --- errors ---

@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_n_not_multiple_of_block_raises(qtype):
    bs = block(qtype)[0]
    x = np.zeros(bs * 2, np.float32)
    buf = np.zeros(4096, np.uint8)
    y = np.zeros(bs * 2, np.float32)
    with pytest.raises(InvalidArgumentError, match="block size"):
        check(lib.ggml_quantize(int(qtype), ffi.from_buffer("float[]", x), ffi.from_buffer(buf), bs + 1))
    with pytest.raises(InvalidArgumentError, match="block size"):
        check(lib.ggml_dequantize(int(qtype), ffi.from_buffer(buf), ffi.from_buffer("float[]", y), bs - 1))
    res = ffi.new("float *")
    with pytest.raises(InvalidArgumentError, match="block size"):
        check(lib.ggml_vec_dot(int(qtype), bs + 3, res, ffi.from_buffer(buf), ffi.from_buffer(buf)))
    with pytest.raises(InvalidArgumentError, match="block size"):
        check(lib.ggml_axpy(int(qtype), 2 * bs - 1, ffi.from_buffer("float[]", y), 1.0, ffi.from_buffer(buf)))
    assert lib.ggml_row_size(int(qtype), bs + 1) == 0
    # rows of half a block: together whole blocks, so only the row length tells (it had written past the end)
    with pytest.raises(InvalidArgumentError, match="multiples of"):
        ggml.quantize(int(qtype), np.zeros((2, bs // 2), np.float32))


def test_invalid_and_unsupported_types():
    buf = np.zeros(64, np.uint8)
    x = np.zeros(16, np.float32)
    for bad in (4, 5, 31, 40, 1000):
        assert not lib.ggml_type_is_valid(bad)
        with pytest.raises(InvalidArgumentError):
            check(lib.ggml_quantize(bad, ffi.from_buffer("float[]", x), ffi.from_buffer(buf), 16))
    with pytest.raises(UnsupportedError):
        check(lib.ggml_quantize(int(QT.I32), ffi.from_buffer("float[]", x), ffi.from_buffer(buf), 16))
    res = ffi.new("float *")
    with pytest.raises(UnsupportedError):  # activation types are never dotted as weights
        check(lib.ggml_vec_dot(int(QT.Q8_K), 256, res, ffi.from_buffer(buf), ffi.from_buffer(buf)))
    with pytest.raises(InvalidArgumentError, match="null"):
        check(lib.ggml_quantize(int(QT.Q8_0), ffi.NULL, ffi.from_buffer(buf), 32))
