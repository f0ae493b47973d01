"""The metadata schema's kinds and relations, against plain Python oracles."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.errors import ModelFormatError
from pyinfer.formats.gguf_schema import Array, Float, Int, Str, arch_key, check_layer_names, check_metadata

ANY = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(), st.text(max_size=8),
                st.none(), st.lists(st.integers(0, 3), max_size=2))
KINDS = [Int(1, 100), Int(0, 2**64 - 1), Float(), Float(positive=True), Float(0.0, 1.0), Float(finite=False),
         Str(4), Int(1, 2**20, power_of_two=True)]


def oracle(kind, v) -> bool:
    """What each kind accepts, written out independently of its implementation."""
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(kind, Int):
        return (isinstance(v, int) and not isinstance(v, bool) and kind.lo <= v <= kind.hi
                and (not kind.power_of_two or bin(v).count("1") == 1))
    if isinstance(kind, Float):
        if not number or (isinstance(v, int) and abs(v) > 1e308):
            return False
        x = float(v)
        if math.isnan(x) or (kind.finite and math.isinf(x)):
            return False
        return kind.lo <= x <= kind.hi and (x > 0 or not kind.positive)
    return isinstance(v, str) and len(v) <= kind.max_len


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.expected)
@given(values=st.one_of(st.lists(ANY, max_size=6), st.lists(st.floats(allow_nan=True), max_size=6),
                       st.lists(st.integers(-(2**70), 2**70), max_size=6), st.lists(st.text(max_size=6), max_size=6)))
def test_kinds_agree_with_the_oracle_one_by_one_and_over_arrays(kind, values):
    assert [kind.ok(v) for v in values] == [oracle(kind, v) for v in values]
    assert kind.all_ok(values) == all(oracle(kind, v) for v in values)
    assert Array(kind, min_len=0).ok(values) == all(oracle(kind, v) for v in values)


@given(values=st.lists(st.integers(-5, 5), min_size=1, max_size=8))
def test_array_error_names_the_first_bad_index(values):
    kind = Array(Int(0, 5))
    bad = [i for i, v in enumerate(values) if v < 0]
    if not bad:
        assert kind.check("k", values) == values
        return
    with pytest.raises(ModelFormatError, match=rf"^k\[{bad[0]}\] = {values[bad[0]]}: expected an integer in \[0, 5\]$"):
        kind.check("k", values)


@given(layers=st.sets(st.integers(0, 40), max_size=12), block_count=st.integers(1, 50))
def test_layer_names_must_be_exactly_the_block_count(layers, block_count):
    names = [f"blk.{i}.attn_q.weight" for i in layers] + ["token_embd.weight"]
    if layers == set(range(block_count)):
        check_layer_names(block_count, names, "x.block_count")
    else:
        with pytest.raises(ModelFormatError):
            check_layer_names(block_count, names, "x.block_count")


@pytest.mark.parametrize("name", ["blk.01.attn_q.weight", "blk.x.attn_q.weight", "blk.\u00b2.attn_q.weight",
                                  "blk.99999999999.attn_q.weight"])
def test_layer_numbers_are_plain_decimals(name):
    with pytest.raises(ModelFormatError, match="not a layer number"):
        check_layer_names(1, ["blk.0.attn_q.weight", name], "x.block_count")


def test_metadata_relations():
    tokens = ["a", "b", "c"]
    check_metadata({"general.architecture": "llama", "llama.vocab_size": 3, "tokenizer.ggml.tokens": tokens,
                    "tokenizer.ggml.bos_token_id": 2})
    for bad, words in [({"llama.vocab_size": 4}, "llama.vocab_size = 4"),
                       ({"tokenizer.ggml.bos_token_id": 3}, "below the 3 tokens"),
                       ({"tokenizer.ggml.scores": [0.0, 1.0]}, "scores has 2 entries for the 3")]:
        with pytest.raises(ModelFormatError, match=words):
            check_metadata({"general.architecture": "llama", "tokenizer.ggml.tokens": tokens, **bad})


def test_unknown_keys_are_left_alone_but_reading_one_needs_a_row():
    check_metadata({"general.architecture": "llama", "llama.something_new": "anything", "vendor.key": [1, "x"]})
    assert arch_key("llama", "block_count") == "llama.block_count"
    with pytest.raises(LookupError, match="ARCH_KEYS"):
        arch_key("llama", "something_new")
