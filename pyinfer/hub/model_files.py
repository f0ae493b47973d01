"""Turns what a user passes as `-m` into a GGUF path: a file as it is, a Hugging Face checkpoint folder
converted once into the cache, a `pyinfer pull` name (pulled on first use), nothing at all the default model."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from pyinfer.errors import ModelFormatError
from pyinfer.hub.pull import DEFAULT_MODEL, REGISTRY, cache_dir, model_path, pull


def converted_path(folder: Path) -> Path:
    """Cache location of a checkpoint folder's PowerGGUF, keyed by the folder and its files' mtimes."""
    stamp = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            stamp.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return cache_dir() / "converted" / f"{folder.name}-{stamp.hexdigest()[:12]}.powergguf"


def resolve_model(arg: str | os.PathLike[str] | None) -> str:
    if arg is None or (str(arg) in REGISTRY and not Path(arg).exists()):
        name = DEFAULT_MODEL if arg is None else str(arg)
        if not model_path(name).is_file():
            print(f"first run: fetching {'the default model ' if arg is None else ''}{name} into "
                  f"{model_path(name).parent}", file=sys.stderr, flush=True)
        return str(pull(name))
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
        raise ModelFormatError(f"{path}: no such file or folder, nor a model `pyinfer pull` knows "
                               f"({', '.join(sorted(REGISTRY))})")
    return str(path)
