"""Mutation families of the converter's inputs: a private copy of a seed checkpoint folder is edited in
place (config.json, safetensors headers and data, the shard index, tokenizer files, random bytes), and
the family returns the converter's command line. Families follow issue 14's converter findings: deep
nesting, wrong-typed or huge sizes, zero heads, rope_scaling of the wrong shape, weight_map as a list,
outputs that are not regular files."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import numpy as np

from pyinfer.converters.hf_json import CONFIG

Rng = np.random.Generator
JSON_VALUES = ["abc", None, 0, -1, 1.5, 2**40, 10**9, 10**400, True, [], {}, [1, 2], "12", math.inf, math.nan,
               -0.0, 1e-300]
OUTTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]


def pick(rng: Rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _load(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _dump(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_list(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


def _odd_json_text(rng: Rng) -> bytes:
    """A file that is not the JSON object expected: too deep, not UTF-8, a repeated key, cut, empty."""
    return pick(rng, [deep_json(100_000).encode(), b'{"a": ' + deep_json(5000).encode() + b"}", b"\xff\xfe{}",
                      b'{"hidden_size": 64, "hidden_size": 65}', b"[1, 2, 3]", b'"text"', b"", b'{"a": 1',
                      b"\x00" * 16, b"{" * 50_000])


def _default_argv(folder: str, out: str, rng: Rng) -> list[str]:
    return [folder, "-o", out, "--outtype", pick(rng, OUTTYPES)]


# ---------------------------------------------------------------------------------------------------
# families: (seed folder copy, output folder, rng) -> converter argv


def hf_config(folder: str, out_dir: str, rng: Rng) -> list[str]:
    path = os.path.join(folder, "config.json")
    roll = rng.random()
    if roll < 0.1:
        with open(path, "wb") as f:
            f.write(_odd_json_text(rng))
        return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)
    config = _load(path)
    if roll < 0.25:
        config.pop(pick(rng, [k for k in config if k in dict(CONFIG.keys)] or list(config)))
    elif roll < 0.4:
        heads = config["num_attention_heads"]
        edits = [("num_attention_heads", 3), ("num_attention_heads", 0), ("num_key_value_heads", 3),
                 ("num_key_value_heads", heads * 2), ("head_dim", 7), ("hidden_size", config["hidden_size"] + 1),
                 ("num_hidden_layers", config["num_hidden_layers"] + 1), ("num_hidden_layers", 10**9),
                 ("vocab_size", 2**40), ("vocab_size", config["vocab_size"] - 1),
                 ("max_position_embeddings", 1), ("intermediate_size", 1), ("ffn_dim", 1)]
        key, value = pick(rng, edits)
        config[key] = value
    elif roll < 0.55:
        config[pick(rng, ["rope_scaling", "rope_parameters"])] = pick(rng, [
            "linear", {"type": "linear"}, {"type": "linear", "factor": 0}, {"type": "linear", "factor": "abc"},
            {"rope_type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}, [1, 2],
            {"rope_type": None, "rope_theta": -5}, {"type": "linear", "factor": math.inf}])
    else:
        key = pick(rng, [k for k, _ in CONFIG.keys])
        config[key] = pick(rng, JSON_VALUES + [nested_list(int(rng.integers(2, 50)))])
    _dump(path, config)
    return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)


def _safetensors_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def hf_safetensors(folder: str, out_dir: str, rng: Rng) -> list[str]:
    """A shard's header length, JSON or entries (dtype, shape, offsets), or its data, broken."""
    path = pick(rng, _safetensors_files(folder))
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw)
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    roll = rng.random()
    text = None
    if roll < 0.1:
        raw = struct.pack("<Q", pick(rng, [0, 1, 7, n - 1, n + 1, len(raw), 100 << 20, 2**63, 2**64 - 1])) + raw[8:]
    elif roll < 0.2:
        text = _odd_json_text(rng)
    elif roll < 0.65:
        name = pick(rng, [k for k in header if k != "__metadata__"])
        entry = header[name]
        field = pick(rng, ["dtype", "shape", "data_offsets", "entry"])
        start, end = entry["data_offsets"]
        if field == "dtype":
            entry["dtype"] = pick(rng, ["I32", "F64", "BF16", "F16", "F32", "U8", "XYZ", "", 5, None])
        elif field == "shape":
            shape = entry["shape"]
            entry["shape"] = pick(rng, [shape[::-1], [*shape, 1], [], [2**62, 2**62], [-1, *shape[1:]],
                                        ["a"], [1.5], [shape[0] + 1, *shape[1:]], [0] * len(shape), None, 7])
        elif field == "data_offsets":
            entry["data_offsets"] = pick(rng, [[start + 1, end + 1], [end, start], [0, end - start], [start, end + 8],
                                               [start, 2**63], [-8, end], [start], [start, end, end], "0-8",
                                               [start, len(data) + 8]])
        else:
            header[name] = pick(rng, [None, [], "x", {"dtype": "F32"}, 3])
    elif roll < 0.75:
        header = {k: v for k, v in header.items() if k != pick(rng, list(header))}
    elif roll < 0.8:
        header["__metadata__"] = pick(rng, [[], 5, {"format": 5}, {"format": "pt"}])
    elif roll < 0.9:
        data = data[:int(rng.integers(0, len(data)))]
    else:
        data = data + bytes(int(rng.integers(1, 64)))
    if text is None and roll >= 0.2:
        text = json.dumps(header).encode()
    if text is not None:
        raw = struct.pack("<Q", len(text)) + text + data
    with open(path, "wb") as f:
        f.write(raw)
    return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)


def hf_index(folder: str, out_dir: str, rng: Rng) -> list[str]:
    """The shard index of a sharded checkpoint: weight_map of the wrong type, names outside the folder,
    a missing shard, a tensor in two shards."""
    path = os.path.join(folder, "model.safetensors.index.json")
    index = _load(path)
    shards = sorted(set(index["weight_map"].values()))
    roll = rng.random()
    if roll < 0.2:
        index["weight_map"] = pick(rng, [list(index["weight_map"]), "model.safetensors", 5, None, {}])
    elif roll < 0.5:
        name = pick(rng, list(index["weight_map"]))
        index["weight_map"][name] = pick(rng, ["../" + shards[0], "/etc/passwd", "", ".", "..", "missing.safetensors",
                                               "sub/" + shards[0], 7, None, "/tmp/" + shards[0]])
    elif roll < 0.65:
        os.remove(os.path.join(folder, pick(rng, shards)))
    elif roll < 0.8:
        with open(os.path.join(folder, shards[0]), "rb") as f:
            first = f.read()
        with open(os.path.join(folder, shards[-1]), "wb") as f:
            f.write(first)  # every tensor of the first shard now twice
    else:
        with open(path, "wb") as f:
            f.write(_odd_json_text(rng))
        return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)
    _dump(path, index)
    return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)


def hf_tokenizer(folder: str, out_dir: str, rng: Rng) -> list[str]:
    """tokenizer.json and tokenizer_config.json: ids out of range, wrong types, out-of-vocabulary merges,
    unsupported models, missing files, templates that are not text."""
    tj_path, tc_path = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer_config.json")
    tj, tc = _load(tj_path), _load(tc_path)
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    token = pick(rng, list(vocab))
    roll = rng.random()
    if roll < 0.25:
        vocab[token] = pick(rng, [2**40, -1, "7", 1.5, None, vocab[pick(rng, list(vocab))], 299, 300, 2**31])
    elif roll < 0.35:
        vocab["x" * pick(rng, [1025, 100_000])] = len(vocab)
    elif roll < 0.5:
        i = int(rng.integers(len(merges)))
        merges[i] = pick(rng, [7, ["a"], ["a", "b", "c"], ["zz", "qq"], "zzqq", "zz qq", None, [1, 2], {"a": 1}])
    elif roll < 0.55:
        tj["model"]["type"] = pick(rng, ["Unigram", "WordPiece", None, 5])
    elif roll < 0.65:
        entry = pick(rng, tj["added_tokens"])
        entry[pick(rng, ["id", "content", "special"])] = pick(rng, [2**40, -3, None, "x", 299, 300, [1], True])
    elif roll < 0.7:
        tj[pick(rng, ["pre_tokenizer", "post_processor"])] = pick(rng, [
            "x", [1], {"type": "Sequence", "pretokenizers": [5]}, {"type": "TemplateProcessing", "single": [7]},
            {"type": "TemplateProcessing", "single": [{"SpecialToken": 5}]}])
    elif roll < 0.85:
        tc[pick(rng, ["added_tokens_decoder", "chat_template", "bos_token", "add_bos_token", "eos_token"])] = pick(
            rng, [{"abc": {"content": "x"}}, {"-1": {"content": "x"}}, {"99999999999": {"content": "x"}},
                  {"5": {"special": True}}, {"5": 7}, 7, [{"name": "default", "template": 5}], [5], None, "{{ x",
                  {"content": 5}, "not-a-bool"])
    elif roll < 0.92:
        os.remove(pick(rng, [tj_path, tc_path]))
        return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)
    else:
        with open(os.path.join(folder, "chat_template.jinja"), "wb") as f:
            f.write(pick(rng, [b"\xff\xfe bad", b"{% for %}", b"{{ messages[0]['content'] }}"]))
        tc.pop("chat_template", None)
    _dump(tj_path, tj)
    _dump(tc_path, tc)
    return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)


def hf_bytes(folder: str, out_dir: str, rng: Rng) -> list[str]:
    """Random bit flips or byte runs in one of the checkpoint's files (in a safetensors header mostly)."""
    names = sorted(os.listdir(folder))
    path = os.path.join(folder, pick(rng, names))
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    end = len(raw)
    if path.endswith(".safetensors") and rng.random() < 0.8:
        end = min(end, 8 + struct.unpack_from("<Q", raw)[0])
    for _ in range(int(pick(rng, [1, 1, 2, 4, 16]))):
        i = int(rng.integers(max(end, 1)))
        if raw:
            raw[i] = raw[i] ^ (1 << int(rng.integers(8))) if rng.random() < 0.7 else int(rng.integers(256))
    with open(path, "wb") as f:
        f.write(raw)
    return _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng)


def convert_outputs(folder: str, out_dir: str, rng: Rng) -> list[str]:
    """Output paths that are not regular files (a folder, a FIFO, links to them), the same file twice, a
    folder that does not exist; and some that are fine (a link to a regular file, an existing file)."""
    out = os.path.join(out_dir, "out.gguf")
    roll = rng.random()
    argv = _default_argv(folder, out, rng)
    if roll < 0.2:
        os.mkdir(out)
    elif roll < 0.35:
        os.mkfifo(out)
    elif roll < 0.5:
        fifo = os.path.join(out_dir, "fifo")
        os.mkfifo(fifo)
        os.symlink(fifo, out)
    elif roll < 0.6:
        os.symlink(out_dir, out)
    elif roll < 0.7:
        argv += ["--dense-gguf", out]
    elif roll < 0.8:
        argv[2] = os.path.join(out_dir, "missing", "out.gguf")
    elif roll < 0.9:
        target = os.path.join(out_dir, "real.gguf")
        with open(target, "wb") as f:
            f.write(b"old")
        os.symlink(target, out)
    else:
        with open(out, "wb") as f:
            f.write(b"old contents")
    return argv


# family -> (mutation, seeds it applies to)
FAMILIES: dict[str, tuple[Callable[[str, str, Rng], list[str]], tuple[str, ...]]] = {
    "hf_config": (hf_config, ("hf-llama", "hf-qwen2", "hf-opt")),
    "hf_safetensors": (hf_safetensors, ("hf-llama", "hf-qwen2", "hf-opt")),
    "hf_index": (hf_index, ("hf-qwen2",)),
    "hf_tokenizer": (hf_tokenizer, ("hf-llama", "hf-qwen2", "hf-opt")),
    "hf_bytes": (hf_bytes, ("hf-llama", "hf-qwen2", "hf-opt")),
    "convert_outputs": (convert_outputs, ("hf-llama", "hf-opt")),
    "convert_sigterm": (lambda folder, out_dir, rng: _default_argv(folder, os.path.join(out_dir, "out.gguf"), rng),
                        ("hf-llama-large",)),
}
