"""Lazy reader of a folder of *.safetensors files (single or sharded), float weights as float32 numpy.

Headers are checked as the reference implementation checks them: JSON entries of a known dtype, a shape
and offsets, the tensors' bytes following each other from the start of the data without gaps or overlaps
to its end, each exactly as long as its shape needs. A shard index names plain files of the folder.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from pyinfer.converters.hf_json import Map, Obj, checked, parse_json, read_json_file
from pyinfer.errors import ModelFormatError
from pyinfer.formats.gguf_schema import Array, Int, Str, show

# safetensors dtype -> (numpy storage dtype, bytes per element); BF16 is widened by hand
_DTYPES = {"F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}
# every dtype the format defines, with its size (the ones above are those the converter reads)
_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100 << 20  # the format caps its JSON header at 100 MB
_OFFSET = Int(0, 2**63 - 1)
_ENTRY = Obj((("dtype", Str(16)), ("shape", Array(_OFFSET, 0, 8)), ("data_offsets", Array(_OFFSET, 2, 2))),
             required=("dtype", "shape", "data_offsets"))
_INDEX = Obj((("weight_map", Map(Str(255))),), required=("weight_map",))


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
                if t.name in self.tensors:
                    raise ModelFormatError(f"{path}: tensor {t.name} is also in {self.tensors[t.name].file}")
                self.tensors[t.name] = t

    @staticmethod
    def _shard_files(folder: str) -> list[str]:
        """Files named by model.safetensors.index.json, else every *.safetensors in the folder."""
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            names = sorted(set(checked(_INDEX, read_json_file(index), index)["weight_map"].values()))
            for name in names:
                if name in ("", ".", "..") or os.path.basename(name) != name:
                    raise ModelFormatError(f"{index}: shard {name!r} is not a file name in the folder")
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
        """Parse the JSON header; the tensors' byte ranges must tile the data section in order."""
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelFormatError(f"{path}: truncated or invalid safetensors header")
            try:
                header = parse_json(f.read(n))
            except ValueError as exc:
                raise ModelFormatError(f"{path}: invalid safetensors header JSON ({exc})") from None
        header = checked(Obj((("__metadata__", Map(Str())),)), header, path)
        base, out = 8 + n, []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if not name.isprintable():  # names appear in messages, which must stay one line
                raise ModelFormatError(f"{path}: tensor name {show(name)} is not printable")
            checked(_ENTRY, entry, f"{path}: {name}")
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            if dtype not in _DTYPE_SIZES:
                raise ModelFormatError(f"{path}: {name} has unknown dtype {dtype!r}")
            if end - start != math.prod(shape) * _DTYPE_SIZES[dtype]:
                raise ModelFormatError(f"{path}: {name} has {end - start} bytes for shape {list(shape)} {dtype}")
            out.append(SourceTensor(name, dtype, shape, path, base + start, base + end))
        expected = base
        for t in sorted(out, key=lambda t: (t.start, t.end)):
            if t.start != expected:
                raise ModelFormatError(f"{path}: {t.name} starts at data byte {t.start - base}, expected "
                                       f"{expected - base} (tensors must follow each other without gaps or overlaps)")
            expected = t.end
        if expected != size:
            raise ModelFormatError(f"{path}: truncated safetensors file: the tensors need {expected} bytes, the "
                                   f"file has {size}" if expected > size else
                                   f"{path}: {size - expected} bytes after the last tensor")
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
