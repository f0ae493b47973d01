"""The default model (`pyinfer pull`, `pyinfer chat` without -m): Qwen2.5-Coder-0.5B-Instruct Q4_K_M.

It was chosen by the factual questions of pyinfer/tools/factual_eval.py (the score is printed here, for every
run); our engine on it is checked against transformers loading the same GGUF in float32."""
from __future__ import annotations

import numpy as np
import pytest

from pyinfer.pull import DEFAULT_MODEL, pull
from pyinfer.runtime import Model
from pyinfer.sampling import SamplerParams
from pyinfer.tools import factual_eval

ENGLISH = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
           "movable metal type with an oil-based ink and a wooden press. Within fifty years, printers in more "
           "than two hundred cities had produced millions of books, and the price of a book fell")
CODE = ('def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n    out, i, j = [], 0, 0\n'
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n")


@pytest.fixture(scope="module")
def default():
    path = pull(DEFAULT_MODEL, progress=False)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    return path, hf


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
    above runtime.PRECISE_MAX_BYTES); precise ones leave only float32's summation order."""
    path, hf = default
    import torch

    model = Model(path, n_ctx=512, kv_type="f32", n_threads=2, precise=precise)
    tokens = model.tokenize(text)
    tokens = (tokens * (64 // len(tokens) + 1))[:64]
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].double().numpy()
    ours = model.logits(tokens)
    rate = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    with capsys.disabled():
        print(f"\n{DEFAULT_MODEL}, precise={precise}: 64 positions, top-1 agreement with transformers {rate:.3f}")
    assert rate >= (0.98 if precise else 0.9)


def test_first_question_is_answered_as_transformers_answers(default):
    from pyinfer.chat_template import ChatTemplate

    path, hf = default
    import torch

    model = Model(path, n_ctx=512, n_threads=2)
    prompt = ChatTemplate.from_tokenizer(model.tokenizer).encode(
        model.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    ours = list(model.generate_tokens(prompt, 16, SamplerParams(temperature=0)))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()
    assert "Paris" in model.detokenize(ours)
