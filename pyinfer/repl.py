"""The terminal side of `pyinfer chat`: the interactive REPL and the scripted (stdin is not a TTY) mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pyinfer.chat import HELP, ChatSession
from pyinfer.errors import PyInferError


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def slash_command(session: ChatSession, line: str) -> bool:
    """Runs a /command; returns False when the session should end."""
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
        print("[system prompt set; conversation cleared]" if arg else "[system prompt removed]")
    elif name == "stats":
        t = session.model.timings
        print(f"last answer: {session.last.line()}")
        print(f"session: {session.n_turns} turns, {t.prompt_tokens} prompt tokens in {t.prompt_ms:.0f} ms, "
              f"{t.eval_tokens} generated in {t.eval_ms:.0f} ms; context {session.model.n_past}/{session.model.n_ctx}")
        print(f"device: CPU, {session.model.n_threads} threads")
    elif name in ("save", "load"):
        if not arg:
            print(f"error: /{name} needs a file name")
        elif name == "save":
            session.save(arg)
            print(f"[saved {len(session.messages)} messages to {arg}]")
        else:
            session.load(arg)
            print(f"[loaded {len(session.messages)} messages from {arg}]")
    else:
        print(f"error: unknown command /{name} (try /help)")
    return True


def _read_message() -> str:
    """One message; a line ending in a backslash continues on the next."""
    lines = []
    prompt = "> "
    while True:
        line = input(prompt)
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = ". "
            continue
        lines.append(line)
        return "\n".join(lines)


def _setup_readline() -> None:
    try:
        import readline
    except ImportError:  # pragma: no cover - platforms without readline
        return
    from pyinfer.pull import cache_dir

    history = cache_dir() / "chat_history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except OSError:
        return
    import atexit

    def save():
        try:
            readline.write_history_file(history)
        except OSError:
            pass

    atexit.register(save)


def interactive(session: ChatSession, model_name: str) -> int:
    _setup_readline()
    print(f"pyinfer chat: {Path(model_name).name}, context {session.model.n_ctx} tokens. /help for commands, "
          "Ctrl-C stops an answer, Ctrl-D leaves.")
    while True:
        try:
            line = _read_message()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if not slash_command(session, line.strip()):
                    return 0
                continue
            session.reply(line, on_text=_write)
            print()
        except KeyboardInterrupt:
            print("\n[stopped]")
        except PyInferError as exc:
            print(f"error: {exc}")


def scripted(session: ChatSession, as_json: bool) -> int:
    """One message per stdin line; answers (or JSON objects) on stdout."""
    for raw in sys.stdin:
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if not slash_command(session, line.strip()):
                    return 0
                continue
            answer = session.reply(line, on_text=None if as_json else _write)
        except PyInferError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        if as_json:
            s = session.last
            print(json.dumps({
                "user": line, "assistant": answer, "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens, "generated_tokens": s.gen_tokens,
                "prompt_ms": round(s.prompt_ms, 2), "generation_ms": round(s.gen_ms, 2),
                "tokens_per_second": round(1e3 * s.gen_tokens / s.gen_ms, 2) if s.gen_ms else 0.0,
                "dropped_turns": s.dropped_turns,
            }, ensure_ascii=False), flush=True)
        else:
            _write("\n")
    return 0
