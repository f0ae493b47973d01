"""The real GGUF files `pyinfer pull --all` fetches, and transformers loading the same file in float32 as
their oracle: shared texts and helpers of the tests on each."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pyinfer.hub.pull import pull

ENGLISH = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
           "movable metal type with an oil-based ink and a wooden press. Within fifty years, printers in more "
           "than two hundred cities had produced millions of books, and the price of a book fell")
CODE = ('def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n    out, i, j = [], 0, 0\n'
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n")


def with_oracle(name: str):
    """(path of the pulled file, transformers' model of it in float32)."""
    from transformers import AutoModelForCausalLM

    path: Path = pull(name, progress=False)
    return path, AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


def hf_logits(hf, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].double().numpy()


def positions(model, text: str, n: int = 64) -> list[int]:
    """n tokens of text (repeated as needed)."""
    tokens = model.tokenize(text)
    return (tokens * (n // len(tokens) + 1))[:n]


def top1_agreement(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))


def logits_agreement(model, hf, tokens) -> tuple[float, float]:
    """(top-1 agreement, relative logit error) of our logits against transformers' for tokens."""
    ours, theirs = model.logits(tokens), hf_logits(hf, tokens)
    return top1_agreement(ours, theirs), float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def greedy_answers(model, hf, question: str, n: int) -> tuple[list[int], list[int]]:
    """(ours, transformers') greedy answer tokens to one user message through the model's chat template; ours
    ends at the end of its turn, transformers' is cut to the same length."""
    import torch

    from pyinfer.engine.sampling import SamplerParams
    from pyinfer.formats.chat_template import ChatTemplate

    template = ChatTemplate.from_tokenizer(model.tokenizer)
    prompt = template.encode(model.tokenizer, [{"role": "user", "content": question}])
    ours = list(model.generate_tokens(prompt, n, SamplerParams(temperature=0)))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False)
    return ours, theirs[0, len(prompt):].tolist()


def assert_answers_the_first_question_as_transformers(path, hf, n: int, n_ctx: int) -> None:
    """The question new users ask first, greedily: our tokens are transformers' tokens, and they say Paris."""
    from pyinfer.engine.driver import Model

    model = Model(path, n_ctx=n_ctx, n_threads=2)
    ours, theirs = greedy_answers(model, hf, "What is the capital of France?", n)
    assert ours == theirs
    assert "Paris" in model.detokenize(ours)
