"""Reading and writing safetensors files with numpy only, tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets) and the raw bytes. Reading memory-maps the file, so a tensor costs host memory
only when it is touched; bf16 comes through `ml_dtypes` (which jax ships), no torch needed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from shardtrain.config import ConfigError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
"""safetensors dtype names -> numpy dtypes (the safetensors format has a few more, e.g. F4: an error)."""
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


BITS = {**{k: np.dtype(v).itemsize * 8 for k, v in DTYPES.items()}, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6,
        "F4": 4, "C64": 64}
"""Bits per element of each safetensors dtype (readable or not), for checking the data offsets."""
MAX_HEADER = 100_000_000
"""The largest JSON header read (the safetensors library's limit)."""


def read_header(path: str | Path) -> tuple[dict, int]:
    """The header of one file (without `__metadata__`) and the byte offset where the data starts,
    checked as the safetensors library checks it before any tensor is read: the header length fits
    the file, every tensor's data_offsets are non-negative, hold dtype size x shape bytes, and the
    tensors tile the data that follows the header exactly (no gap, no overlap, nothing past the end).
    ConfigError naming the file (and the tensor)."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        if size < 8 or n > min(size - 8, MAX_HEADER):
            raise ConfigError(f"{path}: safetensors header length {n} does not fit the file's {size} bytes (nor "
                              f"the {MAX_HEADER} bytes a header may have); the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: the safetensors header is not a JSON object; the file is damaged")
    header.pop("__metadata__", None)
    check_offsets(path, header, size - 8 - n)
    return header, 8 + n


def check_offsets(path, header: dict, data_bytes: int) -> None:
    """Each entry's dtype, shape and data_offsets are well formed and the tensors tile [0, data_bytes)."""
    spans = []
    for name, info in header.items():
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and isinstance(info.get("dtype"), str)):
            raise ConfigError(f"{path}: tensor {name[:100]}: header entry {str(info)[:100]} is not "
                              "{dtype, shape, data_offsets: [begin, end]}; the file is damaged")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise ConfigError(f"{path}: tensor {name[:100]}: data_offsets [{begin}, {end}] lie outside the file's "
                              f"{data_bytes} bytes of data; the file is damaged")
        bits = BITS.get(info["dtype"])
        want = -(-int(np.prod(shape, dtype=object)) * bits // 8) if bits else end - begin
        if end - begin != want:
            raise ConfigError(f"{path}: tensor {name[:100]}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                              f"but {info['dtype']} x {shape} is {want} bytes; the file is damaged")
        spans.append((begin, end, name))
    spans.sort()
    at, before = 0, None
    for begin, end, name in spans:
        if begin != at:
            what = (f"overlap tensor {before[2][:100]}'s [{before[0]}, {before[1]}]" if begin < at
                    else f"leave bytes [{at}, {begin}) unused")
            raise ConfigError(f"{path}: tensor {name[:100]}: data_offsets [{begin}, {end}] {what}; the file is damaged")
        at, before = end, (begin, end, name)
    if at != data_bytes:
        raise ConfigError(f"{path}: the tensors' data ends at byte {at} but {data_bytes} bytes follow the header; "
                          "the file is damaged")


class Reader:
    """Tensors of one or several safetensors files by name, memory-mapped."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            header, start = read_header(path)
            for name, info in header.items():
                if name in self.where:
                    raise ConfigError(f"{path}: tensor {name[:100]} is also in {self.where[name][0]}; which one "
                                      "to read is unknown: the directory is damaged")
                self.where[name] = (path, info, start)
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def dtype(self, name: str) -> np.dtype:
        """The tensor's numpy dtype; ConfigError naming the file, tensor and dtype if numpy has none."""
        path, info, _ = self.where[name]
        if info["dtype"] not in DTYPES:
            raise ConfigError(f"{path}: tensor {name} has dtype {info['dtype']}, which is not supported "
                              f"(supported: {', '.join(DTYPES)})")
        return np.dtype(DTYPES[info["dtype"]])

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor in the memory-mapped file (no copy)."""
        path, info, start = self.where[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        lo, hi = info["data_offsets"]
        return self._maps[path][start + lo:start + hi].view(self.dtype(name)).reshape(info["shape"])


def write(path: str | Path, specs: list[tuple[str, tuple, np.dtype]], produce, metadata: dict | None = None) -> None:
    """Writes one safetensors file of the tensors `specs` (name, shape, dtype) in that order,
    asking `produce(name)` for each array only when it is written (one tensor in memory at a time)."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header = {"__metadata__": metadata, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            a = np.ascontiguousarray(produce(name), dtype=dtype)
            assert a.shape == tuple(shape), (name, a.shape, shape)
            f.write(a.tobytes())
