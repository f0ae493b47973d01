"""Sampler stages against plain float64 loops written from llama.cpp's definitions, and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pyinfer.engine.sampling import (
    Sampler,
    SamplerParams,
    min_p_keep,
    penalize_repeats,
    top_k_ids,
    top_p_keep,
)

N_VOCAB = 50


@st.composite
def distinct_logits(draw, n_min=2, n_max=N_VOCAB):
    """float32 logits without ties (ties make top-k's choice arbitrary, in llama.cpp too)."""
    n = draw(st.integers(n_min, n_max))
    vals = draw(st.lists(st.floats(-30, 30, width=32), min_size=n, max_size=n, unique=True))
    return np.array(vals, dtype=np.float32)


@st.composite
def random_logits(draw):
    """Continuous logits from a drawn seed and scale: no ties, unlike hypothesis' favourite simple floats."""
    n = draw(st.integers(5, N_VOCAB))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return (rng.standard_normal(n) * draw(st.floats(0.1, 10.0))).astype(np.float32)


histories = st.lists(st.integers(0, N_VOCAB - 1), max_size=100)


def ref_penalty(logits, history, penalty, last_n, frequency=0.0, presence=0.0):
    out = [float(v) for v in logits]
    window = history if last_n < 0 else history[max(0, len(history) - last_n):] if last_n else []
    for t in set(window):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
        out[t] -= window.count(t) * frequency + presence
    return out


def ref_softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def ref_chain(logits, history, p: SamplerParams):
    """{id: probability} after penalty, top-k, top-p, min-p and temperature, one plain step at a time."""
    x = ref_penalty(logits, history, p.repeat_penalty, p.repeat_last_n, p.frequency_penalty, p.presence_penalty)
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if 0 < p.top_k < len(order):
        order = order[: p.top_k]
    if p.top_p < 1.0:
        probs, cum = ref_softmax([x[i] for i in order]), 0.0
        for j, q in enumerate(probs):
            cum += q
            if cum >= p.top_p:
                order = order[: j + 1]
                break
    if p.min_p > 0.0:
        probs = ref_softmax([x[i] for i in order])
        order = [i for i, q in zip(order, probs, strict=True) if q >= p.min_p * probs[0]] or order[:1]
    return dict(zip(order, ref_softmax([x[i] / p.temperature for i in order]), strict=True))


@given(distinct_logits(), histories, st.floats(0.5, 2.0), st.sampled_from([0, 1, 8, 64, -1]),
       st.floats(-2.0, 2.0), st.floats(-2.0, 2.0))
def test_penalties(logits, history, penalty, last_n, frequency, presence):
    history = [t % len(logits) for t in history]
    got = penalize_repeats(logits, history, penalty, last_n, frequency, presence)
    want = ref_penalty(logits, history, penalty, last_n, frequency, presence)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert got is not logits and np.array_equal(logits, logits.copy())


@given(distinct_logits(), st.integers(-1, N_VOCAB + 5))
def test_top_k(logits, k):
    ids = top_k_ids(logits, k)
    n = len(logits) if k <= 0 else min(k, len(logits))
    assert list(ids) == sorted(range(len(logits)), key=lambda i: -float(logits[i]))[:n]


@given(distinct_logits(), st.floats(0.05, 1.0))
def test_top_p(logits, p):
    lg = np.sort(logits.astype(np.float64))[::-1]
    probs, cum, expect = ref_softmax(list(lg)), 0.0, len(lg)
    for j, q in enumerate(probs):
        cum += q
        if cum >= p:
            expect = j + 1
            break
    assume(all(abs(c - p) > 1e-9 for c in np.cumsum(probs)))  # no rounding coin-flips at the border
    assert top_p_keep(lg, p) == expect


@given(distinct_logits(), st.floats(0.001, 1.0))
def test_min_p(logits, min_p):
    lg = np.sort(logits.astype(np.float64))[::-1]
    probs = ref_softmax(list(lg))
    assume(all(abs(q - min_p * probs[0]) > 1e-9 * probs[0] for q in probs))
    assert min_p_keep(lg, min_p) == max(sum(q >= min_p * probs[0] for q in probs), 1)


params = st.builds(
    SamplerParams,
    temperature=st.floats(0.1, 2.0), top_k=st.integers(0, 60), top_p=st.floats(0.1, 1.0),
    min_p=st.floats(0.0, 0.5), repeat_penalty=st.floats(0.8, 1.5), repeat_last_n=st.sampled_from([0, 4, 64, -1]),
    frequency_penalty=st.floats(-2.0, 2.0), presence_penalty=st.floats(-2.0, 2.0))


@given(random_logits(), histories, params)
def test_whole_chain_distribution(logits, history, p):
    history = [t % len(logits) for t in history]
    ids, probs = Sampler(p, seed=0).candidates(logits, history)
    x = ref_penalty(logits, history, p.repeat_penalty, p.repeat_last_n, p.frequency_penalty, p.presence_penalty)
    xs = sorted(x)
    assume(all(b - a > 1e-5 for a, b in zip(xs, xs[1:], strict=False)) and not _border_case(x, p))
    ref = ref_chain(logits, history, p)
    assert set(ids.tolist()) == set(ref)
    np.testing.assert_allclose(probs, [ref[i] for i in ids.tolist()], rtol=1e-6, atol=1e-9)


def _border_case(x, p):
    """True when a cut lands within float32 rounding of a top-p or min-p border (either answer is right)."""
    probs = ref_softmax(sorted(x, reverse=True)[: p.top_k or None])
    cums = np.cumsum(probs)
    near_top_p = p.top_p < 1.0 and np.any(np.abs(cums - p.top_p) < 1e-5)
    near_min_p = p.min_p > 0 and any(abs(q - p.min_p * probs[0]) < 1e-5 for q in probs)
    return near_top_p or near_min_p


@given(distinct_logits(), histories, st.floats(-1.0, 0.0), st.integers(0, 60))
def test_greedy_is_argmax(logits, history, temp, k):
    history = [t % len(logits) for t in history]
    p = SamplerParams(temperature=temp, top_k=k, repeat_penalty=1.3)
    expect = int(np.argmax(penalize_repeats(logits, history, 1.3, 64)))
    assert Sampler(p, seed=1).sample(logits, history) == expect


@given(distinct_logits(), st.floats(0.1, 5.0), st.integers(0, 2**32 - 1))
def test_top_k_1_is_greedy(logits, temp, seed):
    p = SamplerParams(temperature=temp, top_k=1)
    assert Sampler(p, seed).sample(logits) == int(np.argmax(logits))


@given(distinct_logits(n_min=10), st.integers(0, 2**32 - 1))
def test_seed_reproducible(logits, seed):
    p = SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a, b = Sampler(p, seed), Sampler(p, seed)
    assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]


@given(distinct_logits(n_min=3), st.floats(0.01, 0.9), st.integers(0, 1000))
def test_min_p_only_draws_likely_tokens(logits, min_p, seed):
    p = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=min_p)
    probs = ref_softmax([float(v) for v in logits])
    s = Sampler(p, seed)
    for _ in range(10):
        assert probs[s.sample(logits)] >= min_p * max(probs) * (1 - 1e-6)


def test_draw_frequencies_follow_probabilities():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32))
    s = Sampler(SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), seed=1234)
    counts = np.bincount([s.sample(logits) for _ in range(4000)], minlength=4)
    expect = 4000 * np.array([0.5, 0.25, 0.15, 0.1])
    assert ((counts - expect) ** 2 / expect).sum() < 16.3  # chi-square, 3 dof, p = 0.001


def test_defaults_are_llama_cpp():
    assert SamplerParams() == SamplerParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                            repeat_penalty=1.0, repeat_last_n=64, frequency_penalty=0.0,
                                            presence_penalty=0.0)


def test_large_vocab_is_fast():
    import time

    logits = np.random.default_rng(0).standard_normal(151_936).astype(np.float32)
    s = Sampler(SamplerParams(repeat_penalty=1.1), seed=0)
    t = time.perf_counter()
    for _ in range(20):
        s.sample(logits, list(range(100)))
    assert (time.perf_counter() - t) / 20 < 0.05  # measured ~2 ms; generous for a shared machine


@pytest.mark.parametrize("history", [[], [3, 3, 3]])
def test_penalty_applies_once_per_distinct_token(history):
    logits = np.array([1.0, -1.0, 2.0, 4.0], dtype=np.float32)
    out = penalize_repeats(logits, history, 2.0, 64)
    assert out[3] == (2.0 if history else 4.0)
