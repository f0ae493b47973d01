"""Predictor training and `sparsify`: calibration meets its recall exactly, metrics match brute force, and a
sparsified tiny ReLU checkpoint's stored predictors reach on held-out tokens the recall its file reports,
recomputed with the numpy reference forward from the file's own weights."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hf_tiny import build
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_ffn_activations, reference_logits

import pyinfer.converters.convert_hf_to_powergguf as conv
import pyinfer.sparsity.train_predictors as tp
from pyinfer.errors import InvalidArgumentError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity.profiler import calibration_chunks
from pyinfer.sparsity.sparsify import main as sparsify


@given(st.integers(0, 2**31), st.floats(0.5, 0.999))
def test_calibrate_reaches_recall(seed, recall):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((60, 8)).astype(np.float32)
    a = np.abs(rng.standard_normal((60, 16))).astype(np.float32) * (rng.random((60, 16)) < 0.4)
    raw = tp.Predictor(rng.standard_normal((4, 8)), rng.standard_normal((16, 4)), np.zeros(16, np.float32))
    pred = tp.calibrate(raw, x, a, 0.0, recall)
    assert pred.fc1.dtype == np.float16 and pred.bias.dtype == np.float32
    m = tp.evaluate(pred, x, a, 0.0)
    assert m.recall >= recall
    # brute force: same predictor, metrics by loops-free but independent float64 arithmetic
    z = np.maximum(x.astype(np.float64) @ pred.fc1.astype(np.float64).T, 0) @ pred.fc2.astype(np.float64).T
    hit = z + pred.bias > 0
    assert m.density == pytest.approx(hit.mean(), abs=2 / hit.size)
    assert m.recall == pytest.approx((a * hit).sum() / a.sum(), abs=0.02)


def test_fit_learns_a_linear_rule():
    """Labels from sign(W x): a rank-r predictor must beat chance by far after training."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 12))
    x = rng.standard_normal((3000, 12)).astype(np.float32)
    a = np.maximum(x @ w.T, 0).astype(np.float32)  # (3000, 32) ReLU activations
    pred = tp.calibrate(tp.fit(x[:2000], a[:2000], 0.0, 24, epochs=20), x[2000:2500], a[2000:2500], 0.0, 0.99)
    m = tp.evaluate(pred, x[2500:], a[2500:], 0.0)
    assert m.recall > 0.97 and m.density < 0.75  # half the neurons are active: chance is density ~1


def test_split_by_chunks():
    chunks = np.repeat(np.arange(20), 3)
    train, calib, test = tp.split(chunks)
    assert set(chunks[test]) == {9, 19} and set(chunks[calib]) == {4, 14}
    assert not (train & (calib | test)).any() and (train | calib | test).all()


@pytest.fixture(scope="module")
def sparsified(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relu")
    build("llama_relu", str(folder / "hf"))
    src = str(folder / "m.gguf")
    assert conv.main([str(folder / "hf"), "-o", src, "--outtype", "f16"]) == 0
    rng = np.random.default_rng(3)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz .,"), size=rng.integers(2, 9))) for _ in range(4000)]
    corpus = folder / "corpus.txt"
    corpus.write_text(" ".join(words))
    out = str(folder / "s.gguf")
    argv = [src, "-o", out, "--corpus", str(corpus), "--tokens", "1280", "--ctx", "64", "--ranks", "16,32,64,128",
            "--epochs", "12", "-t", "2"]
    import os

    os.environ["PYINFER_CACHE"] = str(folder / "cache")
    try:
        assert sparsify(argv) == 0
    finally:
        del os.environ["PYINFER_CACHE"]
    chunks, _ = calibration_chunks(src, [str(corpus)], 1280, 64, progress=False)
    return src, out, chunks


def test_sparsified_file_format(sparsified):
    src, out, _ = sparsified
    g, s = GGUFFile(src), GGUFFile(out)
    cfg = s.config
    meta = s.metadata
    assert meta["pyinfer.neuron_order"] == "hot_first" and meta["pyinfer.sparsity.kind"] == "relu"
    assert list(meta["pyinfer.sparsity.thresholds"]) == [0.0] * cfg.n_layer
    assert 0.0 < meta["pyinfer.sparsity.target"] < 1.0
    assert "1280 tokens" in meta["pyinfer.sparsity.calibration"]
    ranks = list(meta["pyinfer.predictor.ranks"])
    assert len(meta["pyinfer.predictor.recall"]) == cfg.n_layer
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        assert s.tensors[b + "fc1.weight"].ne == (cfg.n_embd, ranks[il]) and s.tensors[b + "fc1.weight"].type == 1
        assert s.tensors[b + "fc2.weight"].ne == (ranks[il], cfg.n_ff) and s.tensors[b + "fc2.weight"].type == 1
        assert s.tensors[b + "fc2.bias"].ne == (cfg.n_ff,) and s.tensors[b + "fc2.bias"].type == 0
        freq = s.dequantize(b + "ffn_act_freq")
        assert freq.shape == (cfg.n_ff,) and (np.diff(freq) <= 0).all() and 0 < freq.max() <= 1
    tokens = [1, 5, 77, 200, 3, 9, 250, 11]
    np.testing.assert_allclose(reference_logits(s, tokens), reference_logits(g, tokens), rtol=0, atol=1e-9)
    report = json.loads(open(out.removesuffix(".gguf") + ".json").read())
    assert [row["rank"] for row in report["layers"]] == ranks


def test_predictors_reach_reported_recall(sparsified):
    """Stored predictors on the held-out chunks (reference forward of the sparsified file, float64)."""
    _, out, chunks = sparsified
    s = GGUFFile(out)
    reported = list(s.metadata["pyinfer.predictor.recall"])
    held_out = [c for i, c in enumerate(chunks) if i % 10 == 9]
    caps = [reference_ffn_activations(s, c.tolist()) for c in held_out]
    for il in range(s.config.n_layer):
        b = f"blk.{il}."
        fc1, fc2, bias = s.dequantize(b + "fc1.weight"), s.dequantize(b + "fc2.weight"), s.dequantize(b + "fc2.bias")
        x = np.concatenate([c["ffn_in"][il] for c in caps])  # (n, n_embd)
        a = np.abs(np.concatenate([c["ffn_h"][il] for c in caps]))  # (n, n_ff)
        hit = np.maximum(x @ fc1.T, 0) @ fc2.T + bias > 0
        recall = (a * hit).sum() / a.sum()
        assert recall == pytest.approx(reported[il], abs=0.01)
        assert recall > 0.95 and hit.mean() < 0.95  # random weights have no low-rank structure: still rows skipped


def test_sparse_quality_sweep(sparsified, tmp_path, capsys):
    """tools/sparse_quality.py: more recall fires more rows and moves the output less; rows add up (ReGLU)."""
    from tools import sparse_quality

    _, out, _ = sparsified
    text = str(tmp_path / "eval.txt")
    rng = np.random.default_rng(11)  # other text than the calibration corpus
    with open(text, "w") as f:
        f.write(" ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz .,"), size=rng.integers(2, 9)))
                         for _ in range(800)))
    calib = str(tmp_path / "calib.txt")
    with open(calib, "w") as f:
        f.write(" ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 9)))
                         for _ in range(4000)))
    assert sparse_quality.main([out, "-f", text, "-c", "64", "--chunks", "4", "--corpus", calib,
                                "--calibration-tokens", "640", "--recall", "0.9", "0.999999"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    dense, low, high = rows
    assert dense["config"] == "dense" and np.isfinite(dense["ppl"])
    assert low["fired"] < high["fired"] <= 1 and low["kept"] <= high["kept"] <= high["fired"]
    assert high["kld"] <= low["kld"]
    for r in (low, high):
        assert r["rows_skipped"] == pytest.approx(1 - (r["fired"] + 2 * r["kept"]) / 3)


def test_bench_sparse_runs_every_report(sparsified, capsys):
    """tools/bench_sparse.py on a tiny sparsified model: tg, the FFN split and the per-operation split."""
    from tools import bench_sparse

    _, out, _ = sparsified
    assert bench_sparse.main([out, "--tg", "4", "--ffn", "--ops", "--ffn-reps", "1", "-t", "2"]) == 0
    text = capsys.readouterr().out
    assert "(sparse - predictor) / dense" in text and "rows / dense: ffn_gate" in text and "speed-up" in text


def test_self_corpus_is_sampled_once_and_cached(sparsified, tmp_path, monkeypatch):
    """`--corpus self`: the model's own samples make the calibration chunks; a second call reads the cache."""
    from pyinfer.sparsity import corpus

    src, _, _ = sparsified
    monkeypatch.setenv("PYINFER_CACHE", str(tmp_path))
    chunks, desc = calibration_chunks(src, ["self"], 192, 32, progress=False)
    assert "self" in desc and len(chunks) == 6 and all(len(c) == 32 for c in chunks)
    assert all(0 <= t < GGUFFile(src).config.n_vocab for c in chunks for t in c)
    cached = list((tmp_path / "corpus" / "self").glob("*.json"))
    assert len(cached) == 1
    import pyinfer.engine.driver

    monkeypatch.setattr(pyinfer.engine.driver, "Model", None)  # a cache hit must not sample again
    again, _ = calibration_chunks(src, ["self"], 192, 32, progress=False)
    assert all(np.array_equal(a, b) for a, b in zip(chunks, again, strict=True))
    with pytest.raises(InvalidArgumentError, match="self"):
        corpus.documents(["nonesuch"], progress=False, sample=lambda: [])
