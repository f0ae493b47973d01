"""The default model (`pyinfer pull`, `pyinfer chat` without -m): Qwen2.5-Coder-0.5B-Instruct Q4_K_M.

It was chosen by the factual questions of tools/factual_eval.py (the score is printed here, for every
run); our engine on it is checked against transformers loading the same GGUF in float32."""
from __future__ import annotations

import pytest
from real_models import (
    CODE,
    ENGLISH,
    assert_answers_the_first_question_as_transformers,
    logits_agreement,
    positions,
    with_oracle,
)

from pyinfer.engine.driver import Model
from pyinfer.hub.pull import DEFAULT_MODEL
from tools import factual_eval


@pytest.fixture(scope="module")
def default():
    return with_oracle(DEFAULT_MODEL)


def test_factual_questions_at_the_default_settings(default, capsys):
    """Ten questions, ten seeds each, as `pyinfer chat` asks them. The issue's bar was 9 of 10 seeds; no
    model that pull knows reaches it (docs/BENCHMARKS.md), this one comes closest: the floor here keeps
    it from getting worse, and France's capital is the question new users ask first."""
    path, _ = default
    model = Model(path, n_ctx=512, n_threads=2)
    score = factual_eval.evaluate(model, DEFAULT_MODEL, seeds=10, progress=False)
    with capsys.disabled():
        print("\n" + score.table())
    assert score.right[0] >= 9
    assert score.total >= 70


@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize("text", [ENGLISH, CODE], ids=["english", "code"])
def test_teacher_forced_top1_agrees_with_transformers(default, text, precise, capsys):
    """64 positions. By default this model's matmuls round activations to 8 bits, as llama.cpp's do (it is
    above driver.PRECISE_MAX_BYTES); precise ones leave only float32's summation order."""
    path, hf = default
    model = Model(path, n_ctx=512, kv_type="f32", n_threads=2, precise=precise)
    rate, _ = logits_agreement(model, hf, positions(model, text))
    with capsys.disabled():
        print(f"\n{DEFAULT_MODEL}, precise={precise}: 64 positions, top-1 agreement with transformers {rate:.3f}")
    assert rate >= (0.98 if precise else 0.9)


def test_first_question_is_answered_as_transformers_answers(default):
    assert_answers_the_first_question_as_transformers(*default, n=16, n_ctx=512)
