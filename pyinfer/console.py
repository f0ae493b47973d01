"""What every console command shares: failures become one line on stderr (exit 1), Ctrl-C exits 130,
and SIGTERM/SIGHUP while files are written are handled like Ctrl-C (cleanup, then exit 128 + signal)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from pyinfer.errors import PyInferError


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived inside `terminate_as_interrupt`: unwinds like Ctrl-C, so that what
    catches KeyboardInterrupt to clean up (half-written files) does so."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise Terminated (once: a second one during cleanup is ignored).
    Signal handlers belong to the main thread; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGTERM, signal.SIGHUP)
    received: list[Terminated] = []

    def handler(signum, _frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        received.append(Terminated(signum))
        raise received[0]

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    except Exception as e:
        # code that catches whatever its own step raised can turn the Terminated into another error (numpy's
        # tofile tries the file as a path first and reports a TypeError when that raised): still a termination
        if received:
            raise received[0] from e
        raise
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def interrupted(prog: str, exc: KeyboardInterrupt) -> int:
    """Reports Ctrl-C or a termination on stderr; returns the exit status (130, or 128 + the signal)."""
    terminated = isinstance(exc, Terminated)
    print(f"{prog}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    return 128 + exc.signum if terminated else 130


def one_line(exc: BaseException) -> str:
    """An error as one line: OSErrors as 'file: reason', the rest with white space folded."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename or ''}: {exc.strerror}".lstrip(": ")
    return " ".join(str(exc).split())


def run_cli(prog: str, parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int],
            argv: list[str] | None) -> int:
    """Parses argv, runs body(args), and reports a failure as one line."""
    args = parser.parse_args(argv)
    try:
        return body(args)
    except KeyboardInterrupt as exc:
        return interrupted(prog, exc)
    except (PyInferError, OSError) as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 1
