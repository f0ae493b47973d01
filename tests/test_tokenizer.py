"""Tokenizer against independent oracles: transformers' tokenizer for the SmolLM2 GGUF, HF byte-level BPE
tokenizers trained here (one per split regex), and a sentencepiece BPE model trained here."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.errors import PyInferError, UnsupportedError
from pyinfer.formats.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    Tokenizer,
)

TEXTS = [
    "",
    "Hello world",
    "Hello, World! How are you today?",
    "price 12345 and 3.14159, 1,000,000",
    "  leading  spaces\n\n\ttabs   and trailing   ",
    " single leading space",
    "\n\nnewlines\r\nwindows\rcr\n",
    "你好，世界。日本語のテキスト",
    "emoji 🤖🎉👍🏽 family 👨‍👩‍👧",
    "ünïcödé ﬁ Ωmega café naïve Ελληνικά русский",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "I'm can't WE'LL they'VE you'd",
    "tabs\tand\u00a0nbsp and \u200b zero width",
    "a" * 300,
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<not_special> <|im_start|",
]

# A corpus for training the tiny tokenizers: English prose, code, numbers and a little non-Latin text.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "def main():\n    for i in range(10):\n        print(i * 2, 'hello world')\n    return 0\n",
    "Numbers like 2024, 3.14 and 1,000,000 appear in text; so do dates: 12/31/1999.",
    "In 2024 and 2025, call 555-1234 or 555-9876; 12345678 is 1999 plus 12343679.",
    "Café, naïve, façade — résumé. Über straße. 東京は日本の首都です。 Привет мир!",
    "She said: \"I'm sure we'll go, but they've said you'd rather not.\"",
    "    indented line\n\n\ttabbed line\nthe end   ",
] * 5


def meta_from_hf_bpe(tok, pre: str) -> dict:
    """GGUF-style metadata for a byte-level BPE `tokenizers.Tokenizer`, as llama.cpp's converter writes it."""
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_CONTROL if t in specials else TOKEN_NORMAL for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|endoftext|>"],
    }


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# gpt-oss' and Llama 4's (o200k), as their tokenizer.json writes it
GPT4O_SPLIT = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
               "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
               "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# the others as llama.cpp's llama-vocab.cpp writes them (C strings: \r and \n are the characters)
TEKKEN_SPLIT = ("[^\r\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
                "|[^\r\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}"
                "| ?[^\\s\\p{L}\\p{N}]+[\r\n/]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
QWEN35_SPLIT = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
                "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
DEEPSEEK3_SPLITS = ("\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
FALCON_SPLITS = ("[\\p{P}\\$\\+<=>\\^~\\|`]+",
                 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)", "[0-9][0-9][0-9]")
DEEPSEEK_CODER_SPLITS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}")
DEEPSEEK_LLM_SPLITS = ("[\r\n]",
                       "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
                       "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻ"
                       "Ȿ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                       "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+", "\\s+$", "[一-龥ࠀ-一가-퟿]+", "\\p{N}+")
# GLM-4.5 / GLM-5: Llama 3's, which llama.cpp writes with its contractions spelled out
GLM4_SPLIT = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
              "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
SPLITS = {"gpt-4o": (GPT4O_SPLIT,), "tekken": (TEKKEN_SPLIT,), "qwen35": (QWEN35_SPLIT,),
          "deepseek-v3": DEEPSEEK3_SPLITS, "falcon": FALCON_SPLITS, "deepseek-coder": DEEPSEEK_CODER_SPLITS,
          "deepseek-llm": DEEPSEEK_LLM_SPLITS, "glm4": (GLM4_SPLIT,)}
IGNORE_MERGES = ("llama-bpe", "tekken", "glm4")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
UNMERGEABLE = "\u0120zqzq"  # " zqzq": in the vocabulary but no merge makes it (tests ignore_merges)

# llama.cpp's Han blocks (unicode_cpt_is_han) for kimi-k2
HAN_BLOCKS = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def kimi_k2_pieces(text: str) -> list[str]:
    """llama.cpp's kimi-k2 pre-tokenizer, step for step as its hand-written unicode_regex_split_custom_kimi_k2
    (unicode.cpp) walks the text, with the regex module's categories for llama.cpp's flags."""
    import regex

    n = len(text)

    def flag(i: int, category: str) -> bool:  # nothing past the end, as llama.cpp's _get_flags
        return i < n and regex.match(category, text[i]) is not None

    def han(i: int) -> bool:
        return i < n and any(a <= ord(text[i]) <= b for a, b in HAN_BLOCKS)

    def word_letter(i: int) -> bool:
        return flag(i, r"\p{L}") and not han(i)

    def space(i: int) -> bool:
        return flag(i, r"\p{White_Space}")  # llama.cpp's whitespace set is this property

    pieces, pos = [], 0
    while pos < n:
        start, c = pos, text[pos]
        body = pos + (c == " ")  # where ' ?[^\s\p{L}\p{N}]+' would take its first character
        if han(pos):  # [\p{Han}]+
            while han(pos):
                pos += 1
        elif word_letter(pos) or (c not in "\r\n" and not flag(pos, r"[\p{L}\p{N}]") and word_letter(pos + 1)):
            pos += 1  # a letter, or one leading character before letters
            while word_letter(pos):  # any case: llama.cpp does not cut camelCase as Kimi's regex would
                pos += 1
            if text[pos:pos + 1] == "'":  # (?:'s|'t|'re|'ve|'m|'ll|'d): its lowercase table folds only A-Z to these
                after = "".join(ch.lower() if ch.isascii() else ch for ch in text[pos + 1:pos + 3])
                if after[:1] in ("s", "t", "m", "d"):
                    pos += 2
                elif after in ("re", "ve", "ll"):
                    pos += 3
        elif flag(pos, r"\p{N}"):  # \p{N}{1,3}
            while flag(pos, r"\p{N}") and pos - start < 3:
                pos += 1
        elif body < n and not (space(body) or flag(body, r"[\p{L}\p{N}]")):  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
            pos = body
            while pos < n and not (space(pos) or flag(pos, r"[\p{L}\p{N}]")):
                pos += 1
            while text[pos:pos + 1] in ("\r", "\n"):
                pos += 1
        else:
            run = start
            while space(run):
                run += 1
            breaks = [i for i in range(start, run) if text[i] in "\r\n"]
            if breaks:  # \s*[\r\n]+
                pos = breaks[-1] + 1
            elif run - start > 1 and run < n:  # \s+(?!\S)
                pos = run - 1
            else:  # \s+, or llama.cpp's fallback of one character
                pos = max(run, start + 1)
        pieces.append(text[start:pos])
    return pieces


class KimiK2Split:
    """kimi_k2_pieces as a tokenizers pre-tokenizer, for an HF oracle of the ids."""

    def pre_tokenize(self, pretok):
        def split(_, normalized):
            out, pos = [], 0
            for piece in kimi_k2_pieces(str(normalized)):
                out.append(normalized[pos:pos + len(piece)])
                pos += len(piece)
            return out

        pretok.split(split)


def hf_bpe(pre: str):
    """An HF byte-level BPE tokenizer with the pre-tokenizer HF models of that family use, on one vocabulary
    trained here with GPT-2's split (so it has merges across digits and a token only ignore_merges reaches)."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    if "base" not in _CACHE:
        base = HFTokenizer(models.BPE())
        base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        base.train_from_iterator(CORPUS, trainer)
        model = json.loads(base.to_str())["model"]
        vocab = dict(model["vocab"], **{UNMERGEABLE: len(model["vocab"])})
        _CACHE["base"] = vocab, [tuple(m) for m in model["merges"]]
    vocab, merges = _CACHE["base"]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = {
        "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
        "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), byte_level]),
        "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"), byte_level]),
        **{name: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in splits] + [byte_level])
           for name, splits in SPLITS.items()},
        "kimi-k2": pre_tokenizers.Sequence([pre_tokenizers.PreTokenizer.custom(KimiK2Split()), byte_level]),
    }[pre]
    tok.add_special_tokens(SPECIALS)
    return tok


_CACHE: dict = {}


@pytest.fixture(scope="module", params=["gpt-2", "smollm", "llama-bpe", "qwen2", *SPLITS, "kimi-k2"])
def bpe_pair(request):
    """(our tokenizer, HF oracle) for the byte-level BPE vocabulary with the pre-tokenizer `pre` names."""
    # every oracle has the same vocabulary; gpt-2's gives it, as a custom pre-tokenizer (kimi-k2's) cannot be saved
    meta = meta_from_hf_bpe(hf_bpe("gpt-2"), request.param)
    return Tokenizer.from_gguf_metadata(meta), hf_bpe(request.param)


BPE_TEXTS = TEXTS + ["a zqzq b", "Call 555-1234 in 2024 or 12345678 ' 1999'",
                     "e\u0301t\u0301e\u0301 n\u0303o x\u0308 HE'S we'Ll"]  # combining marks, cased contractions


@pytest.mark.parametrize("text", BPE_TEXTS)
def test_byte_level_bpe_matches_hf(bpe_pair, text):
    ours, hf = bpe_pair
    expect = hf.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, add_special=False) == expect
    assert ours.decode(expect) == text


def test_pre_tokenizers_differ_on_this_vocabulary():
    """The regexes must matter here, or the comparisons above could not tell them apart."""
    pres = ("gpt-2", "smollm", "llama-bpe", "qwen2", "gpt-4o", "deepseek-v3")
    outs = {pre: tuple(hf_bpe(pre).encode("".join(BPE_TEXTS)).ids) for pre in pres}
    assert len(set(outs.values())) == len(pres)
    # qwen2, qwen35 and tekken give this small vocabulary's ids alike, but cut the texts differently
    cuts = {pre: tuple(p for p, _ in hf_bpe(pre).pre_tokenizer.pre_tokenize_str("".join(BPE_TEXTS)))
            for pre in ("qwen2", *SPLITS)}
    assert len(set(cuts.values())) == len(cuts)


def _isolated(pieces: list[str], pattern: str) -> list[str]:
    """llama.cpp's split of each piece by one regex: its matches, and the text between them, in order."""
    import regex

    out = []
    for piece in pieces:
        pos = 0
        for m in regex.finditer(pattern, piece):
            out += ([piece[pos:m.start()]] if m.start() > pos else []) + [m.group()]
            pos = m.end()
        out += [piece[pos:]] if pos < len(piece) else []
    return out


@pytest.mark.parametrize("pre", list(SPLITS))
@pytest.mark.parametrize("text", [*BPE_TEXTS, "HELLO'S World'S camelCaseWord XMLHttpRequest", "a/b\n/c\r\n\n",
                                  "1234567 ١٢٣٤ 12.5%", "x   \n\n   y\t\t", "中文テキスト漢字abc,def;'gh' 한국어",
                                  "Ｆｕｌｌ！ｗｉｄｔｈ\u3000ℌ𝔢𝔩𝔩𝔬 Ωhm 𐐨𐐯 end  "])
def test_pre_tokenizer_pieces_are_its_regexes(pre, text):
    """gpt-4o, tekken, qwen35, deepseek-v3, falcon, deepseek-coder, deepseek-llm and glm4 (the tokenizers library's
    regex engine) cut text as the `regex` module applying llama.cpp's patterns in turn: o200k's cased words keep
    their contraction and digits go in threes, Tekken's single digits, Qwen3.5's combining marks stay in words,
    DeepSeek-V3 splits CJK runs and digits first, Falcon's punctuation runs and then digit triples, DeepSeek Coder's
    lines, CJK, digits, DeepSeek LLM's words of the letters llama.cpp lists (not \\p{L}), full-width punctuation,
    trailing spaces, GLM's Llama 3 split."""
    ours = Tokenizer.from_gguf_metadata(meta_from_hf_bpe(hf_bpe(pre), pre))
    pieces = [text[a:b] for _, (a, b) in ours._tok.pre_tokenizer.pre_tokenize_str(text)]
    want = [text]
    for pattern in SPLITS[pre]:
        want = _isolated(want, pattern)
    assert pieces == want


def _pieces(pre: str, text: str) -> list[str]:
    """Our pre-tokenizer's cut of text for the pre-tokenizer `pre` names."""
    ours = Tokenizer.from_gguf_metadata(meta_from_hf_bpe(hf_bpe("gpt-2"), pre))
    return [text[a:b] for _, (a, b) in ours._tok.pre_tokenizer.pre_tokenize_str(text)]


KIMI_TEXTS = [*BPE_TEXTS, "HELLO'S World'S camelCaseWord XMLHttpRequest", "x   \n\n   y\t\t", "1234567 ١٢٣٤ 12.5%",
              "中文テキスト漢字abc,def;'gh' 한국어 汉字'S 𠀀𪜀丽 ⺀〇々",  # its Han blocks, not \\p{Han}
              "a漢b 漢 c ,漢 1漢 'xyz'LL", "naïve cafe\u0301s e\u0301\u0301"]


@pytest.mark.parametrize("text", KIMI_TEXTS)
def test_kimi_k2_pieces_are_llama_cpps_walk(text):
    """kimi-k2 (one regex in the tokenizers library) cuts text as llama.cpp's hand-written splitter walks it: Han
    runs of its blocks, words of any other letters whatever their case, combining marks outside words, contractions
    that keep to their word, digits in threes."""
    assert _pieces("kimi-k2", text) == kimi_k2_pieces(text)


# characters of Python's Unicode (14): llama.cpp's tables, the tokenizers library (16) and the regex module (17) agree
# on their letters, digits and whitespace (checked for all), not on those assigned since
@given(st.text(st.characters(exclude_categories=("Cn", "Cs")), max_size=60))
def test_kimi_k2_random_text(text):
    assert _pieces("kimi-k2", text) == kimi_k2_pieces(text)


APART, ON_WORD = ["x", "'ſa", " it", "'S"], ["x", "'ſa", " it'S"]  # a contraction cut off, or kept on its word


@pytest.mark.parametrize(("pre", "want"), [("llama-bpe", APART), ("qwen2", APART), ("qwen35", APART), ("glm4", APART),
                                           ("gpt-4o", ON_WORD), ("kimi-k2", ON_WORD)])
def test_contractions_are_ascii_as_in_llama_cpp(pre, want):
    """llama.cpp matches its patterns' (?i:'s|...) as 's or 'S (its lowercase table folds no other letter into
    these), so "'ſ" (long s) is no contraction there, as (?i:...) in a regex engine would have it; the pieces here
    are llama.cpp's own (its unicode_regex_split, run on these texts)."""
    assert _pieces(pre, "x'ſa it'S") == want


@given(st.text(max_size=40))
def test_byte_level_bpe_random_text(text):
    hf = hf_bpe("smollm")
    ours = _ours_gpt2()
    assert ours.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text


def _ours_gpt2():
    if "ours" not in _CACHE:
        _CACHE["ours"] = Tokenizer.from_gguf_metadata(meta_from_hf_bpe(hf_bpe("smollm"), "smollm"))
    return _CACHE["ours"]


def test_parse_special_off_splits_control_tokens():
    tok = _ours_gpt2()
    start = tok.tokens.index("<|im_start|>")
    assert tok.encode("<|im_start|>hi", add_special=False) == [start] + tok.encode("hi", add_special=False)
    plain = tok.encode("<|im_start|>hi", add_special=False, parse_special=False)
    assert start not in plain and tok.decode(plain) == "<|im_start|>hi"


def test_another_architectures_keys_do_not_stop_the_tokenizer():
    """A vocabulary loads whatever architecture its file is for: Gemma 4 keeps a list per layer in
    attention.head_count_kv, which the row written for the architectures pyinfer runs would call malformed."""
    meta = meta_from_hf_bpe(hf_bpe("gpt-2"), "gpt-2")
    plain = Tokenizer.from_gguf_metadata(meta).encode("Hello world")
    meta |= {"general.architecture": "gemma4", "gemma4.attention.head_count_kv": [8, 2]}
    assert Tokenizer.from_gguf_metadata(meta).encode("Hello world") == plain


def test_unknown_pre_tokenizer_is_refused():
    meta = meta_from_hf_bpe(hf_bpe("gpt-2"), "no-such-pre")
    with pytest.raises(UnsupportedError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata(meta)
    assert issubclass(UnsupportedError, PyInferError)


# ---- sentencepiece ("llama" vocab) ----

@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A sentencepiece BPE model trained here (byte fallback, no normalization) and our tokenizer for it."""
    import sentencepiece as sp

    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    sp.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "m"), vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=0.98, normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>"], minloglevel=2)
    proc = sp.SentencePieceProcessor(model_file=str(folder / "m.model"))
    types = []
    for i in range(proc.get_piece_size()):
        kind = TOKEN_NORMAL
        if proc.is_control(i):
            kind = TOKEN_CONTROL
        elif proc.is_unknown(i):
            kind = TOKEN_UNKNOWN
        elif proc.is_byte(i):
            kind = TOKEN_BYTE
        elif proc.id_to_piece(i) == "<|im_start|>":
            kind = TOKEN_USER_DEFINED
        types.append(kind)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [proc.id_to_piece(i) for i in range(proc.get_piece_size())],
        "tokenizer.ggml.scores": [proc.get_score(i) for i in range(proc.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": proc.bos_id(),
        "tokenizer.ggml.eos_token_id": proc.eos_id(),
        "tokenizer.ggml.unknown_token_id": proc.unk_id(),
    }
    return Tokenizer.from_gguf_metadata(meta), proc


SPM_TEXTS = [t for t in TEXTS if "<|" not in t]  # sentencepiece puts no dummy prefix after special tokens


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_matches_spm(spm, text):
    ours, proc = spm
    expect = proc.encode(text)
    assert ours.encode(text, add_special=False) == expect
    assert ours.encode(text) == [proc.bos_id()] + expect  # llama vocab: bos by default
    assert ours.decode(expect) == proc.decode(expect) == text


@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<"), max_size=30))
def test_sentencepiece_random_text(spm, text):
    ours, proc = spm
    assert ours.encode(text, add_special=False) == proc.encode(text)
    assert ours.decode(proc.encode(text)) == proc.decode(proc.encode(text))


def test_sentencepiece_byte_fallback_and_special(spm):
    ours, proc = spm
    ids = ours.encode("龍", add_special=False)  # a character outside the vocabulary: three byte tokens
    assert [ours.types[i] for i in ids[-3:]] == [TOKEN_BYTE] * 3
    user = ours.tokens.index("<|im_start|>")
    # as llama.cpp: each text fragment after a special token gets the dummy prefix again
    assert ours.encode("a<|im_start|>b", add_special=False) == (
        ours.encode("a", add_special=False) + [user] + ours.encode("b", add_special=False))
    assert ours.decode([proc.bos_id(), *ours.encode("hi", add_special=False)], skip_special=True) == "hi"
    assert user in ours.encode("a<|im_start|>b", parse_special=False)  # user-defined: matched regardless


# ---- streaming ----

@given(st.text(max_size=30))
def test_stream_pieces_are_complete_and_join_to_decode(text):
    tok = _ours_gpt2()
    ids = tok.encode(text, add_special=False)
    pieces = list(tok.decode_stream(ids))
    assert "".join(pieces) == tok.decode(ids) == text
    assert all(p and "\ufffd" not in p for p in pieces)


def test_stream_skips_control_tokens_by_default():
    tok = _ours_gpt2()
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special=False)
    assert "".join(tok.decode_stream(ids)) == tok.decode(ids, skip_special=True) == "hi"
    assert "".join(tok.decode_stream(ids, skip_special=False)) == tok.decode(ids) == "<|im_start|>hi<|im_end|>"


def test_stream_sentencepiece_strips_only_the_first_prefix(spm):
    ours, _ = spm
    ids = ours.encode("hello world 龍 end", add_special=False)
    assert "".join(ours.decode_stream(ids)) == "hello world 龍 end"
    stream = ours.stream_decoder()
    out = [stream.push(i) for i in ours.encode("龍", add_special=False)]
    assert out[-1] == "龍" and not any(out[:-1]) and stream.flush() == ""  # bytes held until complete


# ---- the real default model ----

def _read_tokenizer_meta(path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smollm2():
    from pyinfer.hub.pull import SMALLEST_MODEL, pull

    try:
        path = pull(SMALLEST_MODEL, progress=False)
    except PyInferError as e:
        pytest.skip(f"default model not in the cache and not fetchable: {e}")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf_metadata(_read_tokenizer_meta(path)), hf


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_transformers(smollm2, text):
    ours, hf = smollm2
    expect = hf.encode(text, add_special_tokens=True)
    assert ours.encode(text) == expect
    assert ours.decode(expect) == hf.decode(expect) == text


def test_smollm2_specials(smollm2):
    ours, _ = smollm2
    assert (ours.n_vocab, ours.bos_id, ours.eos_id) == (49152, 1, 2)
    assert ours.eot_ids == {ours.tokens.index("<|im_end|>"), ours.tokens.index("<|endoftext|>")}
    assert ours.encode("<|im_start|>") == [1]
    assert 1 not in ours.encode("<|im_start|>", parse_special=False)
    assert ours.token_to_piece(ours.encode(" world")[0]) == " world"
