"""Tokenizer of a HF folder -> llama.cpp's `tokenizer.ggml.*` / `tokenizer.chat_template` metadata.

BPE from tokenizer.json becomes model "gpt2"; a SentencePiece tokenizer.model becomes model "llama"
(preferred when both exist, as llama.cpp does for LLaMA). The vocabulary is padded to the embedding
rows with unused `[PAD{i}]` tokens.
"""
from __future__ import annotations

import os
from typing import Any

from gguf import GGUFValueType, TokenType

from pyinfer.converters.hf_json import TOKENIZER_CONFIG, TOKENIZER_JSON, checked, read_json_file
from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_schema import Kind
from pyinfer.formats.gguf_writer import KV


def read_json(path: str, schema: Kind) -> dict[str, Any] | None:
    """A JSON object from `path` checked against `schema`, None when the file does not exist."""
    if not os.path.exists(path):
        return None
    return checked(schema, read_json_file(path), path)


def _spm_vocab(path: str) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and token types of a SentencePiece model."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: unreadable SentencePiece model ({exc})") from None
    tokens, scores, types = [], [], []
    for i in range(sp.GetPieceSize()):
        tokens.append(sp.IdToPiece(i))
        scores.append(float(sp.GetScore(i)))
        if sp.IsUnknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.IsControl(i):
            types.append(TokenType.CONTROL)
        elif sp.IsUnused(i):
            types.append(TokenType.UNUSED)
        elif sp.IsByte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    return tokens, scores, [int(t) for t in types]


def _bpe_pre(tj: dict[str, Any], arch: str) -> str:
    """llama.cpp's pre-tokenizer name, recognized from the tokenizer.json structure."""
    if arch == "qwen2":
        return "qwen2"
    pre = tj.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"]:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"]:
        return "smollm"
    return "default"


def _added_tokens(tj: dict[str, Any] | None, tc: dict[str, Any], n_vocab: int) -> dict[int, tuple[str, bool]]:
    """id -> (content, special) of tokens added on top of the base vocabulary."""
    added: dict[int, tuple[str, bool]] = {}
    for entry in (tj or {}).get("added_tokens") or []:
        added[_token_id(entry["id"], n_vocab, "tokenizer.json added_tokens")] = (
            entry["content"], entry.get("special", True))
    for key, entry in (tc.get("added_tokens_decoder") or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise ModelFormatError(f"tokenizer_config.json: added_tokens_decoder key {key!r} is not a token id")
        tid = _token_id(int(key), n_vocab, "tokenizer_config.json added_tokens_decoder")
        added.setdefault(tid, (entry["content"], entry.get("special", True)))
    return added


def _token_id(tid: int, n_vocab: int, where: str) -> int:
    if tid >= n_vocab:
        raise ModelFormatError(f"{where}: token id {tid} is not below vocab_size {n_vocab} (the embedding rows)")
    return tid


def _token_string(value: Any) -> str | None:
    """A special token given as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: str, tc: dict[str, Any]) -> str | None:
    """The default chat template, from tokenizer_config.json or chat_template.jinja."""
    template = tc.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
        return template
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, "rb") as f:
            try:
                return f.read().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ModelFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return None


def vocab_metadata(folder: str, arch: str, n_vocab: int, config: dict[str, Any]) -> list[KV]:
    """tokenizer.* key/values for the GGUF, from tokenizer.model and/or tokenizer.json."""
    tj = read_json(os.path.join(folder, "tokenizer.json"), TOKENIZER_JSON)
    tc = read_json(os.path.join(folder, "tokenizer_config.json"), TOKENIZER_CONFIG) or {}
    spm_path = os.path.join(folder, "tokenizer.model")
    merges: list[str] = []
    use_spm = os.path.exists(spm_path) and arch == "llama"
    if use_spm:
        model, pre = "llama", "default"
        tokens, scores, types = _spm_vocab(spm_path)
    elif tj is not None:
        bpe = tj.get("model") or {}
        if bpe.get("type") != "BPE":
            raise UnsupportedError(f"tokenizer.json model {bpe.get('type')!r} is not supported; supported: BPE")
        model, pre = "gpt2", _bpe_pre(tj, arch)
        by_id = {_token_id(i, n_vocab, "tokenizer.json model.vocab"): t for t, i in (bpe.get("vocab") or {}).items()}
        if len(by_id) != len(bpe.get("vocab") or ()) or not by_id:
            raise ModelFormatError(f"{folder}: tokenizer.json model.vocab is empty or gives two tokens one id")
        tokens = [by_id.get(i, f"[PAD{i}]") for i in range(max(by_id) + 1)]
        types = [int(TokenType.NORMAL) if i in by_id else int(TokenType.UNUSED) for i in range(len(tokens))]
        scores = []
        merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges") or []]
    else:
        raise ModelFormatError(f"{folder}: no tokenizer.json or tokenizer.model")

    for tid, (content, special) in sorted(_added_tokens(tj, tc, n_vocab).items()):
        while len(tokens) <= tid:
            tokens.append(f"[PAD{len(tokens)}]")
            types.append(int(TokenType.UNUSED))
            if use_spm:
                scores.append(0.0)
        tokens[tid] = content
        types[tid] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    if len(tokens) > n_vocab:
        raise ModelFormatError(f"tokenizer has {len(tokens)} tokens but the embedding has only {n_vocab} rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
        if use_spm:
            scores.append(0.0)

    kv: list[KV] = [
        ("tokenizer.ggml.model", model, GGUFValueType.STRING, None),
        ("tokenizer.ggml.pre", pre, GGUFValueType.STRING, None),
        ("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32),
    ]
    if use_spm:
        kv.append(("tokenizer.ggml.scores", scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32))
    if merges:
        kv.append(("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING))

    ids = {t: i for i, t in enumerate(tokens)}
    for what in ("bos", "eos", "unk", "pad"):
        tid = ids.get(_token_string(tc.get(f"{what}_token")) or "", config.get(f"{what}_token_id"))
        if isinstance(tid, list):
            tid = tid[0] if tid else None
        if isinstance(tid, int) and 0 <= tid < n_vocab:
            key = "padding" if what == "pad" else ("unknown" if what == "unk" else what)
            kv.append((f"tokenizer.ggml.{key}_token_id", tid, GGUFValueType.UINT32, None))
    kv.append(("tokenizer.ggml.add_bos_token", _adds_bos(tc, tj, use_spm), GGUFValueType.BOOL, None))
    if isinstance(tc.get("add_eos_token"), bool):
        kv.append(("tokenizer.ggml.add_eos_token", tc["add_eos_token"], GGUFValueType.BOOL, None))
    template = _chat_template(folder, tc)
    if template is not None:
        kv.append(("tokenizer.chat_template", template, GGUFValueType.STRING, None))
    return kv


def _adds_bos(tc: dict[str, Any], tj: dict[str, Any] | None, use_spm: bool) -> bool:
    """Whether encoding prepends BOS: tokenizer_config's flag, else the post-processor's template."""
    if isinstance(tc.get("add_bos_token"), bool):
        return tc["add_bos_token"]
    if use_spm:
        return True
    post = (tj or {}).get("post_processor") or {}
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    first = single[0].get("SpecialToken") if single else None
    bos = _token_string(tc.get("bos_token"))
    return isinstance(first, dict) and bos is not None and first.get("id") == bos
