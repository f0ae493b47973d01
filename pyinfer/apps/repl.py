"""The terminal side of `pyinfer chat`: the interactive REPL and the scripted (stdin is not a TTY) mode.
Every failure a user can cause is one line, and only /exit, Ctrl-D or Ctrl-C at an empty prompt end it."""

from __future__ import annotations

import contextlib
import json
import sys

from pyinfer import arguments
from pyinfer.apps.chat import ENDINGS, HELP, ChatSession
from pyinfer.console import one_line
from pyinfer.errors import PyInferError


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stats_text(session: ChatSession) -> str:
    model = session.model
    t = model.timings
    lines = [f"last answer: {session.last.line()}",
             f"session: {session.n_turns} turns, {len(session.messages)} messages kept, {t.prompt_tokens} prompt "
             f"tokens in {t.prompt_ms:.0f} ms, {t.eval_tokens} generated in {t.eval_ms:.0f} ms; "
             f"context {model.n_past}/{model.n_ctx}"]
    layers = model.n_gpu_layers - model.head_on_gpu  # n_gpu_layers counts the head as a layer, as llama.cpp
    gpu = (f"{layers}/{model.config.n_layer} layers{' and the output head' if model.head_on_gpu else ''} on the GPU, "
           if model.n_gpu_layers else "")
    lines.append(f"device: {gpu}CPU with {model.n_threads} threads")
    if total := t.extra.get("ffn_rows_total"):
        lines.append(f"sparse FFN: {100 * t.extra['ffn_rows_active'] / total:.1f}% of the CPU's neuron rows computed")
    return "\n".join(lines)


def dropped_notice(n: int) -> str:
    return f"[context full: dropped the oldest turn{'s' if n > 1 else ''} ({n})]"


def slash_command(session: ChatSession, line: str) -> bool:
    """Runs a /command; returns False when the session should end. Failures raise PyInferError."""
    name, _, arg = line[1:].partition(" ")
    arg = arg.strip()
    if name in ("exit", "quit"):
        return False
    if name == "help":
        print(HELP)
    elif name == "reset":
        session.reset()
        print("[conversation cleared]")
    elif name == "system":
        session.system = arg or None
        session.reset()
        print("[system prompt set; conversation cleared]" if arg else "[system prompt removed; conversation cleared]")
    elif name == "stats":
        print(stats_text(session))
    elif name in ("save", "load") and not arg:
        raise PyInferError(f"/{name} needs a file name")
    elif name == "save":
        session.save(arg)
        print(f"[saved {len(session.messages)} messages to {arg}]")
    elif name == "load":
        session.load(arg)
        print(f"[loaded {len(session.messages)} messages from {arg}]")
    else:
        raise PyInferError(f"unknown command /{name} (try /help)")
    return True


def _pending_input() -> bool:
    """Whether the line being edited holds text (so Ctrl-C clears it rather than leaving)."""
    try:
        import readline
    except ImportError:  # pragma: no cover - platforms without readline
        return False
    return bool(readline.get_line_buffer())


def _read_message() -> str | None:
    """One message; a line ending in a backslash continues on the next. None: leave (Ctrl-D, or Ctrl-C
    at an empty prompt); Ctrl-C with something typed discards it."""
    lines: list[str] = []
    while True:
        try:
            line = input(". " if lines else "> ")
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:
            print()
            if lines or _pending_input():
                return ""
            return None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _setup_readline() -> None:
    """Line editing, and history kept in the cache folder across sessions."""
    try:
        import readline
    except ImportError:  # pragma: no cover - platforms without readline
        return
    import atexit

    from pyinfer.hub.pull import cache_dir

    history = cache_dir() / "chat_history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except OSError:
        return
    readline.set_history_length(1000)

    def save():
        try:
            readline.write_history_file(history)
        except OSError:
            pass

    atexit.register(save)


def _tolerant_stdin() -> None:
    """Undecodable input bytes become surrogates (which the line check reports) instead of a decode
    error that would end the session."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")


def interactive(session: ChatSession, banner: str) -> int:
    _tolerant_stdin()
    _setup_readline()
    print(banner)
    print("/help for commands, Ctrl-C stops an answer, Ctrl-D leaves.")
    while True:
        line = _read_message()
        if line is None:
            return 0
        if not line.strip():
            continue
        try:
            arguments.text("the line", line)
            if line.startswith("/"):
                if not slash_command(session, line.strip()):
                    return 0
                continue
            session.reply(line, on_text=_write, on_dropped=lambda n: print(dropped_notice(n)))
            print()
            if ending := ENDINGS[session.last.ending]:
                print(ending)
        except KeyboardInterrupt:
            print("\n[stopped]")
        except PyInferError as exc:
            print(f"error: {one_line(exc)}")


def scripted(session: ChatSession, as_json: bool) -> int:
    """One message per stdin line; answers (or one JSON object per turn) on stdout, the rest (slash
    commands' output, notices, errors) on stderr."""
    def notice(n: int) -> None:
        print(dropped_notice(n), file=sys.stderr, flush=True)

    _tolerant_stdin()
    for n, raw in enumerate(sys.stdin, 1):
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        try:
            arguments.text(f"line {n}", line)
            if line.startswith("/"):
                with contextlib.redirect_stdout(sys.stderr):
                    go_on = slash_command(session, line.strip())
                if not go_on:
                    return 0
                continue
            answer = session.reply(line, on_text=None if as_json else _write, on_dropped=notice)
        except PyInferError as exc:
            print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
            continue
        if as_json:
            s = session.last
            print(json.dumps({
                "user": line, "assistant": answer, "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens, "generated_tokens": s.gen_tokens,
                "prompt_ms": round(s.prompt_ms, 2), "generation_ms": round(s.gen_ms, 2),
                "tokens_per_second": round(1e3 * s.gen_tokens / s.gen_ms, 2) if s.gen_ms else 0.0,
                "dropped_turns": s.dropped_turns, "ending": s.ending,
            }, ensure_ascii=False), flush=True)
        else:
            _write("\n")
        if ending := ENDINGS[session.last.ending]:
            print(ending, file=sys.stderr, flush=True)
    return 0
