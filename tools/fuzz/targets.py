"""What one fuzz case runs, inside its child process, and how its result is classified.

A GGUF goes through the Python API (load, tokenize, logits of a short prompt, three greedy tokens, the
chat template rendered) and through `pyinfer run -m FILE`; converter inputs go through
`convert-hf-to-powergguf`, whose output must then load and run. Outcomes, from good to bad:
ok, error (one line), nonfinite_caught (the one-line error for NaN/inf logits), then the failures:
nonfinite (finite check bypassed: logits returned with NaN/inf), multiline (an error of several lines),
traceback, memory (MemoryError or an allocation from an unchecked size), leftover (a `.part` file or a
half-written output left behind), signal, timeout."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import traceback

import numpy as np

from pyinfer.apps import cli
from pyinfer.converters import convert_hf_to_powergguf
from pyinfer.engine.driver import Model
from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import AllocationError, PyInferError
from pyinfer.formats.chat_template import ChatTemplate

OUTCOMES = ("ok", "error", "nonfinite_caught", "nonfinite", "multiline", "traceback", "memory", "leftover", "signal",
            "timeout")
BAD = frozenset(OUTCOMES[3:])
PROMPT = "Hello world, this is a test."
NONFINITE_MESSAGE = "non-finite logits"


def worst(*outcomes: tuple[str, str]) -> tuple[str, str]:
    """The (outcome, detail) that is furthest down OUTCOMES."""
    return max(outcomes, key=lambda o: OUTCOMES.index(o[0]))


def classify_exception(exc: BaseException) -> tuple[str, str]:
    text = str(exc)
    if isinstance(exc, (MemoryError, AllocationError)):
        return "memory", f"{type(exc).__name__}: {text[:300]}"
    if isinstance(exc, PyInferError):
        if "\n" in text.strip() or not text.strip():
            return "multiline", text[:300]
        return ("nonfinite_caught" if NONFINITE_MESSAGE in text else "error"), text[:300]
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
    return "traceback", f"{type(exc).__name__}: {' '.join(text.split())[:300]}{where}"


def api_run(path: str) -> tuple[str, str]:
    """Load, tokenize, logits, three greedy tokens and the chat template, as a user of the API would."""
    try:
        model = Model(path, n_ctx=64, n_threads=1)
        ids = model.tokenize(PROMPT)[:32] or [0]
        logits = model.logits(ids)
        if not np.isfinite(logits).all():
            return "nonfinite", f"logits of {len(ids)} tokens hold NaN/inf"
        model.reset()
        tokens = list(model.generate_tokens(ids, 3, SamplerParams(temperature=0.0), seed=0, stop_at_eos=False))
        model.detokenize(tokens)
        ChatTemplate.from_tokenizer(model.tokenizer).render([{"role": "user", "content": "hi"}])
        return "ok", ""
    except BaseException as exc:  # everything a user could see is classified, nothing escapes the child
        return classify_exception(exc)


@contextlib.contextmanager
def stderr_to(path: str):
    """fd 2 (and so sys.stderr) goes to path within the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def cli_run(main, argv: list[str], stderr_path: str, prog: str) -> tuple[str, str, int]:
    """(outcome, detail, exit status) of a console entry point: exit 1 must come with exactly one line on
    stderr, `{prog}error: ...` (notes before it are fine); an exception escaping main is a traceback."""
    try:
        with stderr_to(stderr_path):
            rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        outcome, detail = classify_exception(exc)
        return ("traceback" if outcome != "memory" else outcome), f"escaped main: {detail}", -1
    with open(stderr_path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().splitlines() if line.strip() and not line.startswith(f"{prog}note:")]
    if rc == 0:
        return "ok", "", rc
    if rc == 1 and len(lines) == 1 and lines[0].startswith(f"{prog}error: "):
        message = lines[0][len(prog) + 7:]
        return ("nonfinite_caught" if NONFINITE_MESSAGE in message else "error"), message[:300], rc
    if rc == 128 + signal.SIGTERM and lines == [f"{prog}terminated"]:
        return "error", "terminated by SIGTERM while writing: cleaned up, exit 143", rc
    tail = " | ".join(lines[-3:])[:300]
    return ("traceback" if any("Traceback" in line for line in lines) else "multiline"), f"exit {rc}: {tail}", rc


def load_target(path: str, workdir: str) -> tuple[str, str]:
    api = api_run(path)
    argv = ["run", "-m", path, "-p", PROMPT, "-n", "3", "--temp", "0", "-t", "1", "-c", "64"]
    outcome, detail, _ = cli_run(cli.main, argv, os.path.join(workdir, "cli.stderr"), "")
    return worst(api, (outcome, f"cli: {detail}" if detail else ""))


def leftovers(folders: list[str]) -> list[str]:
    """Temporary files a converter left in folders."""
    return sorted(p for folder in folders for p in glob.glob(os.path.join(glob.escape(folder), ".*.part")))


def convert_target(argv: list[str], workdir: str) -> tuple[str, str]:
    """The converter on argv; on success every output must load and run."""
    conv = convert_hf_to_powergguf
    outputs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-o", "--dense-gguf")]
    outcome, detail, rc = cli_run(conv.main, argv, os.path.join(workdir, "convert.stderr"), f"{conv.PROG}: ")
    left = leftovers(sorted({os.path.dirname(os.path.realpath(p)) for p in outputs}))
    if left:
        return "leftover", f"{', '.join(map(os.path.basename, left))} after exit {rc}"
    if outcome != "ok":
        return outcome, detail
    results = [api_run(p) for p in outputs if os.path.isfile(p)]
    return worst(("ok", ""), *((o, f"output: {d}") for o, d in results))
