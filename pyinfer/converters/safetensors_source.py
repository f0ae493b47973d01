"""Lazy reader of a folder of *.safetensors files (single or sharded), float weights as float32 numpy."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from pyinfer.errors import ModelFormatError

# safetensors dtype -> (numpy storage dtype, bytes per element); BF16 is widened by hand
_DTYPES = {"F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}
_MAX_HEADER = 100 << 20  # the format caps its JSON header at 100 MB


@dataclass(frozen=True)
class SourceTensor:
    """One stored tensor: where its bytes are and how to read them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int


class SafetensorsSource:
    """Every tensor of a HF checkpoint folder, validated against file sizes, loaded on demand."""

    def __init__(self, folder: str):
        files = self._shard_files(folder)
        self.tensors: dict[str, SourceTensor] = {}
        self._maps: dict[str, np.memmap] = {}
        for path in files:
            for t in self._read_header(path):
                self.tensors[t.name] = t

    @staticmethod
    def _shard_files(folder: str) -> list[str]:
        """Files named by model.safetensors.index.json, else every *.safetensors in the folder."""
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelFormatError(f"{index}: unreadable shard index ({exc})") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        if not names:
            raise ModelFormatError(f"{folder}: no *.safetensors files (other weight formats are not supported)")
        paths = [os.path.join(folder, n) for n in names]
        for p in paths:
            if not os.path.isfile(p):
                raise ModelFormatError(f"{p}: missing safetensors shard")
        return paths

    def _read_header(self, path: str) -> list[SourceTensor]:
        """Parse the JSON header; every tensor's byte range must fit in the file and match its shape."""
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelFormatError(f"{path}: truncated or invalid safetensors header")
            try:
                header = json.loads(f.read(n))
            except ValueError:
                raise ModelFormatError(f"{path}: invalid safetensors header JSON") from None
        if not isinstance(header, dict):
            raise ModelFormatError(f"{path}: invalid safetensors header")
        base, out = 8 + n, []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, (start, end) = entry["dtype"], entry["data_offsets"]
                shape = tuple(int(s) for s in entry["shape"])
            except (KeyError, TypeError, ValueError):
                raise ModelFormatError(f"{path}: malformed header entry for {name}") from None
            if base + end > size:
                raise ModelFormatError(
                    f"{path}: truncated safetensors file: {name} ends at byte {base + end} of {size}")
            if dtype in _DTYPES and end - start != int(np.prod(shape)) * _DTYPES[dtype][1]:
                raise ModelFormatError(f"{path}: {name} has {end - start} bytes for shape {list(shape)} {dtype}")
            out.append(SourceTensor(name, dtype, shape, path, base + start, base + end))
        return out

    def require(self, name: str) -> SourceTensor:
        """The tensor `name`, which must exist and hold floats of a known dtype."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"checkpoint lacks tensor {name}")
        if t.dtype not in _DTYPES:
            raise ModelFormatError(f"{t.file}: tensor {name} has unsupported dtype {t.dtype}")
        return t

    def load(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 (exact for F32/F16/BF16 sources)."""
        t = self.require(name)
        if t.file not in self._maps:
            self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        storage, _ = _DTYPES[t.dtype]
        raw = self._maps[t.file][t.start:t.end].view(storage).reshape(t.shape)
        if t.dtype == "BF16":
            # bfloat16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)
