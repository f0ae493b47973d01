"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M (`pyinfer pull qwen2.5-coder-1.5b-instruct`), the larger model of the
sparsity work: the pulled file runs in our engine as transformers runs the same GGUF in float32."""
from __future__ import annotations

import pytest
from real_models import (
    ENGLISH,
    assert_answers_the_first_question_as_transformers,
    logits_agreement,
    positions,
    with_oracle,
)

from pyinfer.engine.driver import Model

NAME = "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def qwen15():
    return with_oracle(NAME)


def test_teacher_forced_top1_agrees_with_transformers(qwen15, capsys):
    """64 positions at the defaults (8-bit activations, as llama.cpp's; the model is above PRECISE_MAX_BYTES)."""
    path, hf = qwen15
    model = Model(path, n_ctx=256, kv_type="f32", n_threads=2)
    rate, err = logits_agreement(model, hf, positions(model, ENGLISH))
    with capsys.disabled():
        print(f"\n{NAME}: 64 positions, top-1 agreement with transformers {rate:.3f}, logits {err:.2e} relative")
    assert rate >= 0.9


def test_first_question_is_answered_as_transformers_answers(qwen15):
    assert_answers_the_first_question_as_transformers(*qwen15, n=12, n_ctx=256)
