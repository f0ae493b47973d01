"""Turns what a user passes as `-m` into a GGUF path: a file as it is, a Hugging Face checkpoint folder
converted once into the cache, nothing at all the default model (pulled on first use)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from pyinfer.errors import ModelFormatError
from pyinfer.pull import DEFAULT_MODEL, cache_dir, default_model_path, pull


def converted_path(folder: Path) -> Path:
    """Cache location of a checkpoint folder's PowerGGUF, keyed by the folder and its files' mtimes."""
    stamp = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            stamp.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return cache_dir() / "converted" / f"{folder.name}-{stamp.hexdigest()[:12]}.powergguf"


def resolve_model(arg: str | os.PathLike[str] | None) -> str:
    if arg is None:
        if not default_model_path().is_file():
            print(f"first run: fetching the default model {DEFAULT_MODEL} into {default_model_path().parent}",
                  file=sys.stderr, flush=True)
        return str(pull())
    path = Path(arg)
    if path.is_dir():
        out = converted_path(path)
        if not out.is_file():
            from pyinfer.converters.convert_hf_to_powergguf import convert

            out.parent.mkdir(parents=True, exist_ok=True)
            print(f"converting {path} to {out}", file=sys.stderr, flush=True)
            convert(path, out, outtype="f16")
        return str(out)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder")
    return str(path)
