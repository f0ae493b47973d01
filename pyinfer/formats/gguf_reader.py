"""A fast, strict GGUF (v2/v3) header parser over an mmap.

gguf-py's GGUFReader builds a numpy view per array element, which takes seconds on a 49k-token vocabulary;
this reads the same header in tens of milliseconds. Files come from strangers, so nothing here trusts a
number before checking it against the bytes left: a truncated or corrupt file raises ModelFormatError
(its message says what is wrong; the caller adds the path). What it guarantees:
- strings are UTF-8, keys printable ASCII and tensor names printable (so that messages naming them stay
  one line), both unique, arrays nested at most MAX_ARRAY_DEPTH deep;
- every tensor has a known type, 1-4 dimensions of 1 .. 2^63 - 1 elements in all, whole blocks per row,
  and its data follows the previous tensor's at the next aligned offset (llama.cpp's rule: no gaps,
  no overlaps, no shifts), the last one ending where the file does (no bytes the header does not
  describe, which a wrong tensor count leaves).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES

from pyinfer.errors import ModelFormatError
from pyinfer.formats.gguf_schema import KEYS, MAX_ARRAY_DEPTH, show

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME less the terminating zero, as llama.cpp checks
MAX_KEY_BYTES = 65535  # the GGUF spec: keys are ASCII, at most 2^16 - 1 bytes
MAX_DIMS = 4

# value type id -> (struct format, numpy dtype) for the fixed-size types
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<B", np.uint8),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_BOOL, _STRING, _ARRAY = 7, 8, 9
_MIN_VALUE_BYTES = {_STRING: 8, _ARRAY: 12}  # a length, or an element type and a count


@dataclass(frozen=True)
class RawTensor:
    name: str
    type: int
    ne: tuple[int, ...]  # ggml order, ne[0] innermost
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    metadata: dict
    value_types: dict  # key -> (GGUF value type id, array element type id or None)
    tensors: list[RawTensor]
    data_offset: int  # file offset of the data section
    alignment: int
    file_size: int


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int) -> None:
        if n > self.left:
            raise ModelFormatError(f"truncated GGUF header (needs byte {self.pos + n}, file has "
                                   f"{len(self.buf)})")

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return _utf8(raw)

    def value(self, vtype: int, depth: int = 0):
        if vtype == _BOOL:
            return _bool(self.scalar("<B"))
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self._array(depth + 1)
        raise ModelFormatError(f"unknown GGUF value type {vtype}")

    def _array(self, depth: int) -> list:
        if depth > MAX_ARRAY_DEPTH:
            raise ModelFormatError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            self.need(count * dtype.itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if etype == _BOOL:
                if count and arr.max() > 1:
                    raise ModelFormatError(f"bool array holds the byte {int(arr.max())}")
                arr = arr.astype(bool)
            return arr.tolist()
        if etype not in _MIN_VALUE_BYTES:
            raise ModelFormatError(f"unknown GGUF array element type {etype}")
        self.need(count * _MIN_VALUE_BYTES[etype])  # before looping count times
        if etype == _STRING:
            return self._strings(count)
        return [self._array(depth + 1) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        out = []
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                self.need(n)
            try:
                out.append(bytes(buf[pos:pos + n]).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ModelFormatError(f"string {i} of the array is not UTF-8 ({exc.reason} at byte {exc.start})") \
                    from None
            pos += n
        self.pos = pos
        return out


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"string {raw[:40]!r} is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _bool(byte: int) -> bool:
    if byte > 1:
        raise ModelFormatError(f"bool value is the byte {byte}, not 0 or 1")
    return bool(byte)


def _read_metadata(c: _Cursor, n_kv: int) -> tuple[dict, dict]:
    metadata, value_types = {}, {}
    for i in range(n_kv):
        try:
            key = c.string()
        except ModelFormatError as exc:
            raise ModelFormatError(f"metadata key {i + 1} of {n_kv}: {exc}") from None
        if not (key.isascii() and key.isprintable()) or len(key) > MAX_KEY_BYTES:
            raise ModelFormatError(f"metadata key {i + 1} of {n_kv}, {show(key)}, is not printable ASCII of at most "
                                   f"{MAX_KEY_BYTES} bytes")
        if key in metadata:
            raise ModelFormatError(f"metadata key {key} appears twice")
        try:
            vtype = c.scalar("<I")
            etype = struct.unpack_from("<I", c.buf, c.pos)[0] if vtype == _ARRAY and c.left >= 4 else None
            metadata[key] = c.value(vtype)
        except ModelFormatError as exc:
            raise ModelFormatError(f"metadata key {key}: {exc}") from None
        value_types[key] = (vtype, etype)
    return metadata, value_types


def _read_tensor_info(c: _Cursor) -> RawTensor:
    name = c.string()
    if not name.isprintable() or not 0 < len(name.encode()) <= MAX_NAME_BYTES:
        raise ModelFormatError(f"tensor name {show(name)} is empty, longer than {MAX_NAME_BYTES} bytes or not "
                               "printable")
    try:
        n_dims = c.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelFormatError(f"{n_dims} dimensions (1 to {MAX_DIMS})")
        ne = tuple(c.scalar("<Q") for _ in range(n_dims))
        type_, offset = c.scalar("<I"), c.scalar("<Q")
        if not all(ne) or math.prod(ne) >= 2**63:
            raise ModelFormatError(f"shape {list(ne)} (each dimension >= 1, below 2^63 elements in all)")
        if type_ not in GGML_QUANT_SIZES:
            raise ModelFormatError(f"unknown type {type_}")
        block, type_size = GGML_QUANT_SIZES[type_]
        if ne[0] % block:
            raise ModelFormatError(f"rows of {ne[0]} values are not whole blocks of {block}")
    except ModelFormatError as exc:
        raise ModelFormatError(f"tensor {name}: {exc}") from None
    return RawTensor(name, type_, ne, offset, math.prod(ne) // block * type_size)


def _check_layout(tensors: list[RawTensor], data_offset: int, alignment: int, file_size: int) -> None:
    """Each tensor's data starts where the previous one's ends, padded to the alignment; the file ends
    with the last one (its padding may be left out)."""
    expected, names = 0, set()
    for t in tensors:
        if t.name in names:
            raise ModelFormatError(f"tensor {t.name} appears twice")
        names.add(t.name)
        if t.offset != expected:
            raise ModelFormatError(f"tensor {t.name} data is at offset {t.offset}, expected {expected} (tensor data "
                                   f"follows in header order, each {alignment}-byte aligned)")
        end = data_offset + t.offset + t.nbytes
        if end > file_size:
            raise ModelFormatError(f"truncated file: tensor {t.name} needs bytes [{data_offset + t.offset}, {end}) "
                                   f"of {file_size}")
        expected += -(-t.nbytes // alignment) * alignment
    last_end = data_offset + tensors[-1].offset + tensors[-1].nbytes if tensors else data_offset
    described = max(last_end, data_offset + expected)
    if file_size > described:
        raise ModelFormatError(f"{file_size - described} bytes after the last tensor's data that the header does "
                               f"not describe (wrong tensor count?)")


def decode_value(raw: bytes, vtype: int):
    """One encoded metadata value of type vtype, as read_header decodes it."""
    return _Cursor(raw).value(vtype)


def read_header(buf) -> GGUFHeader:
    """Parses the header of a GGUF held in buf (an mmap or bytes) and checks the tensor layout."""
    c = _Cursor(buf)
    c.need(4)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFormatError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
    c.pos = 4
    version = c.scalar("<I")
    if version not in (2, 3):
        raise ModelFormatError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    if n_kv * 13 + n_tensors * 33 > c.left:  # the smallest key/value and tensor info
        raise ModelFormatError(f"implausible GGUF header: {n_tensors} tensors and {n_kv} keys in {len(buf)} bytes")
    metadata, value_types = _read_metadata(c, n_kv)
    tensors = []
    for i in range(n_tensors):
        try:
            tensors.append(_read_tensor_info(c))
        except ModelFormatError as exc:
            raise ModelFormatError(f"tensor info {i + 1} of {n_tensors}: {exc}") from None
    alignment = KEYS["general.alignment"].check("general.alignment",
                                                metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-c.pos // alignment) * alignment
    _check_layout(tensors, data_offset, alignment, len(buf))
    return GGUFHeader(version, metadata, value_types, tensors, data_offset, alignment, len(buf))


def open_gguf(path: str) -> tuple[mmap.mmap, GGUFHeader]:
    """mmaps path read-only and parses its header."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ModelFormatError("empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ModelFormatError(f"cannot read it ({exc.strerror})") from None
    return mm, read_header(mm)
