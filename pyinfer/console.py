"""What every console command shares: failures become one line on stderr (exit 1), Ctrl-C exits 130."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pyinfer.errors import PyInferError


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
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (PyInferError, OSError) as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 1
