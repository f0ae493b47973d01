"""pyinfer.apps.perplexity against a numpy computation from the float64 reference logits, same chunking."""
from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
from hf_tiny import TEXT, build
from reference import reference_logits

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.apps import perplexity as ppl_mod
from pyinfer.engine.driver import Model
from pyinfer.engine.scoring import Stats
from pyinfer.errors import InvalidArgumentError
from pyinfer.formats.gguf_file import GGUFFile

N_CTX = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model path, text file path) of a tiny F32 llama_silu PowerGGUF."""
    folder = tmp_path_factory.mktemp("ppl")
    build("llama_silu", str(folder / "hf"))
    path = str(folder / "m.gguf")
    assert conv.main([str(folder / "hf"), "-o", path, "--outtype", "f32"]) == 0
    text = folder / "text.txt"
    text.write_text(" ".join(TEXT))
    return path, str(text)


def _numpy_ppl(path: str, tokens: list[int], n_ctx: int, bos: int | None) -> tuple[float, list[float]]:
    """exp(mean NLL) over the second half of every whole chunk, and the running value per chunk."""
    f = GGUFFile(path)
    nll, running = [], []
    for i in range(len(tokens) // n_ctx):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        logits = reference_logits(f, chunk)  # (n_ctx, n_vocab) float64
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for j in range(n_ctx // 2, n_ctx - 1):
            nll.append(-logp[j, chunk[j + 1]])
        running.append(math.exp(np.mean(nll)))
    return running[-1], running


def test_perplexity_matches_numpy(tiny):
    path, text_path = tiny
    model = Model(path, n_ctx=N_CTX, n_threads=2)
    with open(text_path) as f:
        tokens = model.tokenize(f.read())
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    want, running = _numpy_ppl(path, tokens, N_CTX, bos)
    out = io.StringIO()
    stats = ppl_mod.perplexity(model, tokens, N_CTX, out=out)
    got, err = Stats.ppl(stats.nll)
    assert got == pytest.approx(want, rel=1e-4)
    assert len(stats.nll) == (len(tokens) // N_CTX) * (N_CTX - N_CTX // 2 - 1)
    assert 0 < err < got
    text = out.getvalue()
    printed = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", text)]
    np.testing.assert_allclose(printed, running, rtol=1e-3)
    assert re.search(rf"Final estimate: PPL = {got:.4f} \+/- [0-9.]+", text)


def test_kl_divergence(tiny, tmp_path, capsys):
    path, text_path = tiny
    base = str(tmp_path / "base.npz")
    assert ppl_mod.main(["-m", path, "-f", text_path, "-c", str(N_CTX), "-t", "2", "--kl-divergence-base", base]) == 0
    first = capsys.readouterr().out
    assert ppl_mod.main(["-m", path, "-f", text_path, "-c", str(N_CTX), "-t", "2", "--kl-divergence", base]) == 0
    same = capsys.readouterr().out
    kld = float(re.search(r"Mean\s+KLD\s*:\s*(-?[0-9.]+)", same).group(1))
    assert abs(kld) < 1e-3  # float16-stored log-probabilities of the same model
    assert "Same top p      : 100.000 %" in same
    assert re.search(r"Final estimate: PPL = ([0-9.]+)", first).group(1) == \
        re.search(r"Final estimate: PPL = ([0-9.]+)", same).group(1)
    # a second model evaluated on the fly: the oracle-masked sparse model, which is the dense model
    other = Model(path, n_ctx=N_CTX, n_threads=2, oracle=True)
    model = Model(path, n_ctx=N_CTX, n_threads=2)
    tokens = model.tokenize(open(text_path).read())
    stats = ppl_mod.perplexity(model, tokens, N_CTX, base=other, out=io.StringIO())
    assert max(abs(k) for k in stats.kl) < 1e-4 and stats.same_top == len(stats.kl)
    with pytest.raises(InvalidArgumentError, match="different tokens"):
        ppl_mod.perplexity(model, tokens[1:], N_CTX, base=np.load(base), out=io.StringIO())


def test_too_short_text(tiny):
    model = Model(tiny[0], n_ctx=N_CTX, n_threads=2)
    with pytest.raises(InvalidArgumentError, match="at least"):
        ppl_mod.perplexity(model, [1, 2, 3], N_CTX, out=io.StringIO())
