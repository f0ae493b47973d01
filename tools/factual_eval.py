"""Ten simple factual questions asked through a model's chat template at the default sampling settings,
once per seed: how often does the answer hold the fact? The default model is chosen by this score.

    python -m tools.factual_eval [-m MODEL ...] [--seeds 10]

A model may be a file or a `pyinfer pull` name. An answer is right when it matches the question's pattern
(case-insensitive) and names none of the wrong answers that small models give; the first 48 tokens count.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from pyinfer.console import run_cli

# (question, what a right answer says, what a wrong one says instead)
QUESTIONS: tuple[tuple[str, str, str | None], ...] = (
    ("What is the capital of France?", r"\bparis\b", r"\b(lyon|lille|marseille|nice)\b"),
    ("What is the capital of Japan?", r"\btokyo\b", r"\b(kyoto|osaka)\b"),
    ("How many days are there in a week?", r"\b(7|seven)\b", None),
    ("What is the largest planet in our solar system?", r"\bjupiter\b", r"\b(saturn|earth)\b"),
    ("What is the chemical formula of water?", r"\bh\s*(2|₂)\s*o\b", None),
    ("Who wrote the play Romeo and Juliet?", r"\bshakespeare\b", None),
    ("What is 7 times 8?", r"\b56\b", None),
    ("What color is the sky on a clear day?", r"\bblue\b", None),
    ("How many legs does a spider have?", r"\b(8|eight)\b", r"\b(six|6) legs\b"),
    ("At what temperature in degrees Celsius does water freeze?", r"\b(0|zero)\b", None),
)
MAX_TOKENS = 48


def is_right(answer: str, right: str, wrong: str | None) -> bool:
    text = answer.lower()
    return re.search(right, text) is not None and (wrong is None or re.search(wrong, text) is None)


@dataclass
class Score:
    """Right answers per question over the seeds."""

    model: str
    seeds: int
    right: list[int] = field(default_factory=lambda: [0] * len(QUESTIONS))
    wrong_answers: list[tuple[int, int, str]] = field(default_factory=list)  # (question, seed, answer)

    @property
    def total(self) -> int:
        return sum(self.right)

    def table(self) -> str:
        width = max(len(q) for q, _, _ in QUESTIONS)
        rows = [f"{q:<{width}}  {n}/{self.seeds}" for (q, _, _), n in zip(QUESTIONS, self.right, strict=True)]
        rows.append(f"{'total':<{width}}  {self.total}/{self.seeds * len(QUESTIONS)}")
        return f"{self.model}\n" + "\n".join(rows)


def evaluate(model, name: str, seeds: int = 10, progress: bool = True, system: str | None = None,
             **sampling) -> Score:
    """Ask every question once per seed (0..seeds-1) at SamplerParams' defaults, each on a fresh sequence;
    system: a system prompt (None: the chat template's own default, as `pyinfer chat` has); sampling:
    CompletionOptions' fields instead of the defaults (temperature=...)."""
    score = Score(name, seeds)
    head = [{"role": "system", "content": system}] if system is not None else []
    with tqdm(total=seeds * len(QUESTIONS), desc=name, disable=not progress, unit="answer") as bar:
        for qi, (question, right, wrong) in enumerate(QUESTIONS):
            for seed in range(seeds):
                model.reset()
                res = model.create_chat_completion([*head, {"role": "user", "content": question}], seed=seed,
                                                   max_tokens=MAX_TOKENS, **sampling)
                answer = res["choices"][0]["message"]["content"]
                if is_right(answer, right, wrong):
                    score.right[qi] += 1
                else:
                    score.wrong_answers.append((qi, seed, answer))
                bar.update()
    return score


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.factual_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", help="model file or pull name (repeatable; default: the "
                    "three models pyinfer pull knows)")
    ap.add_argument("--seeds", type=int, default=10, help="answers per question (default 10)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: pyinfer run's)")
    ap.add_argument("--show-wrong", action="store_true", help="print the wrong answers")
    ap.add_argument("--temp", type=float, default=None, help="temperature (default: SamplerParams')")
    ap.add_argument("-sys", "--system-prompt", default=None, help="system prompt (default: the template's own)")
    return ap


def run(args: argparse.Namespace) -> int:
    from pyinfer.engine.driver import Model
    from pyinfer.hub.model_files import resolve_model
    from pyinfer.hub.pull import REGISTRY

    for name in args.model or sorted(REGISTRY):
        model = Model(resolve_model(name), n_threads=args.threads, n_ctx=512)
        sampling = {} if args.temp is None else {"temperature": args.temp}
        score = evaluate(model, name, args.seeds, system=args.system_prompt, **sampling)
        print(score.table())
        if args.show_wrong:
            for qi, seed, answer in score.wrong_answers:
                print(f"  q{qi} seed {seed}: {answer!r}")
        sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("factual_eval", parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
