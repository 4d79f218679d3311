"""The local checkpoint tier: each process writes its own shards of the train state to a directory
on its own host (checkpoint.local.directory: a RAM disk or a local SSD), often and asynchronously,
beside the rare persistent checkpoints of `manager.Checkpointer` (Orbax).

Neither Orbax tool fits this on orbax-checkpoint 0.12.8. Its emergency checkpoint manager
(`orbax.checkpoint.experimental.emergency`) needs a mesh whose replica axis spans slices, keeps a
local copy only on processes holding a full replica, and restores a missing copy by broadcasting
from another slice; an FSDP mesh with no replica across processes (the shipped 70B config) has
none to broadcast, and its multislice helpers expect TPU slice indices, which CPU and GPU devices
lack. A plain Orbax CheckpointManager per process (`MultiprocessingOptions(primary_host=None,
active_processes={i})`) cannot hold per-process data either: its numpy handler writes from process
0 only, and its jax.Array handler refuses an array that one process holds whole whenever there are
several processes ("Cannot serialize host local jax.Array in multi-host setting"). So the tier is
a small writer of its own, with Orbax's commit protocol: a step is written to a temporary
directory and committed by an atomic rename; nothing else is ever read.

Layout: DIR/RUN names the run dir whose tier DIR is (another run refuses DIR while that run dir
exists: two runs would delete each other's steps); DIR/process-<i>-of-<n>/<step>/ holds meta.json
(the persistent tier's meta, the run dir, a fingerprint of the shard layout and a crc32 of each
array file's data) and one .npy per distinct shard this process holds. A step whose data no longer
matches its checksums is moved to DIR/process-<i>-of-<n>/unusable/<step>. No
process waits for another while saving, so a dead or slow peer never blocks a save, and the
processes of one host share DIR, each in its own part. A step restores only onto the same layout
(same mesh, devices and process count); `restore_newest` lets all processes agree on the newest
step every one of them holds and reads back, else the persistent tier's.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from shardtrain import config as config_lib
from shardtrain.checkpoint import integrity, listing, manager
from shardtrain.parallel import sharding

OWNER_FILE = "RUN"
"""In checkpoint.local.directory: the run dir (absolute) of the run whose local tier it is."""


def owner_conflict(cfg: config_lib.RunConfig) -> None:
    """Raises ConfigError when checkpoint.local.directory is the local tier of another run whose run
    dir still exists (the two would delete each other's local steps). Reads only."""
    owner_file = Path(cfg.checkpoint.local.directory) / OWNER_FILE
    try:
        owner = owner_file.read_text().strip()
    except OSError:
        return
    if owner and Path(owner).exists() and Path(owner).resolve() != Path(cfg.run_dir).resolve():
        raise config_lib.ConfigError(
            f"checkpoint.local.directory={cfg.checkpoint.local.directory} is the local tier of the run {owner[:200]} "
            f"(named in {owner_file}); give this run its own directory, e.g. "
            f"checkpoint.local.directory={Path(cfg.checkpoint.local.directory) / Path(cfg.run_dir).name}")


def index_key(index: tuple[slice, ...], shape) -> tuple[tuple[int, int], ...]:
    """A shard's index as ((start, stop), ...) per dimension."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def distinct_shards(leaf) -> list[tuple[tuple, list]]:
    """[(index key, [devices holding it])] of this process's part of `leaf` (an array or a
    ShapeDtypeStruct with a sharding), devices in id order."""
    found: dict[tuple, list] = {}
    by_device = leaf.sharding.addressable_devices_indices_map(leaf.shape)
    for device in sorted(by_device, key=lambda d: d.id):
        found.setdefault(index_key(by_device[device], leaf.shape), []).append(device)
    return list(found.items())


def fingerprint(abstract_state) -> str:
    """The shard layout of this process (which index of which leaf on which device), hashed."""
    layout = [[(k, [d.id for d in ds]) for k, ds in distinct_shards(leaf)] for leaf in jax.tree.leaves(abstract_state)]
    return hashlib.sha256(json.dumps([jax.process_count(), layout]).encode()).hexdigest()[:16]


class LocalTier:
    """This process's part of the local tier of one run."""

    def __init__(self, cfg: config_lib.RunConfig, abstract_state):
        c = cfg.checkpoint.local
        owner_conflict(cfg)
        self.dir = Path(c.directory) / f"process-{jax.process_index()}-of-{jax.process_count()}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (Path(c.directory) / OWNER_FILE).write_text(f"{Path(cfg.run_dir).resolve()}\n")
        for tmp in self.dir.glob("*.tmp-*"):  # a write cut short by a kill
            shutil.rmtree(tmp, ignore_errors=True)
        self.keep, self.run_dir, self.abstract_state = c.max_to_keep, str(cfg.run_dir), abstract_state
        self.layout = fingerprint(abstract_state)
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shardtrain-local-save")
        self.pending: concurrent.futures.Future | None = None
        self.failed_saves = 0
        self.names = [sharding.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract_state)]

    def all_steps(self) -> list[int]:
        """Committed steps in this process's directory (any run or layout), newest first."""
        return sorted((int(p.name) for p in self.dir.iterdir() if p.name.isdigit()), reverse=True)

    def steps(self) -> list[int]:
        """Committed local steps written by this run on this shard layout, newest first."""
        ok = []
        for step in self.all_steps():
            try:
                meta = json.loads((self.dir / str(step) / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if meta.get("layout") == self.layout and meta.get("run_dir") == self.run_dir:
                ok.append(step)
        return ok

    def save(self, step: int, state, meta: dict) -> None:
        """Copies this process's distinct shards of `state` to host memory, then writes them in the
        background (after waiting for the previous local save)."""
        self.wait()
        leaves = jax.tree.leaves(state)
        for leaf in leaves:
            for shard in leaf.addressable_shards:
                shard.data.copy_to_host_async()
        host = {}
        for n, leaf in enumerate(leaves):
            data = {index_key(s.index, leaf.shape): s.data for s in leaf.addressable_shards}
            for k, (key, _) in enumerate(distinct_shards(leaf)):
                host[f"leaf{n:05d}.s{k}"] = np.array(data[key], copy=True)  # the step may reuse the buffer
        meta = {**meta, "layout": self.layout, "run_dir": self.run_dir}
        self.pending = self.writer.submit(self._write, step, host, meta)

    def _write(self, step: int, host: dict, meta: dict) -> None:
        final, tmp = self.dir / str(step), self.dir / f"{step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, array in host.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        checksums = {name: integrity.crc(array) for name, array in host.items()}
        (tmp / "meta.json").write_text(json.dumps({**meta, "checksums": checksums}))
        shutil.rmtree(final, ignore_errors=True)  # left by a timeline abandoned at a restart
        tmp.rename(final)  # the commit
        for old in self.all_steps()[self.keep:]:
            shutil.rmtree(self.dir / str(old), ignore_errors=True)

    def wait(self) -> None:
        """Waits for the local save in flight; a failed one is reported, never fatal (the
        persistent tier still stands)."""
        if self.pending is not None:
            try:
                self.pending.result()
            except OSError as e:  # said once on the console; every failure goes to run_dir/shardtrain.log
                logging.getLogger(__name__).warning("local checkpoint save to %s failed: %s", self.dir, e)
                if not self.failed_saves:
                    print(f"shardtrain[process {jax.process_index()}]: warning: a local checkpoint save to {self.dir} "
                          f"failed ({e}); the run goes on with the persistent tier (later failures are not "
                          f"repeated here: see shardtrain.log)", file=sys.stderr, flush=True)
                self.failed_saves += 1
            self.pending = None

    def restore(self, step: int) -> tuple[dict, dict]:
        """The state (in this run's shardings) and meta of local step `step`; raises if unreadable."""
        where = self.dir / str(step)
        meta = json.loads((where / "meta.json").read_text())
        checksums = meta.get("checksums")  # none in a step written before shardtrain recorded them
        leaves, tree = jax.tree.flatten(self.abstract_state)
        out = []
        for n, leaf in enumerate(leaves):
            arrays = []
            for k, (key, devices) in enumerate(distinct_shards(leaf)):
                name = f"leaf{n:05d}.s{k}"
                host = np.load(where / f"{name}.npy", allow_pickle=False)
                if checksums is not None and checksums.get(name) != integrity.crc(host):
                    raise integrity.Damaged(f"checksum mismatch in {self.names[n]} ({name}.npy)")
                if host.dtype.kind == "V" and host.dtype.itemsize == np.dtype(leaf.dtype).itemsize:
                    host = host.view(leaf.dtype)  # bfloat16 and the like are stored as raw bytes
                if host.shape != tuple(b - a for a, b in key) or host.dtype != leaf.dtype:
                    raise ValueError(f"leaf{n:05d}.s{k}.npy holds {host.dtype}{list(host.shape)}, "
                                     f"not {leaf.dtype}{[b - a for a, b in key]}")
                arrays += [(d, jax.device_put(host, d)) for d in devices]
            arrays.sort(key=lambda pair: pair[0].id)
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, [a for _, a in arrays]))
        return jax.tree.unflatten(tree, out), meta

    def set_aside(self, step: int) -> Path:
        """Moves local step `step` to unusable/ (out of the steps, never deleted); returns where."""
        target = self.dir / listing.UNUSABLE_DIR / str(step)
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(exist_ok=True)
        (self.dir / str(step)).rename(target)
        return target

    def forget_after(self, step: int) -> None:
        """Deletes the local steps after `step` (a timeline abandoned by this start)."""
        for s in self.all_steps():
            if s > step:
                shutil.rmtree(self.dir / str(s), ignore_errors=True)

    def close(self) -> None:
        self.wait()
        self.writer.shutdown()


def common_steps(mine: list[int], slots: int) -> list[int]:
    """The steps every process holds (all processes must call this), newest first."""
    if jax.process_count() == 1:
        return mine
    from jax.experimental import multihost_utils
    row = np.full(slots, -1, np.int32)
    row[:min(slots, len(mine))] = mine[:slots]
    rows = np.asarray(multihost_utils.process_allgather(row))
    return sorted(set.intersection(*(set(r[r >= 0].tolist()) for r in rows)), reverse=True)


def restore_newest(persistent: manager.Checkpointer, local: LocalTier | None, say=print):
    """(state, meta, tier) of the newest step that can be restored, or None: a local step when
    every process holds it and reads it back, else the persistent tier's newest readable step.
    Every process takes part; one whose local copy is missing or unreadable makes all fall back."""
    if local is not None:
        newest_persistent = persistent.latest_step() or 0
        mine = local.steps()
        common = common_steps(mine, slots=16)
        for step in common:
            if step <= newest_persistent:
                break
            damaged = None
            try:
                state, meta = local.restore(step)
                error = None
            except integrity.Damaged as e:
                error = damaged = f"{e}; moved it to {local.set_aside(step)}"
            except Exception as e:  # noqa: BLE001 - any read failure makes the local step unusable
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if manager.all_processes_agree(error is None):
                return state, meta, "local"
            say(f"local checkpoint step {step} is unusable ({damaged}); trying an older step" if damaged else
                f"local checkpoint step {step} cannot be read on every process"
                f"{f' (here: {error})' if error else ''}; trying an older step")
        if mine and mine[0] > newest_persistent and mine[0] not in common:
            say(f"local checkpoint step {mine[0]} is not held whole by every process; "
                f"falling back to the persistent tier")
    restored = persistent.restore_latest(say=say)
    return None if restored is None else (*restored, "persistent")
