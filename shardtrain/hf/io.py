"""Hugging Face model directories on disk: reading one (`HfDir`) and writing one (`export`).

Reading memory-maps the safetensors files and fills each device's shard of a parameter from
the one HF tensor it needs (jax.make_array_from_callback), so host memory stays near one
tensor; writing fetches one layer's tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np

from shardtrain.config import ConfigError, ModelConfig
from shardtrain.hf import mxfp4, safetensors_io
from shardtrain.hf.config import hf_config, model_config
from shardtrain.hf.families import family_of
from shardtrain.hf.layout import Entry, indexed_names, names_of, tensor_map, tree_get, tree_set

INDEX = "model.safetensors.index.json"
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir}: no config.json; expected a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """The weight files, from the index when there is one, each inside the directory (`inside`); a
    missing shard is an error here."""
    d = Path(hf_dir)
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text()).get("weight_map")
        except (ValueError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{d / INDEX}: not a JSON object with a weight_map of tensor -> file name; "
                              "the index is damaged")
        names = sorted(set(weight_map.values()))
        files = [inside(d, n, f"{d / INDEX} names weight file") for n in names]
        missing = [n for n, f in zip(names, files) if not f.is_file()]
        if missing:
            raise ConfigError(f"{d / INDEX} lists {len(names)} shards but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {d}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{d}: no *.safetensors weights (only safetensors checkpoints are read; "
                          "convert .bin files with transformers' save_pretrained(safe_serialization=True))")
    return [inside(d, f.name, "weight file") for f in files]


def inside(d: Path, name: str, what: str) -> Path:
    """d / name, refused (ConfigError naming it) unless it stays inside the model directory `d`: no
    absolute path, no `..`, no symlink out of it, except a Hugging Face hub cache snapshot's links
    into its own repository's blobs/ (snapshots/REV/FILE -> ../../blobs/HASH)."""
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or not name.strip():
        raise ConfigError(f"{what} '{name[:200]}', which is not a plain path inside {d}; a model directory's "
                          "weights must be its own files (the index is damaged or hostile)")
    real, home = (d / p).resolve(), d.resolve()
    hub_blobs = home.parent.parent / "blobs" if home.parent.name == "snapshots" else None
    if not (real.is_relative_to(home) or (hub_blobs is not None and real.is_relative_to(hub_blobs))):
        raise ConfigError(f"{what} '{name[:200]}', a link out of {d} (to {str(real)[:200]}); a model directory's "
                          "weights must be its own files: copy them in")
    return d / p


# ----------------------------------------------------------------------------- read


class HfDir:
    """An HF model directory, checked before any weight is read: its architecture is supported,
    no shard is missing, and every tensor our model needs is there with the expected shape. The
    safetensors headers are read once, here."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.hf = read_config(self.dir)
        self.family = family_of(self.hf, str(self.dir / "config.json"))
        self.model = model_config(self.hf, str(self.dir / "config.json"))
        quantized = (self.hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"  # gpt-oss's experts
        self.reader = (mxfp4.Reader if quantized else safetensors_io.Reader)(safetensors_files(self.dir))
        if self.model.tie_embeddings and "lm_head.weight" in self.reader.where:
            # tie_word_embeddings absent from config.json but an lm_head is stored: it is untied
            self.model = dataclasses.replace(self.model, tie_embeddings=False)
        self.entries = self.checked(self.model, "config.json")

    def checked(self, m: ModelConfig, config: str) -> list[Entry]:
        """The tensor map of model `m`; ConfigError naming the tensors the weights lack or hold in
        another shape than `config` (where `m` came from) implies."""
        entries, bad = tensor_map(m), []
        for entry in entries:
            for name in names_of(entry, m):
                if name not in self.reader.where:
                    bad.append(f"{name}: missing from the weights, expected shape {entry.hf_shape}")
                elif self.reader.shape(name) != entry.hf_shape:
                    bad.append(f"{name}: weights {self.reader.shape(name)}, {config} implies {entry.hf_shape}")
        if bad:
            raise ConfigError(f"{self.dir}: {config} disagrees with the weights ({len(bad)} tensors): "
                              + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else ""))
        return entries

    def dtype_name(self) -> str:
        return str(self.reader.dtype(self.entries[0].hf))

    def params(self, abstract: dict, m: ModelConfig | None = None) -> dict:
        """Our parameter tree of model `m` (default: the directory's own) as jax arrays with the
        shapes, dtypes and shardings of `abstract` (ShapeDtypeStructs), each shard filled straight
        from the memory-mapped file (host memory: about one HF tensor)."""
        entries = self.entries if m is None or m == self.model else self.checked(m, "the model config")
        out: dict = {}
        for entry in entries:
            for part, path in enumerate(entry.paths):
                a = tree_get(abstract, path)
                tree_set(out, path, jax.make_array_from_callback(
                    a.shape, a.sharding, self._filler(entry, a.shape, a.dtype, part)))
        return out

    def _filler(self, entry: Entry, shape, dtype, part: int = 0):
        last: dict = {}

        def ours(i=None, j=None):  # one HF tensor in our layout (its `part`), cached until the next one is asked for
            if (i, j) not in last:
                last.clear()
                whole = entry.to_ours(self.reader.get(entry.hf_name(i, j)))
                last[i, j] = np.split(whole, len(entry.paths), axis=-1)[part]
            return last[i, j]

        def fill(index):
            if entry.per_expert:  # (L, E, ...): one HF tensor per layer and expert
                return np.stack([np.stack([ours(i, j)[index[2:]] for j in range(shape[1])[index[1]]])
                                 for i in range(shape[0])[index[0]]]).astype(dtype)
            if entry.layered:
                return np.stack([ours(i)[index[1:]] for i in range(shape[0])[index[0]]]).astype(dtype)
            return np.asarray(ours()[index], dtype=dtype)
        return fill


# ----------------------------------------------------------------------------- write


def export(params: dict, m: ModelConfig, out_dir: str | Path, *, base: dict | None = None,
           dtype: str = "float32", max_shard_bytes: int = 5 * 2 ** 30, special_ids: dict | None = None) -> list[Path]:
    """Writes `params` (our tree, jax or numpy arrays) as an HF model directory: config.json (with
    `special_ids`, eos_token_id / bos_token_id, where `base` has none) and safetensors shards (with an
    index when there are several). One layer's tensor is fetched from the devices at a time.
    Returns the safetensors files written.

    In a run of several processes every process calls this (a tensor spread over them is
    gathered with `process_allgather`, a collective, in the same order everywhere) and process 0
    alone writes; the others stream the same bytes to os.devnull."""
    writer = jax.process_index() == 0
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(safetensors_io.DTYPES[EXPORT_DTYPES[dtype]])
    specs, fetch = [], {}
    for entry in tensor_map(m):
        arrays = [tree_get(params, path) for path in entry.paths]
        for name, index in indexed_names(entry, m):
            specs.append((name, entry.hf_shape, np_dtype))
            fetch[name] = (entry, arrays, index)

    def produce(name):
        entry, arrays, index = fetch[name]
        ours = np.concatenate([host_array(a[index] if index else a).astype(np.float32) for a in arrays], axis=-1)
        return entry.to_hf(ours).astype(np_dtype)

    shards = split_shards(specs, max_shard_bytes)
    files = [out / ("model.safetensors" if len(shards) == 1 else f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors")
             for j in range(len(shards))]
    for path, shard in zip(files, shards):
        safetensors_io.write(path if writer else os.devnull, shard, produce, metadata={"format": "pt"})
    if writer:
        write_index(out, files, shards)
        config = hf_config(m, base, dtype)
        config.update({k: v for k, v in (special_ids or {}).items() if config.get(k) is None})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return files


def host_array(x) -> np.ndarray:
    """A (slice of a) jax array on this host; a tensor spread over several processes is gathered
    whole on every process (a collective: all of them call this in the same order)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def nbytes(spec: tuple[str, tuple, np.dtype]) -> int:
    return int(np.prod(spec[1])) * np.dtype(spec[2]).itemsize


def split_shards(specs: list, max_shard_bytes: int) -> list[list]:
    """The tensor specs in file order, cut into shards of at most `max_shard_bytes` (a larger
    tensor gets a shard of its own)."""
    shards, size = [[]], 0
    for spec in specs:
        if shards[-1] and size + nbytes(spec) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(spec)
    return shards


def write_index(out: Path, files: list[Path], shards: list[list]) -> None:
    """model.safetensors.index.json for several shards (an older one is removed for one)."""
    if len(shards) > 1:
        total = sum(nbytes(spec) for shard in shards for spec in shard)
        index = {"metadata": {"total_size": total},
                 "weight_map": {spec[0]: f.name for f, shard in zip(files, shards) for spec in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    elif (out / INDEX).exists():
        (out / INDEX).unlink()
