"""Checks of Python API arguments: a wrong one is an InvalidArgumentError naming it, never a numpy or
cffi exception from deeper down (an id of 2^31 overflowing int32, a float silently truncated, text that
is not UTF-8 reaching the tokenizer library)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np

from pyinfer.errors import InvalidArgumentError


def integer(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """value as an int in [lo, hi]; bools and floats are refused rather than converted."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an integer, not {type(value).__name__} {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if lo is not None and hi is not None else (f">= {lo}" if lo is not None
                                                                                  else f"<= {hi}")
        raise InvalidArgumentError(f"{name} must be {bounds}, not {value}")
    return value


def number(name: str, value, lo: float = -math.inf, hi: float = math.inf) -> float:
    """value as a finite float in [lo, hi]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} must be a finite number in [{lo:g}, {hi:g}], not {value!r}")
    return value


def token_ids(value, n_vocab: int, name: str = "token ids") -> np.ndarray:
    """A non-empty 1-D sequence of token ids, each in [0, n_vocab), as int32 (n,)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
        if value.size and (value.min() < 0 or value.max() >= n_vocab):
            bad = value[(value < 0) | (value >= n_vocab)][0]
            raise InvalidArgumentError(f"{name} must be in [0, {n_vocab}), not {bad}")
        ids = value.astype(np.int32)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, np.ndarray)):
        ids = np.array([integer(name, v, 0, n_vocab - 1) for v in value], dtype=np.int32)
    else:
        raise InvalidArgumentError(f"{name} must be a 1-D sequence of integers, not {type(value).__name__}")
    if ids.size == 0:
        raise InvalidArgumentError(f"{name} must not be empty")
    return ids


def text(name: str, value) -> str:
    """value as a str that is valid Unicode text (no lone surrogates, which is what bytes that are not
    UTF-8 become in command-line arguments and stdin)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be a str, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"{name} is not valid UTF-8 text ({_bad_bytes(value, exc)})") from None
    return value


def utf8(name: str, data: bytes) -> str:
    """bytes decoded as UTF-8, or an error saying where they are not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                                   f"{exc.start})") from None


def _bad_bytes(value: str, exc: UnicodeEncodeError) -> str:
    char = value[exc.start]
    if 0xDC80 <= ord(char) <= 0xDCFF:  # surrogateescape's stand-in for an undecodable byte
        return f"byte 0x{ord(char) - 0xDC00:02x} at character {exc.start}"
    return f"lone surrogate U+{ord(char):04X} at character {exc.start}"


def shapes(name: str, value: str) -> list[tuple[int, int]]:
    """Comma-separated AxB pairs of positive integers (a benchmark's matrix shapes, e.g. 5120x13824)."""
    out = []
    for part in value.split(","):
        dims = part.strip().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise InvalidArgumentError(f"{name} {value!r}: want pairs of positive integers such as 5120x13824")
        out.append((int(dims[0]), int(dims[1])))
    return out
