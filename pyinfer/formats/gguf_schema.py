"""The typed schema of the GGUF metadata pyinfer reads: each key with its kind, range and relations.

Model files come from strangers, so every value is checked here before anything is sized or looped from
it; a violation is one ModelFormatError naming the key, the value and what was expected. The tables are
data: a new architecture or key adds a row (`ARCH_KEYS` holds the `{arch}.*` keys every architecture
shares). Keys no row names are not read by pyinfer and are left alone, as llama.cpp does.
Relations that involve tensors (block_count against the layers present, vocabulary against the
embedding rows, tensor shapes) are checked where the tensors are known: `model_config`, `gguf_file`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyinfer.errors import ModelFormatError

MAX_SIZE = 2**31 - 1  # hidden sizes, heads, context, vocabulary: ggml keeps them in int32 kernels
MAX_LAYERS = 4096  # llama.cpp stops at 512
MAX_TOKEN_CHARS = 1024  # longest token text; deriving sentencepiece merges costs its square
MAX_ARRAY_DEPTH = 4  # nesting of GGUF arrays; pyinfer reads none nested, llama.cpp accepts none
TOKEN_TYPES = range(0, 7)  # llama.cpp's llama_token_type: undefined, normal, unknown, control, user, unused, byte


def show(value: Any) -> str:
    """A value as a short text for an error message: long strings and arrays are abbreviated."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40]) + f"... ({len(value)} characters)"
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value[:1000]})
        inner = ", ".join(show(v) for v in value[:3])
        more = ", ..." if len(value) > 3 else ""
        return f"[{inner}{more}] ({len(value)} {'/'.join(kinds) or 'values'})"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return repr(value)


def violation(key: str, value: Any, expected: str) -> ModelFormatError:
    """The error for `key` holding `value` instead of `expected` (key "" for a value that has no name)."""
    return ModelFormatError(f"{key + ' = ' if key else ''}{show(value)}: expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Kind:
    """What one value may be: `ok` decides, `expected` says it in words."""

    expected = "a value"

    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def all_ok(self, values: list) -> bool:
        """Whether every value is ok (kinds of long arrays answer with builtins over the whole list)."""
        return all(map(self.ok, values))

    def check(self, key: str, value: Any) -> Any:
        if not self.ok(value):
            raise violation(key, value, self.expected)
        return value


@dataclass(frozen=True)
class Int(Kind):
    lo: int = 0
    hi: int = 2**64 - 1
    power_of_two: bool = False

    @property
    def expected(self) -> str:
        what = "a power of two" if self.power_of_two else "an integer"
        return f"{what} in [{self.lo}, {self.hi}]"

    def ok(self, v: Any) -> bool:
        return _is_int(v) and self.lo <= v <= self.hi and not (self.power_of_two and v & (v - 1))

    def all_ok(self, values: list) -> bool:
        if self.power_of_two or not all(type(v) is int for v in values):
            return super().all_ok(values)
        return not values or (self.lo <= min(values) and max(values) <= self.hi)


@dataclass(frozen=True)
class Float(Kind):
    """A finite number; `positive` excludes 0, `lo`/`hi` bound it."""

    lo: float = -math.inf
    hi: float = math.inf
    positive: bool = False
    finite: bool = True

    @property
    def expected(self) -> str:
        what = "a finite number" if self.finite else "a number (not NaN)"
        lo = f"({0:g}" if self.positive else f"[{self.lo:g}"
        if self.hi < math.inf:
            return f"{what} in {lo}, {self.hi:g}]"
        if self.positive or self.lo > -math.inf:
            return f"{what} {'> 0' if self.positive else f'>= {self.lo:g}'}"
        return what

    def ok(self, v: Any) -> bool:
        if not _is_number(v):
            return False
        try:
            x = float(v)
        except OverflowError:  # an integer beyond any float
            return False
        if math.isnan(x) or (self.finite and math.isinf(x)):
            return False
        return self.lo <= x <= self.hi and not (self.positive and x <= 0)

    def all_ok(self, values: list) -> bool:
        if not all(type(v) is float for v in values):
            return super().all_ok(values)
        x = np.asarray(values, dtype=np.float64)
        ok = ~np.isnan(x) & (x >= self.lo) & (x <= self.hi) & ((x > 0) if self.positive else True)
        return bool((ok & np.isfinite(x)).all() if self.finite else ok.all())


@dataclass(frozen=True)
class Bool(Kind):
    expected = "true or false"

    def ok(self, v: Any) -> bool:
        return isinstance(v, bool)


@dataclass(frozen=True)
class Str(Kind):
    max_len: int = 1 << 30

    @property
    def expected(self) -> str:
        return "a string" if self.max_len >= 1 << 30 else f"a string of at most {self.max_len} characters"

    def ok(self, v: Any) -> bool:
        return isinstance(v, str) and len(v) <= self.max_len

    def all_ok(self, values: list) -> bool:
        return all(type(v) is str for v in values) and (not values or max(map(len, values)) <= self.max_len)


@dataclass(frozen=True)
class Array(Kind):
    """A list whose every element is of kind `of`; a failing element is named by its index."""

    of: Kind
    min_len: int = 1
    max_len: int = 2**62

    @property
    def expected(self) -> str:
        count = (f"{self.min_len}" if self.min_len == self.max_len
                 else f"at least {self.min_len}" if self.max_len == 2**62 else f"{self.min_len} to {self.max_len}")
        return f"an array of {count} elements, each {self.of.expected}"

    def ok(self, v: Any) -> bool:
        return isinstance(v, list) and self.min_len <= len(v) <= self.max_len and self.of.all_ok(v)

    def check(self, key: str, value: Any) -> Any:
        if not isinstance(value, list) or not self.min_len <= len(value) <= self.max_len:
            raise violation(key, value, self.expected)
        if not self.of.all_ok(value):
            i = next(i for i, x in enumerate(value) if not self.of.ok(x))
            self.of.check(f"{key}[{i}]", value[i])
        return value


@dataclass(frozen=True)
class Either(Kind):
    """A value of one of `kinds` (llama.cpp reads some keys in two forms)."""

    kinds: tuple[Kind, ...]

    @property
    def expected(self) -> str:
        return " or ".join(k.expected for k in self.kinds)

    def ok(self, v: Any) -> bool:
        return any(k.ok(v) for k in self.kinds)


SIZE = Int(1, MAX_SIZE)
TOKEN_ID = Int(0, 2**32 - 1)  # below n_vocab: checked by check_metadata once the vocabulary is known

# general.* and the keys of no architecture
KEYS: dict[str, Kind] = {
    "general.architecture": Str(64),
    "general.alignment": Int(1, 1 << 30, power_of_two=True),
    "general.name": Str(),
    "general.file_type": Int(0, 2**32 - 1),
    "tokenizer.ggml.model": Str(64),
    "tokenizer.ggml.pre": Str(64),
    "tokenizer.ggml.tokens": Array(Str(MAX_TOKEN_CHARS)),
    "tokenizer.ggml.token_type": Array(Int(TOKEN_TYPES.start, TOKEN_TYPES.stop - 1)),
    "tokenizer.ggml.scores": Array(Float(finite=False)),
    "tokenizer.ggml.merges": Array(Str(2 * MAX_TOKEN_CHARS + 1)),
    "tokenizer.ggml.bos_token_id": TOKEN_ID,
    "tokenizer.ggml.eos_token_id": TOKEN_ID,
    "tokenizer.ggml.unknown_token_id": TOKEN_ID,
    "tokenizer.ggml.padding_token_id": TOKEN_ID,
    "tokenizer.ggml.eot_token_id": TOKEN_ID,
    "tokenizer.ggml.eom_token_id": TOKEN_ID,
    "tokenizer.ggml.add_bos_token": Bool(),
    "tokenizer.ggml.add_eos_token": Bool(),
    "tokenizer.ggml.add_space_prefix": Bool(),
    "tokenizer.chat_template": Str(),
    "pyinfer.format_version": Int(1, 1),
    "pyinfer.ffn_layout": Str(16),
    "pyinfer.ffn_kind": Str(16),
    "pyinfer.neuron_order": Str(16),
    "pyinfer.synthetic": Bool(),
    "pyinfer.sparsity.kind": Str(16),
    "pyinfer.sparsity.thresholds": Array(Float(lo=0.0)),
    "pyinfer.sparsity.input_thresholds": Array(Float(lo=0.0)),  # kind "input": on |x|, gate's and up's input
    "pyinfer.sparsity.target": Float(0.0, 1.0),
    "pyinfer.experts.freq": Array(Float(lo=0.0)),  # a mixture's routings a token, per layer and expert
}

# {arch}.NAME, the same for every architecture
ARCH_KEYS: dict[str, Kind] = {
    "vocab_size": SIZE,
    "context_length": SIZE,
    "embedding_length": SIZE,
    "block_count": Int(1, MAX_LAYERS),
    # one value, or one per layer (llama.cpp's gemma4: the shared KV layers' double-wide FFN)
    "feed_forward_length": Either((SIZE, Array(SIZE, max_len=MAX_LAYERS))),
    "attention.head_count": SIZE,
    # one value, or one per layer (llama.cpp's gemma4: fewer KV heads on its global layers)
    "attention.head_count_kv": Either((SIZE, Array(SIZE, max_len=MAX_LAYERS))),
    "attention.key_length": SIZE,
    "attention.key_length_swa": SIZE,  # the windowed layers' head size (Gemma 4; key_length is the global ones')
    "attention.value_length_swa": SIZE,
    "attention.shared_kv_layers": Int(0, MAX_LAYERS),  # the last layers reuse earlier layers' KV cache (Gemma 4)
    "embedding_length_per_layer_input": Int(0, MAX_SIZE),  # per-layer embeddings' width, 0: none (Gemma 4)
    "rope.dimension_count_swa": SIZE,
    "attention.layer_norm_rms_epsilon": Float(hi=1.0, positive=True),
    "attention.layer_norm_epsilon": Float(hi=1.0, positive=True),
    "rope.freq_base": Float(positive=True),
    "rope.dimension_count": SIZE,
    "rope.scaling.type": Str(16),
    "rope.scaling.factor": Float(lo=0.0),  # 0: no scaling, as llama.cpp reads it
    "rope.scaling.original_context_length": SIZE,  # YaRN's trained context
    "rope.scaling.yarn_ext_factor": Float(0.0, 1.0),
    "rope.scaling.yarn_attn_factor": Float(positive=True),  # cos and sin times this (transformers' attention_factor)
    "rope.scaling.yarn_beta_fast": Float(positive=True),
    "rope.scaling.yarn_beta_slow": Float(positive=True),
    "rope.freq_base_swa": Float(positive=True),
    "attention.value_length": SIZE,
    "attention.sliding_window": Int(0, MAX_SIZE),  # 0: none
    # every n-th layer global (0: none), or llama.cpp's other form: one flag per layer, true = windowed
    "attention.sliding_window_pattern": Either((Int(0, MAX_LAYERS), Array(Bool(), max_len=MAX_LAYERS))),
    "attention.scale": Float(positive=True),
    "final_logit_softcapping": Float(lo=0.0),  # 0: none
    "expert_count": Int(0, 4096),  # 0: a dense model
    "expert_used_count": Int(0, 4096),
    "expert_feed_forward_length": SIZE,
    "expert_weights_norm": Bool(),
    "expert_weights_scale": Float(lo=0.0),
    "expert_gating_func": Int(0, 16),
    "expert_shared_count": Int(0, 4096),
    "expert_shared_feed_forward_length": SIZE,  # the shared expert's neurons (Qwen3.5-MoE)
    # linear attention (Qwen3.5's gated delta net), llama.cpp's ssm.* keys: the convolution's taps, the value
    # width H_v * D, the head size D (keys' and values'), H_v (time_step_rank) and H_k (group_count)
    "ssm.conv_kernel": Int(2, 16),
    "ssm.inner_size": SIZE,
    "ssm.state_size": Int(1, 512),
    "ssm.time_step_rank": SIZE,
    "ssm.group_count": SIZE,
    "full_attention_interval": Int(1, MAX_LAYERS),  # every n-th layer full attention, the rest linear
    "nextn_predict_layers": Int(0, MAX_LAYERS),  # multi-token-prediction blocks after the model's (skipped)
    "attention.recurrent_layers": Array(Bool(), max_len=MAX_LAYERS),  # or one flag per layer, true = linear
    "rope.dimension_sections": Array(Int(0, MAX_SIZE), max_len=4),  # multi-section RoPE: text uses one position
}

# arrays whose length must equal another array's (the token array is the vocabulary)
SAME_LENGTH = {
    "tokenizer.ggml.token_type": "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores": "tokenizer.ggml.tokens",
}
SPECIAL_IDS = tuple(k for k in KEYS if k.startswith("tokenizer.ggml.") and k.endswith("_token_id"))


def kind_of(key: str, arch: str | None) -> Kind | None:
    """The schema row of `key` (None: pyinfer does not read it)."""
    if key in KEYS:
        return KEYS[key]
    if arch and key.startswith(arch + "."):
        return ARCH_KEYS.get(key[len(arch) + 1:])
    return None


def arch_key(arch: str, name: str) -> str:
    """The full key `{arch}.{name}`, which must have a row in ARCH_KEYS (so that check_metadata checks it)."""
    if name not in ARCH_KEYS:
        raise LookupError(f"no schema row for {{arch}}.{name}: add it to gguf_schema.ARCH_KEYS")
    return f"{arch}.{name}"


def architecture(meta: Mapping[str, Any]) -> str | None:
    """general.architecture, checked to be a string (whether pyinfer runs it is the caller's question)."""
    arch = meta.get("general.architecture")
    return None if arch is None else KEYS["general.architecture"].check("general.architecture", arch)


def check_metadata(meta: Mapping[str, Any]) -> None:
    """Every key of `meta` the schema knows has a value of its kind, and the arrays that describe the
    vocabulary agree with each other (lengths, special token ids below the token count)."""
    arch = architecture(meta)
    for key, value in meta.items():
        kind = kind_of(key, arch)
        if kind is not None:
            kind.check(key, value)
    _check_vocabulary(meta)
    tokens = meta.get("tokenizer.ggml.tokens")
    if arch is not None and tokens is not None and meta.get(f"{arch}.vocab_size", len(tokens)) != len(tokens):
        raise violation(f"{arch}.vocab_size", meta[f"{arch}.vocab_size"],
                        f"the length of tokenizer.ggml.tokens ({len(tokens)})")


def check_tokenizer_metadata(meta: Mapping[str, Any]) -> None:
    """check_metadata for the tokenizer.* keys alone. A vocabulary loads whatever architecture its file is for
    (llama.cpp's vocab-only test files name architectures pyinfer does not run): another architecture's keys may
    hold shapes that rows here, written for the architectures pyinfer runs, would call malformed."""
    for key, value in meta.items():
        if key.startswith("tokenizer.") and key in KEYS:
            KEYS[key].check(key, value)
    _check_vocabulary(meta)


def _check_vocabulary(meta: Mapping[str, Any]) -> None:
    """The arrays that describe the vocabulary agree with the token array (lengths, special ids below its count)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    for key, other in SAME_LENGTH.items():
        if key in meta and len(meta[key]) != len(meta[other]):
            raise ModelFormatError(f"{key} has {len(meta[key])} entries for the {len(meta[other])} of {other}")
    for key in SPECIAL_IDS:
        if meta.get(key, 0) >= len(tokens):
            raise violation(key, meta[key], f"a token id below the {len(tokens)} tokens")


def check_layer_names(block_count: int, tensor_names: Iterable[str], key: str, prefix: str = "blk.") -> None:
    """The layers the tensors name ({prefix}N.*) are exactly 0 .. block_count - 1."""
    layers = set()
    for name in tensor_names:
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            if not (index.isascii() and index.isdigit() and len(index) < 10) or index != str(int(index)):
                raise ModelFormatError(f"tensor {name}: {index!r} is not a layer number")
            layers.add(int(index))
    if layers and max(layers) != len(layers) - 1:
        missing = next(i for i in range(len(layers)) if i not in layers)
        raise ModelFormatError(f"the tensors name layers up to {max(layers)} but none of layer {missing}")
    if len(layers) != block_count:
        raise violation(key, block_count, f"the {len(layers)} layers the tensors hold ({prefix}0 .. "
                                          f"{prefix}{len(layers) - 1})")
