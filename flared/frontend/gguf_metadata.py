"""Read the key/value metadata of a GGUF file, and nothing else.

Rules:
- Only the header and the metadata table are read; tensor data is never touched,
  so reading a multi-gigabyte file costs what its vocabulary costs.
- Little-endian GGUF v2 and v3 only (v1 used 32-bit counts and is long gone).
- Strings are strict UTF-8, as llama.cpp writes them; a file that breaks that
  is corrupt, not something to guess around.
- Numeric arrays come back as Python lists (tokens, scores and token types are
  consumed by Python code that indexes them), string arrays as lists of str.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from flared.errors import ErrorKind, FrontendError

_MAGIC = b"GGUF"

# GGUF value type -> (struct format, numpy dtype); strings (8) and arrays (9) are handled apart.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9


class _Cursor:
    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _truncated(self.path)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise _truncated(self.path)
        raw = self.buf[self.pos:end]
        self.pos = end
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise FrontendError(
                f"{self.path}: GGUF metadata string is not valid UTF-8 ({exc})", ErrorKind.TOKENIZER
            ) from None

    def value(self, value_type: int):
        if value_type == _TYPE_STRING:
            return self.string()
        if value_type == _TYPE_ARRAY:
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            if item_type == _TYPE_STRING:
                return [self.string() for _ in range(count)]
            if item_type == _TYPE_ARRAY:
                return [self.value(_TYPE_ARRAY) for _ in range(count)]
            fmt, dtype = _scalar(item_type, self.path)
            num_bytes = struct.calcsize(fmt) * count
            if self.pos + num_bytes > len(self.buf):
                raise _truncated(self.path)
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += num_bytes
            return items
        fmt, _ = _scalar(value_type, self.path)
        return self.unpack(fmt)


def _scalar(value_type: int, path: str) -> tuple[str, str]:
    try:
        return _SCALAR_TYPES[value_type]
    except KeyError:
        raise FrontendError(f"{path}: unknown GGUF value type {value_type}", ErrorKind.TOKENIZER) from None


def _truncated(path: str) -> FrontendError:
    return FrontendError(f"{path}: GGUF metadata is truncated", ErrorKind.TOKENIZER)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, object]:
    """Every metadata key of the GGUF file at ``path``, in file order."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return _parse(memoryview(mapped), path)
    except OSError as exc:
        raise FrontendError(f"{path}: cannot read GGUF file ({exc.strerror or exc})", ErrorKind.TOKENIZER) from None
    except ValueError as exc:  # mmap of an empty file
        raise FrontendError(f"{path}: not a GGUF file ({exc})", ErrorKind.TOKENIZER) from None


def _parse(buf: memoryview, path: str) -> dict[str, object]:
    try:
        return _header(_Cursor(buf, path))[1]
    finally:
        # A memoryview into the mmap must be released before the mmap closes.
        buf.release()


def _header(cursor: _Cursor) -> tuple[int, dict[str, object]]:
    """The file's tensor count and its metadata, every key in file order; the cursor left at the tensor infos."""
    path = cursor.path
    if bytes(cursor.buf[:4]) != _MAGIC:
        raise FrontendError(f"{path}: not a GGUF file (bad magic)", ErrorKind.TOKENIZER)
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise FrontendError(f"{path}: unsupported GGUF version {version}", ErrorKind.TOKENIZER)
    num_tensors = cursor.unpack("<Q")
    num_keys = cursor.unpack("<Q")
    metadata: dict[str, object] = {}
    for _ in range(num_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    return num_tensors, metadata


# ---- The whole file: metadata and tensors (flared/model/loader.py's reader) --------------------------------------

class GGUFField:
    """A metadata value, as gguf.GGUFReader's fields give it: ``contents()``."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class GGUFTensor:
    """A tensor of the file, as gguf.GGUFReader's tensors give it: ``name``, ``shape`` (GGUF's order, fastest
    dimension first), ``tensor_type`` (gguf's GGMLQuantizationType), ``n_elements``, ``n_bytes`` and ``data``: a
    read-only view of the file's memory map, float32 / float16 (and the integer types) shaped with the dimensions
    reversed, any other type as its raw bytes [rows, bytes a row]."""

    __slots__ = ("name", "shape", "tensor_type", "n_elements", "n_bytes", "data_offset", "data")


class GGUFFile:
    """A GGUF file read as gguf.GGUFReader reads it (``fields``, ``tensors``) for what flared's loader uses, without
    that reader's cost: its fields are parsed into numpy views a part each (2 s for the embedded model's 49k-token
    vocabulary), these in one pass of struct (a tenth of that)."""

    def __init__(self, path: str | os.PathLike):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = os.fspath(path)
        self._map = np.memmap(self.path, mode="r")
        cursor = _Cursor(memoryview(self._map), self.path)
        num_tensors, metadata = _header(cursor)
        self.fields = {key: GGUFField(value) for key, value in metadata.items()}
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
            infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-cursor.pos // alignment) * alignment
        plain = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
        self.tensors: list[GGUFTensor] = []
        for name, dims, type_id, offset in infos:
            t = GGUFTensor()
            t.name, t.shape, t.tensor_type = name, np.array(dims, dtype=np.uint64), GGMLQuantizationType(type_id)
            t.n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[t.tensor_type]
            t.n_bytes = t.n_elements * type_size // block
            t.data_offset = start + offset
            if t.data_offset + t.n_bytes > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            shape = tuple(int(d) for d in reversed(dims)) or (1,)
            if type_id in plain:
                t.data = self._map[t.data_offset:t.data_offset + t.n_bytes].view(plain[type_id]).reshape(shape)
            else:
                rows = shape[:-1] + (shape[-1] // block * type_size,)
                t.data = self._map[t.data_offset:t.data_offset + t.n_bytes].reshape(rows)
            self.tensors.append(t)


def matrix_types(path: str | os.PathLike) -> dict[str, list]:
    """Each matrix of a GGUF file (two or more dimensions) by name: [its ggml type's name, its values]. A core
    exported from the file records these (manifest ``source.tensor_types``); quant.gguf_plan reads them."""
    return {t.name: [t.tensor_type.name, int(t.n_elements)] for t in GGUFFile(path).tensors if len(t.shape) >= 2}
