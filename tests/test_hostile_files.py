"""Issue 14: each malformed model file the issue found (and its kin) is one ModelFormatError line naming
the key or tensor, fast, never a raw exception, a hang, a memory blow-up or silent garbage.

The files are valid seeds with one targeted edit, made with the fuzzer's GGUF image (which writes any
inconsistent header); the oracle is the error's class and the words it must contain."""
from __future__ import annotations

import math
import struct
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.engine.driver import Model
from pyinfer.errors import InvalidArgumentError, ModelFormatError, PyInferError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from tools.fuzz.image import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT32,
    STRING,
    UINT32,
    UINT64,
    Entry,
    GGUFImage,
    enc_array,
    enc_scalar,
    enc_str,
    nested_array,
)
from tools.fuzz.seeds import make_seeds


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return make_seeds(str(tmp_path_factory.mktemp("seeds")), None)


def image(seeds, name: str = "llama-bpe") -> GGUFImage:
    with open(seeds[name], "rb") as f:
        return GGUFImage.parse(f.read())


def write(img: GGUFImage, tmp_path, name: str = "m.gguf") -> str:
    path = str(tmp_path / name)
    img.write(path)
    return path


def set_key(img: GGUFImage, key: str, vtype: int, value: bytes) -> GGUFImage:
    entry = img.entry(key)
    if entry is None:
        img.entries.append(Entry(key, vtype, value))
    else:
        entry.vtype, entry.value = vtype, value
    return img


def expect_error(path: str, *words: str, cls=ModelFormatError, seconds: float = 5.0) -> str:
    """Loading path raises cls (a ModelFormatError by default) whose one-line message holds words."""
    t0 = time.perf_counter()
    with pytest.raises(PyInferError) as exc:
        Model(path, n_ctx=32, n_threads=1).logits([1, 2, 3])
    assert time.perf_counter() - t0 < seconds
    text = str(exc.value)
    assert isinstance(exc.value, cls), f"{type(exc.value).__name__}: {text}"
    assert "\n" not in text and all(w in text for w in words), text
    return text


# ---- sizes of the wrong type or range: checked before anything is sized from them ----

WRONG_BLOCK_COUNTS = {
    "string": (STRING, enc_str("abc")),
    "array": (ARRAY, enc_array(UINT32, [2, 2])),
    "f32 inf": (FLOAT32, enc_scalar(FLOAT32, math.inf)),
    "f64 1e308": (FLOAT64, enc_scalar(FLOAT64, 1e308)),
    "1.5": (FLOAT32, enc_scalar(FLOAT32, 1.5)),
    "bool true": (BOOL, b"\x01"),
    "2^64-1": (UINT64, enc_scalar(UINT64, 2**64 - 1)),
    "0": (UINT32, enc_scalar(UINT32, 0)),
    "-1": (INT32, enc_scalar(INT32, -1)),
}


@pytest.mark.parametrize("case", list(WRONG_BLOCK_COUNTS))
def test_block_count_of_wrong_type_or_range(seeds, tmp_path, case):
    vtype, value = WRONG_BLOCK_COUNTS[case]
    path = write(set_key(image(seeds), "llama.block_count", vtype, value), tmp_path)
    expect_error(path, "llama.block_count", "expected an integer in [1, 4096]", seconds=2.0)


@pytest.mark.parametrize("delta", [-1, 1, 7])
def test_block_count_must_match_the_layers_present(seeds, tmp_path, delta):
    path = write(set_key(image(seeds), "llama.block_count", UINT32, enc_scalar(UINT32, 2 + delta)), tmp_path)
    expect_error(path, "llama.block_count", "the 2 layers the tensors hold")


def test_a_tensor_beyond_the_layers_is_refused(seeds, tmp_path):
    img = image(seeds)
    img.tensors[-1].name = "blk.999999.attn_q.weight"
    expect_error(write(img, tmp_path), "layers up to 999999 but none of layer 2")


@given(value=st.one_of(st.text(max_size=5), st.floats(allow_nan=True), st.lists(st.integers(0, 9), max_size=3),
                       st.booleans(), st.integers(2**32, 2**64 - 1)))
def test_size_keys_refuse_any_non_size(seeds, tmp_path_factory, value):
    """Every size key with a value that is not an integer in range: one line naming key and value."""
    key = "llama.embedding_length"
    if isinstance(value, bool):
        vtype, raw = BOOL, bytes([value])
    elif isinstance(value, int):
        vtype, raw = UINT64, enc_scalar(UINT64, value)
    elif isinstance(value, float):
        vtype, raw = FLOAT64, enc_scalar(FLOAT64, value)
    elif isinstance(value, str):
        vtype, raw = STRING, enc_str(value)
    else:
        vtype, raw = ARRAY, enc_array(UINT32, value)
    path = write(set_key(image(seeds), key, vtype, raw), tmp_path_factory.mktemp("k"))
    expect_error(path, key, "expected")


def test_architecture_as_an_array(seeds, tmp_path):
    path = write(set_key(image(seeds), "general.architecture", ARRAY, enc_array(STRING, ["llama"])), tmp_path)
    expect_error(path, "general.architecture", "expected a string")


def test_heads_must_divide_the_embedding(seeds, tmp_path):
    img = set_key(image(seeds), "llama.attention.head_count", UINT32, enc_scalar(UINT32, 3))
    img.entries = [e for e in img.entries if e.key != "llama.attention.key_length"]
    expect_error(write(img, tmp_path), "embedding_length 64 is not a multiple of llama.attention.head_count 3")


@pytest.mark.parametrize("key,value", [("llama.rope.freq_base", math.nan), ("llama.rope.freq_base", -1.0),
                                       ("llama.attention.layer_norm_rms_epsilon", math.inf)])
def test_rope_and_epsilon_finite_and_positive(seeds, tmp_path, key, value):
    path = write(set_key(image(seeds), key, FLOAT32, enc_scalar(FLOAT32, value)), tmp_path)
    expect_error(path, key, "a finite number")


# ---- structure: nesting, duplicates, counts, strings ----

def test_deeply_nested_array_is_refused_without_recursion(seeds, tmp_path):
    path = write(set_key(image(seeds), "general.name", ARRAY, nested_array(500)), tmp_path)
    expect_error(path, "general.name", "nested more than 4 deep")


def test_nested_array_claiming_huge_counts(seeds, tmp_path):
    value = struct.pack("<IQ", ARRAY, 2**62) + nested_array(2)[12:]
    expect_error(write(set_key(image(seeds), "general.name", ARRAY, value), tmp_path), "truncated")


def test_duplicated_key_is_refused(seeds, tmp_path):
    img = image(seeds)
    img.entries.append(Entry("llama.block_count", UINT32, enc_scalar(UINT32, 1)))
    expect_error(write(img, tmp_path), "llama.block_count appears twice")


def test_duplicated_tensor_name_is_refused(seeds, tmp_path):
    img = image(seeds)
    img.tensors[3].name = img.tensors[2].name
    expect_error(write(img, tmp_path), f"tensor {img.tensors[2].name} appears twice")


@pytest.mark.parametrize("delta", [-1, 1])
def test_tensor_count_off_by_one(seeds, tmp_path, delta):
    img = image(seeds)
    img.n_tensors = len(img.tensors) + delta
    expect_error(write(img, tmp_path), "not a valid GGUF file")


def test_one_tensor_too_few_leaves_bytes_the_header_does_not_describe(seeds, tmp_path):
    img = image(seeds)
    img.tensors.pop()
    expect_error(write(img, tmp_path), "after the last tensor's data", "wrong tensor count")


@pytest.mark.parametrize("where", ["key", "tensor"])
def test_names_with_control_characters_keep_the_message_one_line(seeds, tmp_path, where):
    """A key of valid UTF-8 holding a newline made a two-line error."""
    img = image(seeds)
    if where == "key":
        img.entry("general.name").key = "general.na\nme"
    else:
        img.tensors[3].name = "blk.0.x\ny"
    expect_error(write(img, tmp_path), "not printable")


def test_string_that_is_not_utf8(seeds, tmp_path):
    path = write(set_key(image(seeds), "general.name", STRING, enc_str(b"\xff\xfe")), tmp_path)
    expect_error(path, "general.name", "not UTF-8")


# ---- tensor layout ----

def test_tensor_with_2_63_elements_is_refused(seeds, tmp_path):
    img = image(seeds)
    img.tensors[-1].ne = (2**63, 1)
    expect_error(write(img, tmp_path), img.tensors[-1].name, "below 2^63 elements")


@pytest.mark.parametrize("shift", ["overlap", "+alignment", "-alignment", "misaligned", "beyond"])
def test_tensor_offsets_overlapping_or_shifted(seeds, tmp_path, shift):
    img = image(seeds)
    t, prev = img.tensors[5], img.tensors[4]
    t.offset = {"overlap": prev.offset, "+alignment": t.offset + 32, "-alignment": t.offset - 32,
                "misaligned": t.offset + 1, "beyond": len(img.data) + 64}[shift]
    expect_error(write(img, tmp_path), f"tensor {t.name} data is at offset {t.offset}, expected")


@pytest.mark.parametrize("new_type", [30, 25, 99])  # BF16 and I16 have F16's size; 99 is no type
def test_swapped_tensor_type_never_gives_silent_non_finite_logits(seeds, tmp_path, new_type):
    """A type swap whose bytes still fit loads only if the engine can run it; what it computes is finite
    or reported (the bytes of an F16 read as BF16 can be NaN)."""
    img = image(seeds, "qwen2-power")
    target = next(t for t in img.tensors if t.type == 1 and len(t.ne) == 2)
    target.type = new_type
    path = write(img, tmp_path)
    try:
        logits = Model(path, n_ctx=32, n_threads=1).logits([1, 2, 3])
    except PyInferError as exc:
        assert "\n" not in str(exc)
    else:
        assert np.isfinite(logits).all()


def test_norm_of_another_type_than_f32(seeds, tmp_path):
    img = image(seeds)
    norm = next(t for t in img.tensors if t.name == "output_norm.weight")
    norm.type = 26  # I32: same size as F32
    expect_error(write(img, tmp_path), "output_norm.weight has type I32", cls=UnsupportedError)


def test_nan_weights_are_reported_not_returned(seeds, tmp_path):
    img = image(seeds, "opt-power")
    t = next(t for t in img.tensors if t.name == "output_norm.weight")
    data = bytearray(img.data)
    data[t.offset:t.offset + 4] = struct.pack("<f", math.nan)
    img.data = bytes(data)
    expect_error(write(img, tmp_path), "non-finite logits")


# ---- tokenizer metadata: built only from checked arrays ----

def _tokens(img: GGUFImage) -> list[str]:
    return img.entry("tokenizer.ggml.tokens").decoded()


def test_tokens_missing(seeds, tmp_path):
    img = image(seeds)
    img.entries = [e for e in img.entries if e.key != "tokenizer.ggml.tokens"]
    expect_error(write(img, tmp_path), "tokenizer.ggml.tokens")


def test_tokens_cut_by_one(seeds, tmp_path):
    img = image(seeds)
    img.entry("tokenizer.ggml.tokens").value = enc_array(STRING, _tokens(img)[:-1])
    expect_error(write(img, tmp_path), "tokenizer.ggml.token_type has 300 entries for the 299")


def test_merge_out_of_vocabulary_is_one_line(seeds, tmp_path):
    img = image(seeds)
    merges = img.entry("tokenizer.ggml.merges")
    merges.value = enc_array(STRING, [*merges.decoded(), "zz qq"])
    expect_error(write(img, tmp_path), "tokenizer.ggml.merges", "zz")


def test_merges_as_integers(seeds, tmp_path):
    img = image(seeds)
    img.entry("tokenizer.ggml.merges").value = enc_array(UINT32, [1, 2, 3])
    expect_error(write(img, tmp_path), "tokenizer.ggml.merges[0] = 1", "expected a string")


@pytest.mark.parametrize("value", ["n_vocab", 2**32 - 1])
def test_special_id_beyond_the_vocabulary(seeds, tmp_path, value):
    img = image(seeds, "llama-spm")
    n = len(_tokens(img))
    value = n if value == "n_vocab" else value
    path = write(set_key(img, "tokenizer.ggml.unknown_token_id", UINT32, enc_scalar(UINT32, value)), tmp_path)
    expect_error(path, f"tokenizer.ggml.unknown_token_id = {value}", f"below the {n} tokens")


def test_byte_token_that_is_not_hex(seeds, tmp_path):
    img = image(seeds, "llama-spm")
    tokens = _tokens(img)
    tokens[3 + 0x41] = "<0xZZ>"
    img.entry("tokenizer.ggml.tokens").value = enc_array(STRING, tokens)
    expect_error(write(img, tmp_path), "tokenizer.ggml.tokens[68] = '<0xZZ>'", "BYTE")


def test_token_type_out_of_range(seeds, tmp_path):
    img = image(seeds)
    types = img.entry("tokenizer.ggml.token_type").decoded()
    types[7] = 9
    img.entry("tokenizer.ggml.token_type").value = enc_array(INT32, types)
    expect_error(write(img, tmp_path), "tokenizer.ggml.token_type[7] = 9")


def test_overlong_token(seeds, tmp_path):
    img = image(seeds, "llama-spm")
    tokens = _tokens(img)
    tokens[-1] = "a" * 100_000
    img.entry("tokenizer.ggml.tokens").value = enc_array(STRING, tokens)
    expect_error(write(img, tmp_path), "tokenizer.ggml.tokens[299]", "at most 1024 characters", seconds=2.0)


# ---- pyinfer.* keys ----

@pytest.mark.parametrize("value,words", [
    ((ARRAY, enc_array(STRING, ["a", "b"])), "pyinfer.sparsity.thresholds[0] = 'a'"),
    ((FLOAT32, enc_scalar(FLOAT32, 0.5)), "pyinfer.sparsity.thresholds = 0.5"),
    ((ARRAY, enc_array(FLOAT32, [math.nan, 0.0])), "pyinfer.sparsity.thresholds[0] = nan"),
    ((ARRAY, enc_array(FLOAT32, [0.1])), "pyinfer.sparsity.thresholds has 1 values for 2 layers"),
])
def test_sparsity_thresholds(seeds, tmp_path, value, words):
    path = write(set_key(image(seeds, "sparse"), "pyinfer.sparsity.thresholds", *value), tmp_path)
    expect_error(path, words)


# ---- a GGUFFile of every seed still loads (the checks refuse no valid file) ----

@pytest.mark.parametrize("name", ["llama-bpe", "qwen2-power", "opt-power", "llama-spm", "sparse"])
def test_seeds_load(seeds, name):
    assert GGUFFile(seeds[name]).tensors
    assert np.isfinite(Model(seeds[name], n_ctx=32, n_threads=1).logits([1, 2, 3])).all()


# ---- API arguments ----

@pytest.fixture(scope="module")
def tiny(seeds):
    return Model(seeds["llama-bpe"], n_ctx=32, n_threads=1)


@given(ids=st.one_of(st.lists(st.integers(min_value=300), min_size=1, max_size=3),
                     st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                     st.lists(st.floats(), min_size=1, max_size=3), st.lists(st.booleans(), min_size=1, max_size=3),
                     st.just([]), st.text(max_size=3), st.just([[1, 2]])))
def test_token_ids_are_checked(tiny, ids):
    with pytest.raises(InvalidArgumentError) as exc:
        tiny.logits(ids)
    assert "token ids" in str(exc.value) and "\n" not in str(exc.value)


def test_token_id_2_31_names_the_range(tiny):
    with pytest.raises(InvalidArgumentError, match=r"must be in \[0, 299\], not 2147483648"):
        tiny.logits([2**31])


@pytest.mark.parametrize("kwargs", [{"n_ctx": -1}, {"n_ctx": 2**40}, {"n_batch": 0}, {"n_threads": -2},
                                    {"n_ctx": 1.5}, {"sparsity_threshold": math.nan}, {"n_gpu_layers": "all"}])
def test_model_arguments_are_checked(seeds, kwargs):
    with pytest.raises(InvalidArgumentError):
        Model(seeds["llama-bpe"], **kwargs)


@pytest.mark.parametrize("text", ["\udcff", "ok \ud800 no", b"bytes"])
def test_tokenize_refuses_text_that_is_not_unicode(tiny, text):
    with pytest.raises(InvalidArgumentError):
        tiny.tokenize(text)


def test_detokenize_checks_ids(tiny):
    with pytest.raises(InvalidArgumentError):
        tiny.detokenize([-1])
    assert tiny.detokenize(tiny.tokenize("Hello", add_special=False)) == "Hello"


@pytest.mark.parametrize("shape", [(2**63,), (2**62, 2**62), (2**31, 2**31, 4), (-1, 4), (2.0, 4)])
def test_tensor_sizes_beyond_int64_are_refused_not_wrapped(shape):
    """A product of sizes past 2^63 wrapped to a small allocation in the C library."""
    from pyinfer.native import ggml

    with pytest.raises(InvalidArgumentError):
        ggml.Context(1 << 16).new_tensor(ggml.F32, shape)


# ---- valid files llama.cpp loads stay loadable ----

def test_unsupported_architecture_with_its_own_key_shapes_is_unsupported_not_malformed(seeds, tmp_path):
    """OpenELM keeps per-layer arrays in feed_forward_length: valid for its architecture, which pyinfer
    does not run; the answer is 'unsupported', not a schema violation of a row meant for others."""
    img = set_key(image(seeds), "general.architecture", STRING, enc_str("openelm"))
    img.entries.append(Entry("openelm.feed_forward_length", ARRAY, enc_array(UINT32, [128, 256])))
    expect_error(write(img, tmp_path), "unsupported architecture 'openelm'", cls=UnsupportedError)


def test_linear_rope_factor_zero_means_no_scaling_as_in_llama_cpp(seeds, tmp_path):
    plain = Model(seeds["llama-bpe"], n_ctx=32, n_threads=1).logits([1, 2, 3, 4])
    img = set_key(image(seeds), "llama.rope.scaling.type", STRING, enc_str("linear"))
    path = write(set_key(img, "llama.rope.scaling.factor", FLOAT32, enc_scalar(FLOAT32, 0.0)), tmp_path)
    np.testing.assert_array_equal(Model(path, n_ctx=32, n_threads=1).logits([1, 2, 3, 4]), plain)
