"""Planned GGUF outputs and their atomic, streaming write (one tensor in memory at a time)."""
from __future__ import annotations

import math
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from tqdm import tqdm

from pyinfer.console import terminate_as_interrupt
from pyinfer.errors import InvalidArgumentError

Q = GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# types gguf-py can quantize to (the rest it can only dequantize)
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
KV = tuple[str, Any, GGUFValueType, GGUFValueType | None]  # a metadata entry: key, value, type, array item type


# llama.cpp's file types for matrix types it names differently: no all-Q4_K type (its Q4_K_S mix is the one of
# mostly Q4_K); MXFP4 is named for gpt-oss's mix (MXFP4 experts)
FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
              Q.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE}


def file_type(qtype: GGMLQuantizationType) -> int:
    """general.file_type of a file whose matrices are all of qtype."""
    return int(FILE_TYPES[qtype] if qtype in FILE_TYPES else LlamaFileType[f"MOSTLY_{qtype.name}"])


@dataclass
class OutTensor:
    """A tensor to write: numpy-order shape in elements, its GGML type and a function giving its bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    produce: Callable[[], np.ndarray]

    @classmethod
    def as_stored(cls, info) -> OutTensor:
        """A tensor of a file being read (gguf_file.TensorInfo), written with its bytes and type unchanged."""
        return cls(info.name, tuple(reversed(info.ne)), GGMLQuantizationType(info.type), lambda: info.data)

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * type_size


@dataclass
class OutFile:
    """One GGUF to write."""

    path: str
    arch: str
    kv: list[KV]
    tensors: list[OutTensor]


def encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float values (numpy order) -> the array whose bytes are the tensor's data in `qtype`."""
    return quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)


def pick_type(name: str, shape: tuple[int, ...], outtype: GGMLQuantizationType,
              notes: list[str]) -> GGMLQuantizationType:
    """llama.cpp's rule: 1-D tensors, biases, learned positions, a mixture's routers (a rounded router can choose
    other experts) and a convolution's taps (Qwen3.5's, which its op takes in F32) stay F32; rows not a whole number
    of blocks -> F16."""
    if (len(shape) == 1 or name.endswith(".bias") or name.startswith("position_embd")
            or name.endswith(("ffn_gate_inp.weight", "ssm_conv1d.weight"))):
        return Q.F32
    block = GGML_QUANT_SIZES[outtype][0]
    if shape[-1] % block:
        notes.append(f"{name}: row of {shape[-1]} is not a multiple of {outtype.name}'s block {block}; stored as F16")
        return Q.F16
    return outtype


def _temp_path(path: str) -> str:
    """A fresh hidden name next to `path`, so the final rename stays on one file system."""
    folder, base = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.part")


def _write_one(out: OutFile, temp: str, bar: tqdm) -> None:
    """Header, metadata and tensor infos first, then each tensor's data produced and written in turn."""
    writer = GGUFWriter(None, out.arch)
    for key, value, vtype, sub_type in out.kv:
        writer.add_key_value(key, value, vtype, sub_type)
    for t in out.tensors:
        # a non-uint8 dtype tells gguf-py the shape is already in elements
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    writer.open_output_file(Path(temp))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in out.tensors:
            data = t.produce()
            if data.nbytes != t.nbytes:
                raise RuntimeError(f"internal error: {t.name} produced {data.nbytes} bytes, planned {t.nbytes}")
            writer.write_tensor_data(data)
            bar.update(t.nbytes)
    finally:
        writer.close()


def destinations(paths: list[str]) -> list[str]:
    """The files `paths` name (through symbolic links), each a regular file or a new path, all distinct:
    the final rename must never replace a device node (`-o /dev/full` as root), a folder or a FIFO."""
    real = [os.path.realpath(p) for p in paths]
    for path, target in zip(paths, real, strict=True):
        if os.path.exists(target) and not os.path.isfile(target):
            raise InvalidArgumentError(f"{path}: not a regular file (outputs are written only to regular files "
                                       "or new paths)")
    if len(set(real)) != len(real):
        raise InvalidArgumentError(f"two outputs are the same file: {', '.join(paths)}")
    return real


def write_atomically(outputs: list[OutFile]) -> None:
    """Write every output to a temp file, then rename all; on any error, Ctrl-C, SIGTERM or SIGHUP leave
    none behind."""
    targets = destinations([out.path for out in outputs])
    temps: list[str] = []
    total = sum(t.nbytes for out in outputs for t in out.tensors)
    try:
        with terminate_as_interrupt(), tqdm(total=total, unit="B", unit_scale=True, desc="writing",
                                            file=sys.stderr, disable=None) as bar:
            for out, target in zip(outputs, targets, strict=True):
                temps.append(_temp_path(target))
                _write_one(out, temps[-1], bar)
            for temp, target in zip(temps, targets, strict=True):
                os.replace(temp, target)
    except BaseException:
        for temp in temps:
            if os.path.exists(temp):
                os.remove(temp)
        raise
