"""Mutation families of GGUF files: each takes the image of a valid seed and a seeded generator and
returns a broken (or, by chance, still valid) file as bytes. Families follow the failures issue 14
found: truncation, magic/version, counts, lengths, value types and values of the keys pyinfer reads,
duplicates, missing entries, tensor types/dims/offsets, nesting, tokenizer arrays, pyinfer.* keys,
non-finite tensor data, and random bit flips."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES

from pyinfer.formats import gguf_schema
from tools.fuzz.image import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT32,
    INT64,
    INT_TYPES,
    STRING,
    UINT8,
    UINT32,
    UINT64,
    Entry,
    GGUFImage,
    enc_array,
    enc_scalar,
    enc_str,
    nested_array,
)

Rng = np.random.Generator
EDGE_INTS = [0, 1, 2, 3, 7, 31, 32, 63, 64, 255, 256, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53,
             2**63 - 1, 2**63, 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-30, 0.5, 1.5, -1.0, 1e30, 3.4e38, 1e308, math.inf, -math.inf, math.nan]
ODD_STRINGS = ["", "abc", "llama3", "gpt5", "bert", "x" * 70, "\u2581", "<0xZZ>", "ü" * 3, "a" * 5000,
               "{{ 1 / 0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{% for m in messages %"]
# types whose bytes per element are the same, so that a swap keeps every size (F16/BF16/I16, F32/I32, ...)
SAME_SIZE_TYPES = [[1, 30, 25], [0, 26], [27, 28], [2, 20]]


def pick(rng: Rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _read_keys(img: GGUFImage) -> list[Entry]:
    """The entries pyinfer reads (those with a schema row), or all when none."""
    arch = next((e.decoded() for e in img.entries if e.key == "general.architecture"), None)
    arch = arch if isinstance(arch, str) else None
    read = [e for e in img.entries if gguf_schema.kind_of(e.key, arch) is not None]
    return read or img.entries


def _target(img: GGUFImage, rng: Rng) -> Entry:
    """An entry to mutate: mostly one pyinfer reads."""
    return pick(rng, _read_keys(img) if rng.random() < 0.85 else img.entries)


def _random_value(rng: Rng, etype_hint: int | None = None) -> tuple[int, bytes]:
    """(type, encoded value) of a random type with an edge value."""
    vtype = pick(rng, [UINT32, INT32, UINT64, INT64, FLOAT32, FLOAT64, BOOL, STRING, ARRAY, UINT8])
    if vtype == STRING:
        return vtype, enc_str(pick(rng, ODD_STRINGS))
    if vtype == ARRAY:
        etype = pick(rng, [UINT32, INT32, FLOAT32, STRING, BOOL])
        n = int(rng.integers(0, 5))
        values = ([pick(rng, ODD_STRINGS) for _ in range(n)] if etype == STRING else [True] * n if etype == BOOL
                  else [float(rng.standard_normal()) for _ in range(n)] if etype == FLOAT32
                  else [int(rng.integers(0, 1000)) for _ in range(n)])
        return vtype, enc_array(etype, values)
    return vtype, _edge_scalar(rng, vtype)


def _edge_scalar(rng: Rng, vtype: int) -> bytes:
    if vtype in (FLOAT32, FLOAT64):
        v = pick(rng, EDGE_FLOATS)
        return enc_scalar(vtype, v if vtype == FLOAT64 or abs(v) < 3.5e38 or math.isinf(v) or math.isnan(v)
                          else math.inf)
    if vtype == BOOL:
        return bytes([pick(rng, [0, 1, 2, 255])])
    bits = 8 * struct.calcsize({UINT8: "B", UINT32: "I", INT32: "i", UINT64: "Q", INT64: "q"}.get(vtype, "I"))
    signed = vtype in (INT32, INT64)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    v = pick(rng, EDGE_INTS + [-1, -(2**31)])
    return enc_scalar(vtype, min(max(v, lo), hi))


# ---------------------------------------------------------------------------------------------------
# families: (image, rng) -> bytes


def truncate(img: GGUFImage, rng: Rng) -> bytes:
    raw = img.header() + img.data
    cut = int(rng.integers(0, len(img.header()) + 64)) if rng.random() < 0.6 else int(rng.integers(0, len(raw)))
    return raw[:cut]


def magic_version(img: GGUFImage, rng: Rng) -> bytes:
    if rng.random() < 0.4:
        img.magic = pick(rng, [b"GGUF"[::-1], b"GGML", b"ggjt", b"\0\0\0\0", bytes(rng.integers(0, 256, 4))])
    else:
        img.version = pick(rng, [0, 1, 2, 4, 255, 2**31, 2**32 - 1])
    return img.header() + img.data


def counts(img: GGUFImage, rng: Rng) -> bytes:
    value = pick(rng, [-2, -1, 1, 2, 0, 2**20, 2**32, 2**63, 2**64 - 1])
    which = "n_kv" if rng.random() < 0.5 else "n_tensors"
    n = len(img.entries) if which == "n_kv" else len(img.tensors)
    setattr(img, which, value if value >= 2**20 or value == 0 else max(0, n + value))
    return img.header() + img.data


def lengths(img: GGUFImage, rng: Rng) -> bytes:
    """A length or count field that lies: a key, a string value, an array count or a tensor name."""
    lie = pick(rng, [1, -1, 7, 2**31, 2**32, 2**62, 2**63, 2**64 - 1])
    where = rng.random()
    if where < 0.35:
        e = _target(img, rng)
        if e.vtype == STRING:
            n = struct.unpack_from("<Q", e.value)[0]
            e.value = struct.pack("<Q", _lie(n, lie)) + e.value[8:]
        elif e.vtype == ARRAY:
            etype, n = struct.unpack_from("<IQ", e.value)
            e.value = struct.pack("<IQ", etype, _lie(n, lie)) + e.value[12:]
        else:
            e.vtype, e.value = STRING, enc_str("abc", _lie(3, lie))
        return img.header() + img.data
    head = bytearray(img.header())
    names = [e.key for e in img.entries] if where < 0.7 else [t.name for t in img.tensors]
    name = pick(rng, names).encode()
    at = head.find(struct.pack("<Q", len(name)) + name)
    head[at:at + 8] = struct.pack("<Q", _lie(len(name), lie))
    return bytes(head) + img.data


def _lie(n: int, lie: int) -> int:
    return max(0, n + lie) if abs(lie) < 8 else min(lie, 2**64 - 1)


def value_types(img: GGUFImage, rng: Rng) -> bytes:
    """A key read by pyinfer given another type: its bytes reinterpreted, or a new value of that type."""
    e = _target(img, rng)
    if rng.random() < 0.3:
        e.vtype = pick(rng, [*range(13), 13, 255, 2**32 - 1])
    else:
        e.vtype, e.value = _random_value(rng)
    return img.header() + img.data


def values(img: GGUFImage, rng: Rng) -> bytes:
    """A key read by pyinfer keeps its type but takes an edge value (sizes, ids, epsilons, strings)."""
    e = _target(img, rng)
    value = e.decoded()
    if e.vtype in INT_TYPES:
        candidates = [0, 1, value - 1, value + 1, value * 2, value // 2, *EDGE_INTS]
        fmt = {UINT8: (0, 255), INT32: (-(2**31), 2**31 - 1), UINT32: (0, 2**32 - 1), INT64: (-(2**63), 2**63 - 1),
               UINT64: (0, 2**64 - 1)}.get(e.vtype, (0, 2**16 - 1))
        e.value = enc_scalar(e.vtype, min(max(pick(rng, candidates), fmt[0]), fmt[1]))
    elif e.vtype in (FLOAT32, FLOAT64):
        e.value = _edge_scalar(rng, e.vtype)
    elif e.vtype == STRING:
        e.value = enc_str(pick(rng, ODD_STRINGS + ([value[::-1], value[:-1]] if value else [])))
    elif e.vtype == BOOL:
        e.value = bytes([pick(rng, [0, 1, 2, 255])])
    elif e.vtype == ARRAY:
        etype = struct.unpack_from("<I", e.value)[0]
        items = list(value)
        if items and etype != ARRAY:
            i = int(rng.integers(len(items)))
            if etype == STRING:
                items[i] = pick(rng, ODD_STRINGS)
            elif etype in (FLOAT32, FLOAT64):
                items[i] = pick(rng, EDGE_FLOATS)
            elif etype in INT_TYPES:
                items[i] = pick(rng, [-1, 0, 7, 255, 2**31 - 1])
            e.value = _safe_array(etype, items)
    return img.header() + img.data


def _safe_array(etype: int, items: list) -> bytes:
    """enc_array with integers clipped to what the element type can hold."""
    if etype in INT_TYPES:
        bits = {UINT8: (0, 255), INT32: (-(2**31), 2**31 - 1), UINT32: (0, 2**32 - 1)}.get(etype, (0, 2**16 - 1))
        items = [min(max(int(v), bits[0]), bits[1]) for v in items]
    if etype == FLOAT32:
        items = [v if not math.isfinite(v) or abs(v) < 3.4e38 else math.inf for v in items]
    return enc_array(etype, items)


def duplicates(img: GGUFImage, rng: Rng) -> bytes:
    if rng.random() < 0.6:
        e = _target(img, rng)
        copy = Entry(e.key, e.vtype, e.value)
        if rng.random() < 0.5:
            copy.vtype, copy.value = _random_value(rng)
        img.entries.insert(int(rng.integers(len(img.entries) + 1)), copy)
    else:
        i, j = rng.choice(len(img.tensors), size=2, replace=False)
        img.tensors[int(j)].name = img.tensors[int(i)].name
    return img.header() + img.data


def missing(img: GGUFImage, rng: Rng) -> bytes:
    keep_count = rng.random() < 0.3  # the header still says the old count
    if rng.random() < 0.6:
        e = _target(img, rng)
        n = len(img.entries)
        img.entries.remove(e)
        img.n_kv = n if keep_count else None
    else:
        t = pick(rng, img.tensors)
        n = len(img.tensors)
        img.tensors.remove(t)
        img.n_tensors = n if keep_count else None
    return img.header() + img.data


def names(img: GGUFImage, rng: Rng) -> bytes:
    """A key or tensor name that is empty, overlong, not ASCII, holds control characters, or names a layer
    oddly (leading zeros, beyond block_count, not a number)."""
    odd = ["", "a" * 64, "a" * 70_000, "x\ny", "tab\there", "nul\0", "caf\u00e9", "\u2028", "\x1b[31mred"]
    if rng.random() < 0.5:
        e = _target(img, rng)
        e.key = pick(rng, odd + [e.key + "\n", e.key.upper(), e.key + "."])
    else:
        t = pick(rng, img.tensors)
        parts = t.name.split(".")
        layered = [".".join(["blk", n, *parts[2:]]) for n in ("01", "-1", "x", "99999", "1e3", "\u0661")]
        t.name = pick(rng, odd + (layered if parts[0] == "blk" else []))
    return img.header() + img.data


def tensor_types(img: GGUFImage, rng: Rng) -> bytes:
    t = pick(rng, img.tensors)
    roll = rng.random()
    group = next((g for g in SAME_SIZE_TYPES if t.type in g), None)
    if roll < 0.4 and group:
        t.type = pick(rng, [g for g in group if g != t.type])
    elif roll < 0.8:
        t.type = int(pick(rng, [int(k) for k in GGML_QUANT_SIZES]))
    else:
        t.type = pick(rng, [4, 5, 31, 33, 42, 255, 2**31, 2**32 - 1])
    return img.header() + img.data


def tensor_dims(img: GGUFImage, rng: Rng) -> bytes:
    t = pick(rng, img.tensors)
    roll = rng.random()
    ne = list(t.ne)
    if roll < 0.2:
        t.n_dims = pick(rng, [0, 5, 8, 2**32 - 1])
    elif roll < 0.4 and len(ne) > 1:
        ne[0], ne[1] = ne[1], ne[0]
    elif roll < 0.6:
        ne.append(pick(rng, [1, 2, 2**40]))
        ne = ne[:4]
    else:
        i = int(rng.integers(len(ne)))
        ne[i] = pick(rng, [0, 1, ne[i] - 1, ne[i] + 1, ne[i] * 2, 2**31, 2**32, 2**62, 2**63, 2**63 + 1, 2**64 - 1])
        ne[i] = min(max(ne[i], 0), 2**64 - 1)
    t.ne = tuple(ne)
    return img.header() + img.data


def tensor_offsets(img: GGUFImage, rng: Rng) -> bytes:
    i = int(rng.integers(len(img.tensors)))
    t = img.tensors[i]
    roll = rng.random()
    if roll < 0.3:
        t.offset = max(0, t.offset + pick(rng, [-img.alignment, img.alignment, 1, -1, 2 * img.alignment]))
    elif roll < 0.5 and i:
        t.offset = img.tensors[i - 1].offset  # overlaps the previous tensor
    elif roll < 0.7 and len(img.tensors) > 1:
        j = (i + 1 + int(rng.integers(len(img.tensors) - 1))) % len(img.tensors)
        t.offset, img.tensors[j].offset = img.tensors[j].offset, t.offset
    else:
        t.offset = pick(rng, [len(img.data), len(img.data) - img.alignment, 2**32, 2**63, 2**64 - 1])
    return img.header() + img.data


def nesting(img: GGUFImage, rng: Rng) -> bytes:
    """A value replaced by nested arrays: deep (up to 600 levels), or wide with lying counts."""
    e = _target(img, rng)
    depth = pick(rng, [2, 3, 4, 5, 8, 64, 500, 600])
    leaf = enc_array(UINT32, [1, 2]) if rng.random() < 0.5 else enc_array(STRING, ["a", "b"])
    value = nested_array(depth, leaf)
    if rng.random() < 0.3:  # an outer array that claims many inner ones
        value = struct.pack("<IQ", ARRAY, pick(rng, [2, 2**20, 2**40, 2**64 - 1])) + value[12:]
    e.vtype, e.value = ARRAY, value
    return img.header() + img.data


def tokenizer(img: GGUFImage, rng: Rng) -> bytes:
    """Edits of the vocabulary arrays and ids: cut, removed or duplicated tokens, merges of the wrong type
    or out of vocabulary, token types out of range, BYTE tokens that are not <0xHH>, scores, ids."""
    tokens = img.entry("tokenizer.ggml.tokens")
    names = [e.key for e in img.entries if e.key.startswith("tokenizer.")]
    if tokens is None or rng.random() < 0.2:
        return values(img, rng)
    items = tokens.decoded()
    roll = rng.random()
    if roll < 0.15:
        items = items[:-int(rng.integers(1, 4))]
    elif roll < 0.25:
        del items[int(rng.integers(len(items)))]
    elif roll < 0.35:
        i, j = rng.integers(len(items), size=2)
        items[int(i)] = items[int(j)]
    elif roll < 0.45:
        items[int(rng.integers(len(items)))] = pick(rng, ["", "a" * 1025, "a" * 100_000, "<0x4G>", "\u2581\u2581"])
    elif roll < 0.55:
        tokens.value = enc_array(INT32, list(range(len(items))))
        return img.header() + img.data
    elif roll < 0.7 and "tokenizer.ggml.merges" in names:
        merges = img.entry("tokenizer.ggml.merges")
        m = merges.decoded()
        kind = rng.random()
        if kind < 0.3:
            merges.value = enc_array(UINT32, list(range(len(m))))
        elif kind < 0.6:
            m[int(rng.integers(len(m)))] = pick(rng, ["nospace", "zz qq", " ", "a  b", "\u0120 \u0120\u0120"])
            merges.value = enc_array(STRING, m)
        else:
            merges.value = enc_array(STRING, m + m[:2])
        return img.header() + img.data
    elif roll < 0.85:
        types = img.entry("tokenizer.ggml.token_type")
        if types is not None:
            t = types.decoded()
            t[int(rng.integers(len(t)))] = pick(rng, [0, 6, 6, 7, -1, 2**31 - 1])
            types.value = enc_array(INT32, t if rng.random() < 0.8 else t[:-1])
            return img.header() + img.data
    else:
        key = pick(rng, ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                         "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"])
        n = len(items)
        img.entries = [e for e in img.entries if e.key != key]
        img.entries.append(Entry(key, UINT32, enc_scalar(UINT32, pick(rng, [n, n - 1, n + 1, 2**31, 2**32 - 1]))))
        return img.header() + img.data
    tokens.value = enc_array(STRING, items)
    return img.header() + img.data


def pyinfer_keys(img: GGUFImage, rng: Rng) -> bytes:
    """The pyinfer.* keys: sparsity thresholds of the wrong type, length or value, unknown kinds and layouts."""
    key = pick(rng, ["pyinfer.sparsity.thresholds", "pyinfer.sparsity.kind", "pyinfer.ffn_kind", "pyinfer.ffn_layout",
                     "pyinfer.format_version", "pyinfer.neuron_order", "pyinfer.sparsity.target"])
    layers = next((e for e in img.entries if e.key.endswith(".block_count")), None)
    n_layer = layers.decoded() if layers is not None else 2
    options = {
        "pyinfer.sparsity.thresholds": [
            (ARRAY, enc_array(FLOAT32, [0.1] * (n_layer + pick(rng, [-1, 1])))),
            (ARRAY, enc_array(FLOAT32, [pick(rng, [math.nan, -1.0, math.inf])] * n_layer)),
            (ARRAY, enc_array(STRING, ["a"] * n_layer)), (FLOAT32, enc_scalar(FLOAT32, 0.5)),
            (ARRAY, enc_array(FLOAT32, [0.5] * n_layer))],
        "pyinfer.sparsity.kind": [(STRING, enc_str(s)) for s in ("threshold", "relu", "topk", "")],
        "pyinfer.ffn_kind": [(STRING, enc_str(s)) for s in ("relu", "reglu", "geglu", "gelu", "")],
        "pyinfer.ffn_layout": [(STRING, enc_str(s)) for s in ("down", "down_t", "up")],
        "pyinfer.format_version": [(UINT32, enc_scalar(UINT32, v)) for v in (0, 2, 2**32 - 1)],
        "pyinfer.neuron_order": [(STRING, enc_str(s)) for s in ("hot_first", "random")],
        "pyinfer.sparsity.target": [(FLOAT32, enc_scalar(FLOAT32, v)) for v in (-1.0, 2.0, math.nan)],
    }
    vtype, value = pick(rng, options[key])
    img.entries = [e for e in img.entries if e.key != key]
    img.entries.insert(int(rng.integers(len(img.entries) + 1)), Entry(key, vtype, value))
    return img.header() + img.data


def tensor_data(img: GGUFImage, rng: Rng) -> bytes:
    """NaN, inf or huge values (or garbage) written into a tensor's data: the run must say so or stay finite."""
    data = bytearray(img.data)
    t = pick(rng, img.tensors)
    n = img.nbytes[t.name]
    start = t.offset
    roll = rng.random()
    if roll < 0.3 and t.type in (0, 1):  # F32 / F16 values
        patch = (np.array([math.nan, math.inf, -math.inf, 6e4][int(rng.integers(4))], np.float32 if t.type == 0
                          else np.float16).tobytes())
        for _ in range(int(rng.integers(1, 8))):
            at = start + int(rng.integers(0, n // len(patch))) * len(patch)
            data[at:at + len(patch)] = patch
    elif roll < 0.6 and GGML_QUANT_SIZES[t.type][0] > 1:  # the F16 scale at the start of a quant block
        block_bytes = GGML_QUANT_SIZES[t.type][1]
        for _ in range(int(rng.integers(1, 8))):
            at = start + int(rng.integers(0, n // block_bytes)) * block_bytes
            data[at:at + 2] = np.array(pick(rng, [math.nan, math.inf, 6e4]), np.float16).tobytes()
    else:
        k = int(rng.integers(1, min(n, 4096) + 1))
        at = start + int(rng.integers(0, n - k + 1))
        data[at:at + k] = rng.integers(0, 256, k, dtype=np.uint8).tobytes()
    img.data = bytes(data)
    return img.header() + img.data


def bitflips(img: GGUFImage, rng: Rng) -> bytes:
    head = img.header()
    raw = bytearray(head + (img.data if rng.random() < 0.3 else b""))
    for _ in range(int(pick(rng, [1, 1, 2, 4, 16]))):
        i = int(rng.integers(len(raw)))
        raw[i] ^= 1 << int(rng.integers(8))
    return bytes(raw) + (img.data if len(raw) == len(head) else b"")


def byte_runs(img: GGUFImage, rng: Rng) -> bytes:
    """A run of random or extreme bytes written somewhere in the header."""
    raw = bytearray(img.header())
    k = int(rng.integers(1, 17))
    at = int(rng.integers(0, max(1, len(raw) - k)))
    fill = pick(rng, [b"\xff", b"\x00", b"\x80"])
    raw[at:at + k] = rng.integers(0, 256, k, dtype=np.uint8).tobytes() if rng.random() < 0.5 else fill * k
    return bytes(raw) + img.data


FAMILIES: dict[str, Callable[[GGUFImage, Rng], bytes]] = {
    "truncate": truncate, "magic_version": magic_version, "counts": counts, "lengths": lengths,
    "value_types": value_types, "values": values, "duplicates": duplicates, "missing": missing, "names": names,
    "tensor_types": tensor_types, "tensor_dims": tensor_dims, "tensor_offsets": tensor_offsets,
    "nesting": nesting, "tokenizer": tokenizer, "pyinfer_keys": pyinfer_keys, "tensor_data": tensor_data,
    "bitflips": bitflips, "byte_runs": byte_runs,
}
