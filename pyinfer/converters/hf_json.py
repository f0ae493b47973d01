"""Strict JSON of HF checkpoints (config.json, tokenizer files, safetensors headers, shard indexes) and the
typed schema of the config.json keys the converter reads, with the kinds of `pyinfer.formats.gguf_schema`.

Checkpoints come from strangers as model files do: JSON must be UTF-8, at most MAX_JSON_BYTES, nested at
most as deep as Python's parser goes, and without repeated keys (json would keep the last silently);
every config value the converter reads is checked against its row before anything is sized from it.
A null value counts as absent, as transformers reads it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pyinfer.errors import ModelFormatError
from pyinfer.formats.gguf_schema import (
    MAX_LAYERS,
    MAX_SIZE,
    MAX_TOKEN_CHARS,
    SIZE,
    Array,
    Bool,
    Float,
    Int,
    Kind,
    Str,
    violation,
)

MAX_JSON_BYTES = 256 << 20  # tokenizer.json of a 256k vocabulary is ~35 MB


@dataclass(frozen=True)
class Obj(Kind):
    """A JSON object: the keys in `keys` are of their kinds (null or missing: absent), those in
    `required` present."""

    keys: tuple[tuple[str, Kind], ...] = ()
    required: tuple[str, ...] = ()
    expected = "a JSON object"

    def ok(self, v: Any) -> bool:
        return (isinstance(v, dict) and all(v.get(k) is not None for k in self.required)
                and all(v.get(k) is None or kind.ok(v[k]) for k, kind in self.keys))

    def check(self, key: str, value: Any) -> Any:
        if not isinstance(value, dict):
            raise violation(key, value, self.expected)
        for k in self.required:
            if value.get(k) is None:
                raise ModelFormatError(f"{key or 'the object'} lacks {k}")
        for k, kind in self.keys:
            if value.get(k) is not None:
                kind.check(f"{key}.{k}" if key else k, value[k])
        return value


@dataclass(frozen=True)
class Map(Kind):
    """A JSON object of any keys whose values are all of kind `of`."""

    of: Kind

    @property
    def expected(self) -> str:
        return f"a JSON object of values each {self.of.expected}"

    def ok(self, v: Any) -> bool:
        return isinstance(v, dict) and all(map(self.of.ok, v.values()))

    def check(self, key: str, value: Any) -> Any:
        if not isinstance(value, dict):
            raise violation(key, value, self.expected)
        for k, v in value.items():
            self.of.check(f"{key}[{k!r}]" if key else repr(k), v)
        return value


@dataclass(frozen=True)
class Either(Kind):
    first: Kind
    second: Kind

    @property
    def expected(self) -> str:
        return f"{self.first.expected}, or {self.second.expected}"

    def ok(self, v: Any) -> bool:
        return self.first.ok(v) or self.second.ok(v)


_ROPE_KEYS = (("rope_type", Str(32)), ("type", Str(32)), ("factor", Float(positive=True)),
              ("rope_theta", Float(positive=True)), ("low_freq_factor", Float(positive=True)),
              ("high_freq_factor", Float(positive=True)), ("original_max_position_embeddings", SIZE),
              ("attention_factor", Float(positive=True)), ("beta_fast", Float(positive=True)),
              ("beta_slow", Float(positive=True)), ("mscale", Float()), ("mscale_all_dim", Float()),
              ("truncate", Bool()), ("partial_rotary_factor", Float(0.0, 1.0)),
              ("mrope_section", Array(Int(0, MAX_SIZE), max_len=4)))
# Gemma 3 keeps one set per kind of layer
ROPE = Obj((*_ROPE_KEYS, ("sliding_attention", Obj(_ROPE_KEYS)), ("full_attention", Obj(_ROPE_KEYS))))

# config.json: every key the converter reads (a multimodal checkpoint's text model has them in text_config)
_CONFIG_KEYS = {
    "architectures": Array(Str(100)),
    "hidden_size": SIZE,
    "intermediate_size": SIZE,
    "ffn_dim": SIZE,
    "num_hidden_layers": Int(1, MAX_LAYERS),
    "num_attention_heads": SIZE,
    "num_key_value_heads": SIZE,
    "head_dim": SIZE,
    "max_position_embeddings": SIZE,
    "original_max_position_embeddings": SIZE,
    "vocab_size": SIZE,
    "word_embed_proj_dim": SIZE,
    "rms_norm_eps": Float(hi=1.0, positive=True),
    "rope_theta": Float(positive=True),
    "rope_scaling": ROPE,
    "rope_parameters": ROPE,
    "hidden_act": Str(64),
    "activation_function": Str(64),
    "tie_word_embeddings": Bool(),
    "attention_bias": Bool(),
    "mlp_bias": Bool(),
    "use_sliding_window": Bool(),
    "activation": Str(64),
    "ffn_hidden_size": SIZE,
    "num_kv_heads": SIZE,
    "new_decoder_architecture": Bool(),
    "multi_query": Bool(),
    "parallel_attn": Bool(),
    "alibi": Bool(),
    "bias": Bool(),
    "layer_norm_epsilon": Float(hi=1.0, positive=True),
    "sliding_window": SIZE,
    "layer_types": Array(Str(64), min_len=0),
    "sliding_window_pattern": Int(1, MAX_LAYERS),
    "use_bidirectional_attention": Either(Bool(), Str(16)),  # Gemma 4: "all" or "vision"
    "query_pre_attn_scalar": Float(positive=True),
    "hidden_activation": Str(64),
    "rope_local_base_freq": Float(positive=True),
    "final_logit_softcapping": Float(positive=True),
    "attn_logit_softcapping": Float(positive=True),
    "do_layer_norm_before": Bool(),
    "enable_bias": Bool(),
    "layer_norm_elementwise_affine": Bool(),
    "_remove_final_layer_norm": Bool(),
    "num_experts": Int(1, 4096),
    "num_local_experts": Int(1, 4096),
    "num_experts_per_tok": Int(1, 4096),
    "moe_intermediate_size": SIZE,
    "norm_topk_prob": Bool(),
    "decoder_sparse_step": Int(1, MAX_LAYERS),
    "mlp_only_layers": Array(Int(0, MAX_LAYERS), min_len=0),
    "clip_qkv": Float(positive=True),
    "shared_expert_intermediate_size": Int(0, MAX_SIZE),
    # Gemma 4: the global layers' head size and KV heads (older configs), or transformers' per-layer overrides
    "global_head_dim": SIZE,
    "num_global_key_value_heads": SIZE,
    "per_layer_config": Map(Obj((("head_dim", SIZE), ("num_key_value_heads", SIZE)))),
    "attention_k_eq_v": Bool(),
    "num_kv_shared_layers": Int(0, MAX_LAYERS),
    "hidden_size_per_layer_input": Int(0, MAX_SIZE),
    "vocab_size_per_layer_input": SIZE,
    "use_double_wide_mlp": Bool(),
    "enable_moe_block": Bool(),
    # Qwen3.5's linear attention (gated delta net)
    "linear_conv_kernel_dim": Int(2, 16),
    "linear_key_head_dim": Int(1, 512),
    "linear_value_head_dim": Int(1, 512),
    "linear_num_key_heads": SIZE,
    "linear_num_value_heads": SIZE,
    "full_attention_interval": Int(1, MAX_LAYERS),
}
CONFIG = Obj(tuple({**_CONFIG_KEYS, "text_config": Obj(tuple(_CONFIG_KEYS.items()))}.items()))


TOKEN_TEXT = Str(MAX_TOKEN_CHARS)
TOKEN_ID = Int(0, MAX_SIZE)  # below vocab_size: checked where it is known
_TYPED = Obj((("type", Str(64)),))

# tokenizer.json and tokenizer_config.json: the parts the converter reads
TOKENIZER_JSON = Obj((
    ("model", Obj((("type", Str(64)), ("vocab", Map(TOKEN_ID)),
                   ("merges", Array(Either(Str(2 * MAX_TOKEN_CHARS + 1), Array(TOKEN_TEXT, 2, 2)), min_len=0))))),
    ("added_tokens", Array(Obj((("id", TOKEN_ID), ("content", TOKEN_TEXT), ("special", Bool())),
                               required=("id", "content")), min_len=0)),
    ("pre_tokenizer", Obj((("type", Str(64)), ("pretokenizers", Array(_TYPED, min_len=0))))),
    ("post_processor", Obj((("type", Str(64)), ("single", Array(Obj(), min_len=0))))),
))
TOKENIZER_CONFIG = Obj((
    ("added_tokens_decoder", Map(Obj((("content", TOKEN_TEXT), ("special", Bool())), required=("content",)))),
    ("chat_template", Either(Str(), Array(Obj((("name", Str()), ("template", Str()))), min_len=0))),
    ("add_bos_token", Bool()),
    ("add_eos_token", Bool()),
))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {repeated!r} appears twice")
    return out


def parse_json(raw: bytes) -> Any:
    """raw as JSON; ValueError (a UnicodeDecodeError or JSONDecodeError among them) when it is not."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json_file(path: str) -> Any:
    """The JSON value in the file at path, or a one-line ModelFormatError."""
    try:
        size = os.path.getsize(path)
        if size > MAX_JSON_BYTES:
            raise ModelFormatError(f"{path}: {size} bytes is too large for a JSON file here (at most "
                                   f"{MAX_JSON_BYTES})")
        with open(path, "rb") as f:
            return parse_json(f.read())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: unreadable JSON ({' '.join(str(exc).split())})") from None


def checked(kind: Kind, value: Any, where: str) -> Any:
    """value, checked against kind; a violation names the file (`where`) and the path to the value."""
    try:
        return kind.check("", value)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{where}: {exc}") from None
