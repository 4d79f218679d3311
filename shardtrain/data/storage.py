"""Reading a prepared directory by byte range, on local disk or behind a URL; finding input files.

`open_store(location)` gives one interface for both:
  a local path     os.pread on file descriptors kept open (no memory map: what a process holds
                   is what it asked for, not the pages of a corpus it has walked through)
  a URL            gs://BUCKET/PATH (and any other URL tensorstore's kvstore opens: file://,
                   s3://, memory://) through tensorstore, which orbax already depends on: each
                   read is one ranged GET, with tensorstore's retries and credentials
                   (Application Default Credentials on GCS).
Keys are paths relative to the location ("manifest.json", "train/00000.bin").

Binary searches over a document index would cost one request per probe on GCS, so an element
of an index is read with the 32 KiB block around it, and the most recent blocks are kept (a few
MB in all): the first probes of every search hit the same cached blocks.

`find_files(spec)` is how the text source and `prepare` both turn a file, directory or glob
into the files it names; `text_problem` is how both refuse a file that is not text.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import os
import threading
from pathlib import Path

import numpy as np

from shardtrain.config import is_url

INDEX_BLOCK = 1 << 15
"""Bytes of an index read at once for single elements (4096 int64 entries): RangeArray's default."""
OPEN_THREADS = 32
"""Shards checked at once when a split opens from a URL (a few requests each)."""


def find_files(spec: str) -> list[str]:
    """The files a local path names: itself, the files under a directory, or those a glob
    matches (`**` recursive), in a stable order; empty when there are none."""
    path = Path(spec)
    if path.is_dir():
        return sorted(str(f) for f in path.rglob("*") if f.is_file())
    if path.is_file():
        return [spec]
    return sorted(f for f in glob.glob(spec, recursive=True) if Path(f).is_file())


def json_object(path: Path) -> dict:
    """The JSON object in a local file; {} when it is missing, not JSON or not an object."""
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def text_problem(data: bytes) -> str | None:
    """Why `data` is not text (a NUL byte, or bytes that are not UTF-8, and where), or None."""
    nul = data.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at byte {nul}: a binary file"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {e.start}"
    return None


class LocalStore:
    """Files under a local directory, read with os.pread."""

    def __init__(self, root: str):
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return self.root

    def name(self, key: str) -> str:
        return str(Path(self.root) / key)

    def _fd(self, key: str) -> int:
        with self._lock:
            if key not in self._fds:
                self._fds[key] = os.open(self.name(key), os.O_RDONLY)
            return self._fds[key]

    def read(self, key: str, start: int, stop: int) -> bytes:
        data = os.pread(self._fd(key), stop - start, start)
        if len(data) != stop - start:
            raise OSError(f"{self.name(key)}: ends before byte {stop}")
        return data

    def read_all(self, key: str) -> bytes | None:
        """The whole value, or None when there is none."""
        try:
            return Path(self.name(key)).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self.name(key)).st_size
        except FileNotFoundError:
            return None

    def check_size(self, key: str, want: int) -> str | None:
        """None when `key` holds exactly `want` bytes, else what it holds ('missing', 'N bytes')."""
        have = self.size(key)
        return None if have == want else "missing" if have is None else f"{have} bytes"

    def __getstate__(self):  # file descriptors are reopened by whoever unpickles it
        return {"root": self.root}

    def __setstate__(self, state):
        self.__init__(state["root"])

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)


class KvStore:
    """Values behind a URL, read through tensorstore's kvstore (byte ranges are ranged requests)."""

    def __init__(self, url: str):
        self.url = url if url.endswith("/") else url + "/"
        self._kv = None

    def __repr__(self):
        return self.url.rstrip("/")

    def name(self, key: str) -> str:
        return self.url + key

    @property
    def kv(self):
        if self._kv is None:
            import tensorstore as ts
            self._kv = ts.KvStore.open(self.url).result()
        return self._kv

    def read(self, key: str, start: int, stop: int) -> bytes:
        if stop == start:
            return b""
        result = self.kv.read(key, byte_range=slice(start, stop)).result()
        if result.state != "value":
            raise FileNotFoundError(f"{self.name(key)}: missing")
        return result.value

    def read_all(self, key: str) -> bytes | None:
        result = self.kv.read(key).result()
        return result.value if result.state == "value" else None

    def check_size(self, key: str, want: int) -> str | None:
        # a kvstore has no stat: the last byte [want - 1, want) must be readable and [want, want + 1)
        # must not be (two concurrent ranged reads; no empty range, which HTTP cannot express)
        last = self.kv.read(key, byte_range=slice(want - 1, want)) if want else self.kv.read(key)
        past_end = self.kv.read(key, byte_range=slice(want, want + 1))
        try:
            if last.result().state != "value":
                return "missing"
        except ValueError:  # OUT_OF_RANGE
            return f"fewer than {want} bytes"
        try:
            past_end.result()
        except ValueError:
            return None
        return f"more than {want} bytes"

    def __getstate__(self):
        return {"url": self.url}

    def __setstate__(self, state):
        self.__init__(state["url"])


Store = LocalStore | KvStore


def open_store(location: str) -> Store:
    return KvStore(location) if is_url(location) else LocalStore(location)


@functools.lru_cache(maxsize=256)
def _read_block(store: Store, key: str, offset: int, block: int, block_bytes: int, length: int,
                dtype: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    first = block * block_bytes // itemsize
    count = min(block_bytes // itemsize, length - first)
    return np.frombuffer(store.read(key, offset + first * itemsize, offset + (first + count) * itemsize), dtype)


class RangeArray:
    """A flat array stored from byte `offset` of `key`: slices are read as one range each; single
    elements (binary searches over a document index), and with `cached` slices inside one block,
    come from cached blocks of `block_bytes`."""

    def __init__(self, store: Store, key: str, dtype, offset: int, length: int, cached: bool = False,
                 block_bytes: int = INDEX_BLOCK):
        self.store, self.key, self.dtype, self.offset, self.length = store, key, np.dtype(dtype), offset, length
        self.cached, self.block_bytes = cached, block_bytes

    def __len__(self):
        return self.length

    def _block(self, i: int) -> np.ndarray:
        return _read_block(self.store, self.key, self.offset, i, self.block_bytes, self.length, self.dtype.str)

    def __getitem__(self, index):
        size = self.dtype.itemsize
        per_block = self.block_bytes // size
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.length)
            stop = max(start, stop)
            if self.cached and stop > start and start // per_block == (stop - 1) // per_block:
                return self._block(start // per_block)[start % per_block:(stop - 1) % per_block + 1]
            data = self.store.read(self.key, self.offset + start * size, self.offset + stop * size)
            return np.frombuffer(data, dtype=self.dtype)
        if index < 0:
            index += self.length
        return int(self._block(index // per_block)[index % per_block])


def npy_array(store: Store, key: str, block_bytes: int = INDEX_BLOCK) -> RangeArray | None:
    """The 1-D array of a .npy value, read by range (single elements through cached blocks of
    `block_bytes`); None when the key is missing."""
    try:
        head = store.read(key, 0, 12)
    except FileNotFoundError:
        return None
    version = (head[6], head[7])
    header_len = int.from_bytes(head[8:10] if version == (1, 0) else head[8:12], "little")
    start = (10 if version == (1, 0) else 12) + header_len
    f = io.BytesIO(store.read(key, 0, start))
    np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(f)
    return RangeArray(store, key, dtype, start, shape[0], cached=True, block_bytes=block_bytes)
