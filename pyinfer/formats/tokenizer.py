"""Tokenizer built from a GGUF's `tokenizer.ggml.*` metadata, encoding as llama.cpp does.

Encoding runs on the `tokenizers` library (Rust, fast):
- `gpt2` vocab: byte-level BPE from the file's tokens and merges, with the split regexes that
  `tokenizer.ggml.pre` names (llama.cpp's table), then the byte-to-unicode map.
- `llama` vocab (sentencepiece BPE): a BPE model whose merges are derived from the vocabulary, ranked by
  the merged token's score, which is the order sentencepiece and llama.cpp merge in; byte fallback to
  `<0xXX>` tokens; spaces written as U+2581 and, with `add_space_prefix`, one prepended to every text
  fragment (as llama.cpp does after each special token).
- `gemma4` vocab: BPE over the text itself (not its bytes) with the file's merges, spaces written as U+2581,
  split only into runs of newlines and runs of the rest, byte fallback to `<0xXX>` tokens (llama.cpp's
  Gemma 4 pre-tokenizer).
Control and user-defined tokens are added tokens: user-defined ones are always matched in the text,
control ones only with `parse_special`. Decoding maps each id to its bytes here, without the library.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator

from pyinfer import arguments
from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats import gguf_schema

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPACE_MARK = "\u2581"

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# the contractions as llama.cpp matches them: ASCII letters of either case ((?i:...) would also take "'ſ", long s)
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_SPLIT = (rf"{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (rf"{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss, Llama 4): cased words keep a trailing contraction, digits in threes
_GPT4O_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # letters that start or are a cased word
_GPT4O_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_CASED}*{_GPT4O_LOWER}+{_CONTRACTION}?"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_CASED}+{_GPT4O_LOWER}*{_CONTRACTION}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken (Mistral Nemo, Small 3.x, Ministral, Devstral): o200k's words without contractions, single digits
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_CASED}*{_GPT4O_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_CASED}+"
                 rf"{_GPT4O_LOWER}*|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's, with combining marks kept in words
_QWEN35_SPLIT = (rf"{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Falcon (llama.cpp's Falcon files): punctuation runs, GPT-2's words, then digits in threes
_FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT.removesuffix(r"|\s+"), r"[0-9][0-9][0-9]")
# DeepSeek Coder (llama.cpp's patterns in turn): lines, letters, punctuation, CJK runs, single digits
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
# DeepSeek LLM (llama.cpp's patterns in turn): lines, words of its letters (ranges llama.cpp lists, roughly an
# older Unicode's cased letters: not \p{L}), ASCII and full-width punctuation, trailing spaces, CJK runs, digits
_DEEPSEEK_LLM_LETTERS = ("A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫ"
                         "ᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹ"
                         "ℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
_DEEPSEEK_LLM_SPLITS = (r"[\r\n]", rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+", "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+", r"\s+$",
                        r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+")
# DeepSeek-V3 (three splits in turn): digits in threes, CJK runs, then the words
_DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi K2: llama.cpp's hand-written splitter (unicode.cpp), which is not the regex of Kimi's tokenizer it cites:
# runs of its Han blocks; words of any other letters whatever their case (no camelCase cut; combining marks are no
# letters), each with an optional contraction; digits in threes; then Llama 3's punctuation and whitespace
_HAN = "".join(f"{chr(a)}-{chr(b)}" for a, b in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
                                                 (0x2A700, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))
_KIMI_K2_SPLIT = (rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTION}?|\p{{N}}{{1,3}}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split regexes applied in turn, ignore_merges); the groups follow llama.cpp.
_PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), ((_GPT2_SPLIT,), False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    ((r"\p{N}", _GPT2_SPLIT), False)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), ((_LLAMA3_SPLIT,), True)),
    **dict.fromkeys(("glm4", "glm5"), ((_LLAMA3_SPLIT,), True)),  # llama.cpp's CHATGLM4 type, merges ignored
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), ((_QWEN2_SPLIT,), False)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), ((_GPT4O_SPLIT,), False)),
    "tekken": ((_TEKKEN_SPLIT,), True),
    "falcon": (_FALCON_SPLITS, False),
    "deepseek-coder": (_DEEPSEEK_CODER_SPLITS, False),
    "deepseek-llm": (_DEEPSEEK_LLM_SPLITS, False),
    "qwen35": ((_QWEN35_SPLIT,), False),
    "kimi-k2": ((_KIMI_K2_SPLIT,), False),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm"), (_DEEPSEEK3_SPLITS, False)),
}

# Texts of end-of-turn tokens that stop generation besides eos (as llama.cpp's end-of-generation set).
_EOT_TEXTS = frozenset({"<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>",
                        "<|end|>", "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>"})


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _library_call(key: str, build, *args):
    """build(*args) with the tokenizers library's errors (plain Exceptions) as the one-line format error."""
    try:
        return build(*args)
    except (ModelFormatError, UnsupportedError):
        raise
    except Exception as exc:  # the library raises bare Exception on a vocabulary it cannot build
        raise ModelFormatError(f"{key}: the tokenizer cannot be built from it ({' '.join(str(exc).split())})") \
            from None


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


def _merges(meta: dict) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as (left, right) token pairs, best first."""
    merges = []
    for line in meta.get("tokenizer.ggml.merges") or ():
        left, sep, right = line.partition(" ")
        if not sep:
            raise ModelFormatError(f"merge {line!r} is not two tokens separated by a space")
        merges.append((left, right))
    return merges


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary."""

    def __init__(self, meta: dict) -> None:
        gguf_schema.check_tokenizer_metadata(meta)  # types, lengths, ids below the vocabulary: built from checked data
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelFormatError("GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
        self.kind = meta.get("tokenizer.ggml.model", "llama")
        self.tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        self.n_vocab = len(self.tokens)
        self.types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * self.n_vocab)
        spm = self.kind == "llama"
        self.bos_id: int | None = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = meta.get("tokenizer.ggml.eos_token_id")
        self.unk_id: int | None = meta.get("tokenizer.ggml.unknown_token_id")
        self.pad_id: int | None = meta.get("tokenizer.ggml.padding_token_id")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spm))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", spm))
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        if self.kind == "gpt2":
            self._tok = _library_call("tokenizer.ggml.merges", self._build_byte_level, meta)
            self._bytes = self._byte_level_bytes()
        elif spm:
            self._tok = _library_call("tokenizer.ggml.tokens", self._build_sentencepiece, meta)
            self._bytes = self._sentencepiece_bytes()
        elif self.kind == "gemma4":
            self._tok = _library_call("tokenizer.ggml.merges", self._build_gemma4, meta)
            self._bytes = self._sentencepiece_bytes()
        else:
            raise UnsupportedError(f"tokenizer model {self.kind!r} is not supported (only gpt2, llama and gemma4)")
        self._special = [t in (TOKEN_CONTROL, TOKEN_UNKNOWN) for t in self.types]
        controls = sorted({self.tokens[i] for i, t in enumerate(self.types) if t == TOKEN_CONTROL and self.tokens[i]},
                          key=len, reverse=True)
        # where a text spells a control token (which encode's parse_special would turn into that token)
        self.control_text = re.compile("|".join(map(re.escape, controls))) if controls else None
        _library_call("tokenizer.ggml.tokens", self._add_special_tokens)
        self.eot_ids = self._find_eot_ids(meta)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        return cls(meta)

    # ---- building ----

    def _vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = {}
        for i, text in enumerate(self.tokens):
            vocab.setdefault(text, i)  # a duplicated text keeps its first id
        return vocab

    def _build_byte_level(self, meta: dict):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_SPLITS:
            raise UnsupportedError(f"pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_SPLITS))}")
        splits, ignore_merges = _PRE_SPLITS[pre]
        tok = HFTokenizer(models.BPE(vocab=self._vocab(), merges=_merges(meta), ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return tok

    def _build_sentencepiece(self, meta: dict):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, normalizers

        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelFormatError("a llama (sentencepiece) vocabulary needs tokenizer.ggml.scores for every token")
        vocab = self._vocab()
        ranked = []  # (-score of merged token, its id, left, right): best merge first
        for i, text in enumerate(self.tokens):
            if self.types[i] != TOKEN_NORMAL or len(text) < 2 or vocab[text] != i:
                continue
            for cut in range(1, len(text)):
                left, right = text[:cut], text[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-scores[i], i, left, right))
        ranked.sort()
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked],
                                     unk_token=unk, byte_fallback=True, fuse_unk=True))
        steps = [normalizers.Prepend(SPACE_MARK)] if self.add_space_prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE_MARK)])
        return tok

    def _build_gemma4(self, meta: dict):
        from tokenizers import Regex, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        # llama.cpp also takes a run of newlines that is a token whole, without merging: its merges reach each
        # such token of Gemma 4's vocabulary (tests/test_tokenizer_vectors.py), so the merges alone do here
        tok = HFTokenizer(models.BPE(vocab=self._vocab(), merges=_merges(meta), byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", SPACE_MARK)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
        return tok

    def _add_special_tokens(self) -> None:
        from tokenizers import AddedToken

        control, user = [], []
        for text, kind in zip(self.tokens, self.types, strict=True):
            if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) and text:
                control.append(AddedToken(text, special=True, normalized=False))
            elif kind == TOKEN_USER_DEFINED and text:
                user.append(AddedToken(text, special=False, normalized=False))
        self._tok.add_special_tokens(control)
        self._tok.add_tokens(user)

    def _byte_level_bytes(self) -> list[bytes]:
        to_byte = {c: b for b, c in byte_to_unicode().items()}
        out = []
        for text, kind in zip(self.tokens, self.types, strict=True):
            if kind == TOKEN_NORMAL and all(c in to_byte for c in text):
                out.append(bytes(to_byte[c] for c in text))
            else:
                out.append(text.encode("utf-8"))
        return out

    def _sentencepiece_bytes(self) -> list[bytes]:
        out = []
        for i, (text, kind) in enumerate(zip(self.tokens, self.types, strict=True)):
            if kind == TOKEN_BYTE:
                if not _BYTE_TOKEN.fullmatch(text):
                    raise gguf_schema.violation(f"tokenizer.ggml.tokens[{i}]", text, "<0xHH> for a BYTE token")
                out.append(bytes([int(text[3:-1], 16)]))  # "<0xAB>"
            elif kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                out.append(text.encode("utf-8"))
            else:
                out.append(text.replace(SPACE_MARK, " ").encode("utf-8"))
        return out

    def _find_eot_ids(self, meta: dict) -> frozenset[int]:
        ids = {meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id")}
        ids |= {i for i, (text, kind) in enumerate(zip(self.tokens, self.types, strict=True))
                if text in _EOT_TEXTS and kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
        return frozenset(i for i in ids if i is not None)

    # ---- use ----

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `add_special` adds bos/eos as the file asks, `parse_special` matches
        control tokens written in the text (user-defined ones are always matched). Not thread-safe."""
        arguments.text("the text to tokenize", text)
        self._tok.encode_special_tokens = not parse_special
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[arguments.integer("token id", token_id, 0, self.n_vocab - 1)]

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token; a lone byte of a longer UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return self._special[arguments.integer("token id", token_id, 0, self.n_vocab - 1)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = [arguments.integer("token id", i, 0, self.n_vocab - 1) for i in ids]
        data = b"".join(self._bytes[i] for i in ids if not (skip_special and self._special[i]))
        text = data.decode("utf-8", errors="replace")
        if self.kind == "llama" and self.add_space_prefix and text.startswith(" "):
            text = text[1:]  # the dummy prefix the encoder added
        return text

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """An incremental detokenizer; by default control tokens print nothing, as in llama.cpp's output."""
        return StreamDecoder(self, skip_special)

    def decode_stream(self, ids: Iterable[int], skip_special: bool = True) -> Iterator[str]:
        """Yield text pieces as soon as they form complete UTF-8; joined they equal
        `decode(ids, skip_special)`."""
        stream = StreamDecoder(self, skip_special)
        for i in ids:
            if piece := stream.push(i):
                yield piece
        if tail := stream.flush():
            yield tail


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the text completed by that token (maybe "")."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer.kind == "llama" and tokenizer.add_space_prefix
        self._started = False

    def push(self, token_id: int) -> str:
        if self._skip and self._tok.is_special(token_id):
            return ""
        return self._emit(self._utf8.decode(self._tok.token_bytes(token_id)))

    def flush(self) -> str:
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self._strip and text.startswith(" "):
                text = text[1:]
        return text
