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


def read_header(path: str | Path) -> tuple[dict, int]:
    """The header of one file (without `__metadata__`) and the byte offset where the data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class Reader:
    """Tensors of one or several safetensors files by name, memory-mapped."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            header, start = read_header(path)
            for name, info in header.items():
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
