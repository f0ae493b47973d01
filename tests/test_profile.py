"""Profiler: captured activations and counts against the numpy float64 reference, thresholds against the
target sparsity, the resumable cache, and calibration chunking."""
from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import N_VOCAB, build
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_ffn_activations

import pyinfer.converters.convert_hf_to_powergguf as conv
import pyinfer.sparsity.profiler as prof
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity.corpus import token_chunks


@pytest.fixture(scope="module", params=["llama_relu", "llama_silu", "gemma3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, str(folder / "hf"))
    path = str(folder / "m.gguf")
    assert conv.main([str(folder / "hf"), "-o", path, "--outtype", "f32"]) == 0
    rng = np.random.default_rng(1)
    chunks = [rng.integers(0, N_VOCAB, size=24).astype(np.int32) for _ in range(4)]
    return path, chunks, folder / "cache"


def test_profile_matches_reference(tiny):
    path, chunks, cache = tiny
    p = prof.collect(path, chunks, "random", cache=cache, n_threads=2, progress=False)
    g = GGUFFile(path)
    refs = [reference_ffn_activations(g, c.tolist()) for c in chunks]
    assert p.n_tokens == 96 and p.chunk_of_token().tolist() == np.repeat(np.arange(4), 24).tolist()
    for il in range(p.n_layer):
        x, h = p.layer(il)
        x_ref = np.concatenate([r["ffn_in"][il] for r in refs])  # (96, n_embd)
        h_ref = np.concatenate([r["ffn_h"][il] for r in refs])  # (96, n_ff)
        np.testing.assert_allclose(x, x_ref, rtol=2e-3, atol=2e-3 * np.abs(x_ref).max())
        np.testing.assert_allclose(h, h_ref, rtol=2e-3, atol=2e-3 * np.abs(h_ref).max())
        a, a_ref = np.abs(h), np.abs(h_ref)
        s = prof.stats_of(a, 0.5, p.kind)
        count_ref = (a_ref > s.threshold).sum(axis=0)
        mass_ref = np.where(a_ref > s.threshold, a_ref, 0).sum(axis=0)
        # engine float32 and float16 storage vs float64: only values at the threshold may flip
        assert np.abs(s.count - count_ref).sum() <= 0.01 * a.size
        np.testing.assert_allclose(s.mass, mass_ref, rtol=0.02, atol=0.02 * mass_ref.max())
        if p.kind == "relu":
            assert s.threshold == 0.0
            np.testing.assert_array_equal(s.count, (h != 0).sum(axis=0))


def test_cache_resumes(tiny, monkeypatch):
    path, chunks, cache = tiny
    first = prof.collect(path, chunks, "random", cache=cache, n_threads=2, progress=False)
    x0, h0 = first.layer(1)
    first.files[2].unlink()  # as if interrupted before chunk 2 was saved
    ran = []
    from pyinfer.engine.driver import Model

    orig = Model.ffn_activations
    monkeypatch.setattr(Model, "ffn_activations", lambda self, t: ran.append(len(t)) or orig(self, t))
    again = prof.collect(path, chunks, "random", cache=cache, n_threads=2, progress=False)
    assert ran == [24]
    x1, h1 = again.layer(1)
    np.testing.assert_array_equal(x1, x0)
    np.testing.assert_array_equal(h1, h0)
    other = prof.collect(path, chunks, "other corpus", cache=cache, n_threads=2, progress=False)
    assert other.files[0].parent != first.files[0].parent


@given(st.floats(0.05, 0.95), st.integers(0, 2**31))
def test_threshold_gives_target_sparsity(sparsity, seed):
    a = np.abs(np.random.default_rng(seed).standard_normal((200, 64))).astype(np.float32)
    s = prof.stats_of(a, sparsity, "threshold")
    zeroed = float((a <= s.threshold).mean())
    assert sparsity <= zeroed <= sparsity + 1.0 / a.size
    assert s.sparsity == pytest.approx(zeroed)
    np.testing.assert_array_equal(s.count, (a > s.threshold).sum(axis=0))
    np.testing.assert_allclose(s.mass, (a * (a > s.threshold)).sum(axis=0), rtol=1e-6)


def test_hot_fraction():
    assert prof.hot_fraction(np.array([8.0, 1.0, 1.0, 0.0]), 0.8) == 0.25
    assert prof.hot_fraction(np.ones(10), 0.8) == 0.8


def test_token_chunks_round_robin():
    docs = ["a" * 50, "b" * 50, "c" * 7]
    chunks = token_chunks(lambda s: [ord(c) for c in s], docs, n_tokens=50, ctx=10, bos=1)
    assert len(chunks) == 5 and all(len(c) == 10 and c[0] == 1 for c in chunks)
    assert [chr(c[1]) for c in chunks] == ["a", "b", "a", "b", "a"]  # "c" is shorter than one chunk
    with pytest.raises(ValueError, match="only"):
        token_chunks(lambda s: [ord(c) for c in s], docs, n_tokens=200, ctx=10)
