"""llama.cpp's own tokenizer test vectors, as its tests/test-tokenizer-0.cpp runs them: each vocabulary of
models/ggml-vocab-NAME.gguf encodes every text of NAME.gguf.inp to the ids on its line of NAME.gguf.out, without
added special tokens and without parsing special tokens in the text. `pyinfer pull --all` fetches the files."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyinfer.errors import ModelFormatError, PyInferError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_reader import open_gguf
from pyinfer.formats.tokenizer import Tokenizer
from pyinfer.hub.pull import LLAMA_CPP_VOCAB_TESTS, VOCAB_TESTS, vocab_tests_path

SEPARATOR = b"\n__ggml_vocab_test__\n"
# vocabularies pyinfer refuses, and the words of its one-line refusal
REFUSED = {"bert-bge": "tokenizer model 'bert' is not supported"}


@pytest.fixture(scope="module")
def folder() -> Path:
    path = vocab_tests_path()
    if not path.is_dir():
        pytest.fail(f"{VOCAB_TESTS} not in the cache ({path}); run `pyinfer pull --all`")
    return path


def vocab_file(folder: Path, name: str) -> Path:
    return folder / f"ggml-vocab-{name}.gguf"


def read_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) pairs as read_tests() reads them: the texts end at each separator (the one after
    the last text ends nothing), the ids are one stripped line each."""
    texts = vocab.with_name(vocab.name + ".inp").read_bytes().split(SEPARATOR)
    if texts[-1] == b"":
        texts.pop()
    lines = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), "input and output files have different numbers of tests"
    return [(text.decode("utf-8"), [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


def load_vocabulary(vocab: Path) -> Tokenizer:
    """The tokenizer of a vocabulary-only file: its metadata as GGUFFile reads it, without the model GGUFFile
    would also require (as llama.cpp loads these files with vocab_only)."""
    mapping, header = open_gguf(str(vocab))
    mapping.close()
    return Tokenizer.from_gguf_metadata(header.metadata)


@pytest.mark.parametrize("name", [n for n in LLAMA_CPP_VOCAB_TESTS.names if n not in REFUSED])
def test_vocabulary_encodes_as_llama_cpp(folder, name):
    vocab = vocab_file(folder, name)
    tokenizer, cases = load_vocabulary(vocab), read_cases(vocab)
    wrong = [(text, ids, got) for text, ids in cases
             if (got := tokenizer.encode(text, add_special=False, parse_special=False)) != ids]
    assert not wrong, (f"{name}: {len(cases) - len(wrong)}/{len(cases)} texts right; first wrong: {wrong[0][0]!r} "
                       f"gave {wrong[0][2]}, llama.cpp {wrong[0][1]}")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vocabulary_is_refused_in_one_line(folder, name):
    with pytest.raises(PyInferError, match=REFUSED[name]) as refusal:
        load_vocabulary(vocab_file(folder, name))
    assert "\n" not in str(refusal.value)


def test_gemma4_newline_runs_are_single_tokens(folder):
    """llama.cpp takes a run of newlines that is a Gemma 4 token whole, without merges; ours merges, so its
    merges must reach each of them."""
    tokenizer = load_vocabulary(vocab_file(folder, "gemma-4"))
    runs = [n for n in range(1, 64) if "\n" * n in tokenizer.tokens]
    assert runs and all(tokenizer.encode("\n" * n, add_special=False) == [tokenizer.tokens.index("\n" * n)]
                        for n in runs)


def test_vocabulary_only_files_as_models_are_refused_in_one_line(folder):
    """Gemma 4's file keeps a list per layer in attention.head_count_kv: its tokenizer loads (above), and as a model
    (an architecture pyinfer runs) it is refused for holding no layers, not for that key; BERT's for its
    architecture."""
    with pytest.raises(ModelFormatError, match="block_count = 30: expected the 0 layers the tensors hold"):
        GGUFFile(vocab_file(folder, "gemma-4"))
    with pytest.raises(UnsupportedError, match="unsupported architecture 'bert'"):
        GGUFFile(vocab_file(folder, "bert-bge"))
