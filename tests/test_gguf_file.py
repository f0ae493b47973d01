"""GGUFFile: loading, metadata/tensor access, and one-line errors for broken files."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from op_harness import compute, tensor

from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.model_config import SUPPORTED_ARCHS
from pyinfer.models import BUILDERS, builder_for
from pyinfer.native import ggml

D, FF, NH, NKV, HD, NV = 32, 64, 2, 1, 16, 40


def _tensors(layout: str, ffn_type: Q = Q.Q8_0) -> dict[str, tuple[tuple[int, ...], Q]]:
    """name -> (numpy shape, type) of a 1-layer llama."""
    down = ("blk.0.ffn_down_t.weight", (FF, D)) if layout == "down_t" else ("blk.0.ffn_down.weight", (D, FF))
    return {
        "token_embd.weight": ((NV, D), Q.F32), "output_norm.weight": ((D,), Q.F32), "output.weight": ((NV, D), Q.F16),
        "blk.0.attn_norm.weight": ((D,), Q.F32), "blk.0.attn_q.weight": ((NH * HD, D), Q.F32),
        "blk.0.attn_k.weight": ((NKV * HD, D), Q.F32), "blk.0.attn_v.weight": ((NKV * HD, D), Q.F16),
        "blk.0.attn_output.weight": ((D, NH * HD), Q.F32), "blk.0.ffn_norm.weight": ((D,), Q.F32),
        "blk.0.ffn_gate.weight": ((FF, D), ffn_type), "blk.0.ffn_up.weight": ((FF, D), ffn_type),
        down[0]: (down[1], ffn_type),
    }


def write_gguf(path, layout="down_t", arch="llama", drop_tensor=None, bad_shape=None, drop_key=None,
               layout_key=None, ffn_type=Q.Q8_0):
    """A small valid GGUF (or one with exactly one defect); returns name -> float32 values written."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    keys = {f"{arch}.context_length": 128, f"{arch}.embedding_length": D, f"{arch}.block_count": 1,
            f"{arch}.feed_forward_length": FF, f"{arch}.attention.head_count": NH,
            f"{arch}.attention.head_count_kv": NKV}
    for k, v in keys.items():
        if k != drop_key:
            w.add_uint32(k, v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(NV)])
    w.add_string("tokenizer.ggml.model", "gpt2")
    if layout == "down_t" or layout_key:
        w.add_uint32("pyinfer.format_version", 1)
        w.add_string("pyinfer.ffn_layout", layout_key or layout)
    values = {}
    for name, (shape, qtype) in _tensors(layout, ffn_type).items():
        if name == drop_tensor:
            continue
        if name == bad_shape:
            shape = (shape[0] * 2, *shape[1:])
        x = rng.standard_normal(shape).astype(np.float32)
        values[name] = x
        data = quantize(x, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "m.gguf"
    return path, write_gguf(path)


@pytest.mark.parametrize("layout", ["down_t", "down"])
def test_valid_file(tmp_path, layout):
    path = tmp_path / "m.gguf"
    values = write_gguf(path, layout)
    g = GGUFFile(path)
    assert g.ffn_layout == layout and g.version == 3
    assert g.metadata["llama.embedding_length"] == D and isinstance(g.metadata["llama.embedding_length"], int)
    assert isinstance(g.metadata["llama.rope.freq_base"], float)
    assert g.metadata["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    cfg = g.config
    assert (cfg.n_vocab, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot) == \
        (NV, D, FF, NH, NKV, HD, HD)
    assert not cfg.tied_embeddings and cfg.ffn_kind == "swiglu" and cfg.rope_mode == "normal"
    reader = GGUFReader(path)
    for t in reader.tensors:
        info = g.tensors[t.name]
        assert info.type == t.tensor_type and info.ne == tuple(int(n) for n in t.shape)
        assert info.data.dtype == np.uint8 and info.data.nbytes == t.n_bytes
        want = dequantize(quantize(values[t.name], Q(info.type)), Q(info.type))
        got = g.dequantize(t.name)
        assert got.dtype == np.float64 and got.shape == values[t.name].shape
        np.testing.assert_array_equal(got, want)


def test_mxfp4_tensors_load_and_multiply(tmp_path):
    """FFN matrices of MXFP4 (gpt-oss's experts' type) quantized and written by gguf: read as gguf reads them, and
    the engine's mul_mat of their bytes matches float64."""
    path = tmp_path / "m.gguf"
    write_gguf(path, ffn_type=Q.MXFP4)
    g = GGUFFile(path)
    info = g.tensors["blk.0.ffn_up.weight"]
    assert info.type == Q.MXFP4 and info.data.nbytes == FF * D // 32 * 17
    w64 = g.dequantize("blk.0.ffn_up.weight")  # gguf.quants' dequantizer
    ctx = ggml.Context(1 << 20)
    w = ctx.new_tensor(info.type, (FF, D))
    w.set_data(info.data)
    np.testing.assert_array_equal(ggml.dequantize(w.type, w.raw(), FF * D).reshape(FF, D), w64)
    x = np.random.default_rng(1).standard_normal((3, D)).astype(np.float32)
    (y,) = compute(ctx, [ctx.mul_mat(w, tensor(ctx, x))], 2)
    x_seen = ggml.dequantize(ggml.Q8_0, ggml.quantize(ggml.Q8_0, x), x.size).reshape(x.shape)  # the dot's activations
    bound = np.abs(x) @ np.abs(w64).T
    assert np.all(np.abs(y - x_seen.astype(np.float64) @ w64.T) <= 1e-5 * bound + 1e-6)
    want = x.astype(np.float64) @ w64.T
    assert np.linalg.norm(y - want) <= 0.02 * np.linalg.norm(want)


def _expect(path, cls=ModelFormatError, words=""):
    with pytest.raises(cls) as exc:
        GGUFFile(path)
    text = str(exc.value)
    assert "\n" not in text and words in text, text


def test_missing_file(tmp_path):
    _expect(tmp_path / "nope.gguf", words="no such file")


def test_directory(tmp_path):
    _expect(tmp_path, words="not a regular file")


@pytest.mark.parametrize("content", [b"", b"GGUF", b"garbage" * 100, os.urandom(4096)])
def test_garbage(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    _expect(path, words="not a valid GGUF")


@pytest.mark.parametrize("offset,raw", [(0, b"GGML"), (4, struct.pack("<I", 1)), (4, struct.pack("<I", 4))])
def test_bad_magic_or_version(good, offset, raw):
    path, _ = good
    data = bytearray(path.read_bytes())
    data[offset:offset + len(raw)] = raw
    path.write_bytes(bytes(data))
    _expect(path, words="not a valid GGUF")


def _data_end(path) -> int:
    return max(int(t.data_offset) + int(t.n_bytes) for t in GGUFReader(path).tensors)


@settings(max_examples=30, deadline=None)
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated(tmp_path_factory, frac):
    path = tmp_path_factory.mktemp("t") / "m.gguf"
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:int(frac * _data_end(path))])
    with pytest.raises(ModelFormatError) as exc:
        GGUFFile(path)
    assert "\n" not in str(exc.value)


def test_truncated_in_last_tensor_names_it(good):
    path, _ = good
    end = _data_end(path)
    os.truncate(path, end - 1)
    _expect(path, words="truncated")


def test_unknown_tensor_type(good):
    path, _ = good
    reader = GGUFReader(path, "r+")
    reader.tensors[0].field.parts[4][0] = 99  # the type id, written through the mmap
    reader.data.flush()
    del reader
    _expect(path, words="unknown type 99")


def test_missing_tensor(tmp_path):
    write_gguf(tmp_path / "m.gguf", drop_tensor="blk.0.attn_k.weight")
    _expect(tmp_path / "m.gguf", words="missing tensor blk.0.attn_k.weight")


def test_bad_shape(tmp_path):
    write_gguf(tmp_path / "m.gguf", bad_shape="blk.0.attn_q.weight")
    _expect(tmp_path / "m.gguf", words="blk.0.attn_q.weight has shape [32, 64], expected [32, 32]")


def test_missing_key(tmp_path):
    write_gguf(tmp_path / "m.gguf", drop_key="llama.block_count")
    _expect(tmp_path / "m.gguf", words="llama.block_count")


def test_unsupported_arch(tmp_path):
    """One line naming every architecture there is a graph builder for (the two lists are one)."""
    assert SUPPORTED_ARCHS == tuple(sorted(BUILDERS))
    write_gguf(tmp_path / "m.gguf", arch="phi3")
    _expect(tmp_path / "m.gguf", UnsupportedError, "architecture 'phi3'; supported: " + ", ".join(SUPPORTED_ARCHS))
    with pytest.raises(UnsupportedError, match="supported: " + ", ".join(SUPPORTED_ARCHS)):
        builder_for("phi3")


def test_layout_key_must_match(tmp_path):
    write_gguf(tmp_path / "m.gguf", layout="down", layout_key="down_t")
    _expect(tmp_path / "m.gguf", words="pyinfer.ffn_layout says 'down_t' but the tensors are 'down'")
