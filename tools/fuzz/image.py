"""An editable image of a GGUF file for the fuzzer: metadata entries as (key, type, encoded value), tensor
infos, and the data section, written back with any counts, lengths or offsets a mutation chose, however
inconsistent. Only the fuzzer builds files this way; pyinfer reads them with `pyinfer.formats.gguf_reader`."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace

from pyinfer.formats.gguf_reader import DEFAULT_ALIGNMENT, GGUF_MAGIC, decode_value, read_header

# GGUF value type ids
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
                  BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
INT_TYPES = (UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64)


def enc_str(text: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; `length` overrides the length field (a lie, for mutations)."""
    raw = text.encode("utf-8", errors="surrogatepass") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def enc_scalar(vtype: int, value) -> bytes:
    return struct.pack(SCALAR_FORMATS[vtype], value)


def enc_array(etype: int, values: list, count: int | None = None) -> bytes:
    head = struct.pack("<IQ", etype, len(values) if count is None else count)
    if etype == STRING:
        return head + b"".join(enc_str(v) for v in values)
    if etype == ARRAY:  # values: (element type, list) pairs
        return head + b"".join(enc_array(e, v) for e, v in values)
    return head + b"".join(enc_scalar(etype, v) for v in values)


def nested_array(depth: int, leaf: bytes = b"") -> bytes:
    """An array of one array of ... (depth levels) around `leaf` (an encoded array, or empty u8 array)."""
    out = leaf or struct.pack("<IQ", UINT8, 0)
    for _ in range(depth - 1):
        out = struct.pack("<IQ", ARRAY, 1) + out
    return out


@dataclass
class Entry:
    key: str
    vtype: int
    value: bytes  # encoded as enc_value does

    def decoded(self):
        """The value as pyinfer's reader decodes it."""
        return decode_value(self.value, self.vtype)


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]
    type: int
    offset: int
    n_dims: int | None = None  # None: len(ne); else the count written (a lie, for mutations)

    def encode(self) -> bytes:
        n_dims = len(self.ne) if self.n_dims is None else self.n_dims
        return (enc_str(self.name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", n) for n in self.ne)
                + struct.pack("<IQ", self.type, self.offset))


@dataclass
class GGUFImage:
    entries: list[Entry]
    tensors: list[TensorInfo]
    data: bytes  # the data section, from the aligned end of the header
    version: int = 3
    magic: bytes = GGUF_MAGIC
    n_kv: int | None = None  # None: len(entries); else the count written
    n_tensors: int | None = None
    alignment: int = DEFAULT_ALIGNMENT  # padding used when writing (the file's key says what readers use)
    nbytes: dict = field(default_factory=dict)  # tensor name -> bytes of its data in the source file

    @classmethod
    def parse(cls, buf) -> GGUFImage:
        """The image of a valid GGUF (as pyinfer's reader accepts it)."""
        header = read_header(buf)
        entries = []
        pos = 24
        for key, (vtype, _) in header.value_types.items():
            start = pos + 8 + len(key.encode()) + 4
            end = _value_end(buf, start, vtype)
            entries.append(Entry(key, vtype, bytes(buf[start:end])))
            pos = end
        tensors = [TensorInfo(t.name, t.ne, t.type, t.offset) for t in header.tensors]
        return cls(entries, tensors, bytes(buf[header.data_offset:]), header.version,
                   alignment=header.alignment, nbytes={t.name: t.nbytes for t in header.tensors})

    def copy(self) -> GGUFImage:
        return replace(self, entries=[replace(e) for e in self.entries], tensors=[replace(t) for t in self.tensors])

    def entry(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def header(self) -> bytes:
        n_kv = len(self.entries) if self.n_kv is None else self.n_kv
        n_tensors = len(self.tensors) if self.n_tensors is None else self.n_tensors
        out = bytearray(self.magic + struct.pack("<IQQ", self.version, n_tensors, n_kv))
        for e in self.entries:
            out += enc_str(e.key) + struct.pack("<I", e.vtype) + e.value
        for t in self.tensors:
            out += t.encode()
        out += bytes(-len(out) % self.alignment)
        return bytes(out)

    def write(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.header())
            f.write(self.data)


def _value_end(buf, pos: int, vtype: int) -> int:
    if vtype in SCALAR_FORMATS:
        return pos + struct.calcsize(SCALAR_FORMATS[vtype])
    if vtype == STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in SCALAR_FORMATS:
        return pos + count * struct.calcsize(SCALAR_FORMATS[etype])
    for _ in range(count):
        pos = _value_end(buf, pos, etype)
    return pos
