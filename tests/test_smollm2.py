"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, the smallest model `pyinfer pull` knows) through our engine
against transformers loading the same GGUF (dequantized to float32). The README's test command pulls it."""
from __future__ import annotations

import pytest
from real_models import greedy_answers, hf_logits, logits_agreement, top1_agreement, with_oracle

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import Model
from pyinfer.engine.sampling import SamplerParams
from pyinfer.hub.pull import SMALLEST_MODEL

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type with an oil-based ink and a wooden press. Within fifty years, printers in more "
        "than two hundred cities had produced millions of books, and")


@pytest.fixture(scope="module")
def smollm():
    return with_oracle(SMALLEST_MODEL)


@pytest.mark.parametrize("precise", [False, True])
def test_teacher_forced_top1_agrees_with_transformers(smollm, capsys, precise):
    path, hf = smollm
    model = Model(path, n_ctx=512, kv_type="f32", precise=precise)
    tokens = model.tokenize(TEXT)
    rate, rel = logits_agreement(model, hf, tokens)
    with capsys.disabled():
        print(f"\nSmolLM2-135M Q4_1, precise={precise}, {len(tokens)} positions: top-1 agreement with "
              f"transformers {rate:.3f}, relative logit error {rel:.5f}")
    if precise:  # transformers runs float32: only the summation order differs
        assert rate == 1.0 and rel < 1e-3
    else:  # activations quantized to Q8_1 blocks for the dot products, as llama.cpp does
        assert rate >= 0.9 and rel < 0.08


def test_first_question_at_temperature_0(smollm):
    """The issue a new user met: the chat template's default system prompt, temperature 0. The two best
    first tokens ("The", "L") are 0.08 apart in float64; 8-bit activations flipped them, and the answer
    went on in French. Precise matmuls (the default for small models) answer as transformers does."""
    path, hf = smollm
    model = Model(path, n_ctx=512)
    assert model.precise  # "auto" for a model this small
    ours, theirs = greedy_answers(model, hf, "What is the capital of France?", 12)
    assert ours == theirs
    assert "Paris" in model.detokenize(ours)


def test_greedy_answer_equals_transformers(smollm):
    path, hf = smollm
    model = Model(path, n_ctx=512)
    prompt = model.tokenize("The capital of France is")
    ours = list(model.generate_tokens(prompt, 16, SamplerParams(temperature=0), stop_at_eos=False))
    import torch

    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert ours == theirs[0, len(prompt):].tolist()
    assert "Paris" in model.detokenize(ours)


def test_converted_powergguf_agrees(smollm, tmp_path, capsys):
    """Our converter's PowerGGUF (ffn_down_t requantized to Q8_0) stays close to the source file."""
    path, hf = smollm
    out = tmp_path / "smollm-power.gguf"
    assert conv.main([str(path), "-o", str(out)]) == 0
    model = Model(out, n_ctx=512, kv_type="f32")
    tokens = model.tokenize(TEXT)
    rate = top1_agreement(model.logits(tokens), hf_logits(hf, tokens))
    with capsys.disabled():
        print(f"\nSmolLM2-135M PowerGGUF (down_t Q8_0): top-1 agreement with transformers {rate:.3f}")
    assert rate >= 0.85
