"""Orbax async checkpoints: save the train state and run metadata, restore onto any mesh.

A checkpoint at step N (a directory `N/` under checkpoint.directory) holds the state after N
updates (`state`: params, optimizer state, step counter) and a JSON item `meta`: the data
position in global samples, the mesh and device/process counts it was written from, and the
resolved config. Nothing else is needed to continue exactly:
- RNG: parameters are initialised from train.seed; the train step draws no random numbers.
- Data: sample i of the dataset is a function of (train.seed, i) (see data/loader.py), so the data
  pipeline's whole state is one integer, the global sample position. A grain iterator state
  would add nothing and would tie the checkpoint to one process count (grain's state is per
  process); the global position resumes on any number of processes and devices.
Restoring targets the shardings of the *current* config (the `abstract_state` a Checkpointer is
given, `step.Program.abstract_state`), so a run resumes onto another mesh shape or device count
without hand-written restore arguments. This package knows nothing of the step builder: it takes
the config, the abstract state and the mesh shape.

Safety: only committed steps (orbax writes `N.orbax-checkpoint-tmp`, then `commit_success.txt`
and an atomic rename) are restored. A committed step that fails to read (files truncated or
deleted) is reported and the next older one is tried; once a good one is found the bad ones are
moved aside to `unusable/N` (never deleted: they no longer count towards max_to_keep and cannot
collide with a new save of step N). A step whose bytes no longer match the checksums recorded
before its commit (`integrity.py`) counts as unreadable. If no committed step reads back, nothing is
moved and the run stops with the reasons (the storage may only be unreachable) instead of silently
starting over.
A failed async save raises `SaveFailed` at the next step boundary; orbax then skips the
garbage collection of older steps, so good checkpoints survive a failed save.

Speed: tensorstore's worker threads, which compress and write the chunks of an async save, run
at a lower CPU priority (`checkpoint.writer_niceness`), so a save uses the CPU time the train
step leaves idle rather than slowing the step (see `lower_writer_priority`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from shardtrain import config as config_lib
from shardtrain.checkpoint import diagnose, integrity, listing

LOG_FILE = "shardtrain.log"
"""In run_dir: what the checkpoint library logs (errors with their tracebacks), not the console."""


class SaveFailed(RuntimeError):
    """An async checkpoint save failed; the run must stop rather than believe it has a checkpoint."""


def all_processes_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (so all processes take the same branch)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(multihost_utils.process_allgather(int(ok)).min())


def state_handler(replica_parallel: bool) -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler (what StandardCheckpointHandler wraps, same files on disk), with
    replica-parallel saving of jax.Arrays switched on or off.

    Replica-parallel saving cuts every replicated shard into per-replica slices on the devices,
    one eager op per shard, inside `save()`, so while the training loop waits (most of the time
    `save()` blocks: bench/README.md, Checkpoints). It pays off only when the replicas live on
    several processes, which then share the writing."""
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel,
                                            array_metadata_store=orbax_array_metadata_store())
    others = [(t, ocp.type_handlers.get_type_handler(t)) for t in (int, float, bytes, np.number, np.ndarray, str)]
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays), *others)
    return ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, restore_concurrent_gb=96,
                                       type_handler_registry=registry)


def orbax_array_metadata_store():
    """The store of per-array metadata (`array_metadatas/`) that orbax's default jax.Array handler
    writes. orbax 0.12.8 exports neither the store's class nor an accessor (its own
    `resolve_array_metadata_store` reads the same private attribute), so this is the one place that
    reads it; tests/test_checkpoint.py fails if orbax renames it. An AttributeError here is that."""
    return ocp.type_handlers.get_type_handler(jax.Array)._array_metadata_store


class _DrainingEventLoop(asyncio.SelectorEventLoop):
    """An event loop that finishes its pending tasks before it closes."""

    def close(self) -> None:
        # until none is left: a task that fails can leave the tasks it started behind, still running
        while not self.is_running() and not self.is_closed() and (
                pending := [t for t in asyncio.all_tasks(self) if not t.done()]):
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


@contextlib.contextmanager
def draining_event_loops():
    """Event loops created in this block wait for their pending tasks before closing.

    Orbax runs a restore in a fresh event loop and closes it as soon as the first shard read
    fails, while the reads of the other shards are still in flight; their completions would then
    reach a closed loop ("RuntimeError: Event loop is closed", raised later from garbage
    collection, in whatever code runs then). Waiting for them leaves no orbax work behind.

    Orbax has no setting for the loops it makes (it calls `asyncio.new_event_loop()`), so the block
    sets the `new_event_loop` of asyncio's process-wide policy: a loop another thread creates
    meanwhile drains too (it only waits longer when it closes). On exit the policy is as before,
    also when blocks nest."""
    policy = asyncio.get_event_loop_policy()
    before = vars(policy).get("new_event_loop")  # set by an enclosing block, else None
    policy.new_event_loop = _DrainingEventLoop
    try:
        yield
    finally:
        if before is None:
            del policy.new_event_loop
        else:
            policy.new_event_loop = before


WRITER_THREAD = "ts_pool_worker"  # the name tensorstore gives its worker threads


def lower_writer_priority(niceness: int) -> None:
    """Sets tensorstore's worker threads to `niceness`, so that an async save uses the CPU time the
    steps running beside it leave idle (at equal priority it slows them; measured in
    bench/README.md, Checkpoints). Per-thread niceness is Linux's; elsewhere this does nothing."""
    tasks = Path("/proc/self/task")
    if niceness <= 0 or not tasks.is_dir():
        return
    for task in tasks.iterdir():
        try:
            tid = int(task.name)
            if (task / "comm").read_text().strip() == WRITER_THREAD and os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:  # the thread has ended
            pass


@contextlib.contextmanager
def lower_priority(niceness: int):
    """The calling thread runs at `niceness` (at least) within the block (Linux; elsewhere a no-op)."""
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(before, niceness))
    except (AttributeError, OSError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # lowering a niceness again needs privileges: try
            os.setpriority(os.PRIO_PROCESS, tid, before)


class Checkpointer:
    """Saves and restores one run's train state: `abstract_state` (ShapeDtypeStructs with this run's
    shardings) is what restores target, `mesh_shape` is recorded with each save."""

    def __init__(self, cfg: config_lib.RunConfig, abstract_state, mesh_shape: dict[str, int],
                 replica_parallel: bool | None = None, checksums: bool = True):
        """replica_parallel: split the writing of replicated arrays among their replicas;
        by default only when there are several processes (see `state_handler`). checksums: record
        them with each save (integrity.py; off only to measure their cost, bench/checkpoint.py)."""
        self.cfg, self.abstract_state, self.mesh_shape = cfg, abstract_state, dict(mesh_shape)
        self.dir = listing.directory(cfg)
        c = cfg.checkpoint
        self.uncommitted = [s.step for s in listing.scan(self.dir) if s.state == "uncommitted"]
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.max_to_keep, keep_period=c.keep_period, enable_async_checkpointing=True,
            create=True, cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_checksums if checksums else None))
        self.manager = ocp.CheckpointManager(self.dir, options=options, item_handlers={
            "state": state_handler(jax.process_count() > 1 if replica_parallel is None else replica_parallel),
            "meta": ocp.JsonCheckpointHandler()})
        self.saving_step: int | None = None
        self.unverified: list[int] = []
        """Steps restored without checksums to verify (written before shardtrain recorded them)."""

    def _record_checksums(self) -> None:
        """Orbax calls this in its background thread once the step being saved is written, before it
        commits it (renames the temporary directory): the step is committed with its checksums."""
        if jax.process_index() == 0:
            root = epath.Path(self.dir)
            tmp = sorted(root.glob(f"{self.saving_step}{listing.TMP_MARK}*"))
            with lower_priority(self.cfg.checkpoint.writer_niceness):  # like the writing: on idle CPU time
                integrity.record(tmp[-1] if tmp else root / str(self.saving_step))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int) -> tuple[dict, dict]:
        """The state (already in this run's shardings) and metadata saved at `step`. Raises
        ConfigError if the checkpoint does not fit the model, another exception if unreadable."""
        with draining_event_loops():
            return self._restore(step)

    def restore_given(self, step: int) -> tuple[dict, dict]:
        """`restore` of a step a user named (eval, export): an unreadable or damaged one is a ConfigError
        naming the step and the damage (what Orbax logs meanwhile goes to run_dir/shardtrain.log)."""
        try:
            with library_log(self.cfg.run_dir):
                return self.restore(step)
        except config_lib.ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure: the step cannot be used
            why = diagnose.read_error(e, epath.Path(self.dir) / str(step))
            raise config_lib.ConfigError(f"checkpoint step {step} in {self.dir} cannot be used: {why}; give another "
                                         "step (`shardtrain ckpt --verify RUN_DIR` checks them all)") from None

    def _restore(self, step: int) -> tuple[dict, dict]:
        if jax.process_index() == 0 and not integrity.verify(epath.Path(self.dir) / str(step)):
            self.unverified.append(step)  # the other processes wait for process 0's verdict in restore_latest
        saved = self.manager.item_metadata(step)["state"]
        if saved is None:
            raise FileNotFoundError("its array metadata (state/_METADATA) is missing")
        bad = diagnose.mismatches(diagnose.leaf_shapes(saved.tree), diagnose.leaf_shapes(self.abstract_state))
        if bad:
            meta = listing.read_meta(epath.Path(self.dir) / str(step))
            changes = diagnose.config_changes(meta.get("config", {}), self.cfg) if meta else []
            hint = f"\nconfig changes since it was written: {'; '.join(changes)}" if changes else ""
            raise config_lib.ConfigError(
                f"checkpoint step {step} in {self.dir} does not fit this config's model "
                f"({len(bad)} mismatching paths):\n  " + "\n  ".join(bad[:30]) + hint +
                "\nResume with the config it was written with, or use another run_dir / checkpoint.directory.")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                self.abstract_state, ocp.checkpoint_utils.construct_restore_args(self.abstract_state)),
            meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def restore_latest(self, say=print) -> tuple[dict, dict] | None:
        """Restores the newest committed step that reads back whole; reports and sets aside the
        newer ones that do not. None when there is no committed step; ConfigError when there are
        some but none reads back (then nothing is moved: the storage may only be unreachable)."""
        for step in self.uncommitted:
            say(f"checkpoint step {step} was never committed (the process stopped while writing it); ignoring it")
        failed = []
        for step in reversed(listing.committed_in(self.dir)):  # what `shardtrain ckpt` calls committed
            try:
                state, meta = self.restore(step)
                error = None
            except config_lib.ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure makes the step unusable
                error = diagnose.read_error(e, epath.Path(self.dir) / str(step))
            if all_processes_agree(error is None):
                for bad, reason in failed:
                    self.set_aside(bad, reason)
                    say(f"checkpoint step {bad} is unusable ({reason}); moved it to "
                        f"{self.dir}/{listing.UNUSABLE_DIR}/{bad} and fell back to step {step}")
                if step in self.unverified:
                    say(f"checkpoint step {step} has no checksums (written before shardtrain recorded them); "
                        "restored it unverified")
                return state, meta
            failed.append((step, error or "unreadable on another process"))
        if failed:
            raise config_lib.ConfigError(
                f"none of the committed checkpoints in {self.dir} can be read:\n  " +
                "\n  ".join(f"step {s}: {r}" for s, r in failed) +
                "\nNothing was moved or deleted. If the storage was unreachable, rerun later; if they are "
                "damaged for good, move them out of that directory (or use a new run_dir) to start from step 0.")
        return None

    def set_aside(self, step: int, reason: str) -> None:
        """Moves step `step` out of orbax's view (never deletes it)."""
        if jax.process_index() == 0:
            root = epath.Path(self.dir)
            target = root / listing.UNUSABLE_DIR / str(step)
            if target.exists():
                target = root / listing.UNUSABLE_DIR / f"{step}-{time.time_ns()}"
            target.parent.mkdir(parents=True, exist_ok=True)
            (root / str(step)).rename(target)
            moved = reason.replace(f"{root / str(step)}/", f"{target}/")  # name the files where they now are
            (target / "UNUSABLE.txt").write_text(moved + "\n")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"shardtrain set aside {step}")
        self.manager.reload()

    def save(self, step: int, state: dict) -> None:
        """Starts an async save of `state` (after `step` updates); returns once arrays are copied.
        Raises SaveFailed if the previous save failed."""
        meta = self.meta(step)
        self._raising(self.manager.wait_until_finished)
        self.saving_step = step
        self._raising(lambda: self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)), force=True))
        lower_writer_priority(self.cfg.checkpoint.writer_niceness)

    def meta(self, step: int) -> dict:
        """The metadata saved with step `step`: data position, mesh, device and process counts, config."""
        return {"step": step, "data_position": step * self.cfg.train.global_batch_size, "mesh": self.mesh_shape,
                "devices": jax.device_count(), "processes": jax.process_count(),
                "config": config_lib.to_dict(self.cfg)}

    def check(self) -> None:
        """Raises SaveFailed if a finished async save failed; never blocks on one in flight."""
        if self.manager.is_saving_in_progress():
            lower_writer_priority(self.cfg.checkpoint.writer_niceness)  # tensorstore starts threads as it goes
        else:
            self._raising(self.manager.wait_until_finished)

    def wait(self) -> None:
        """Blocks until every pending save is committed; raises SaveFailed if one failed."""
        self._raising(self.manager.wait_until_finished)

    def _raising(self, fn):
        try:
            return fn()
        except Exception as e:
            self.manager.reload()  # orbax forgets steps it meant to delete after the failed save
            latest = self.manager.latest_step()
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            raise SaveFailed(
                f"saving checkpoint step {self.saving_step} to {self.dir} failed ({type(e).__name__}: {reason}); "
                f"the newest committed checkpoint is step {'none yet' if latest is None else latest}. The run "
                f"stopped: fix the cause (disk space, permissions, checkpoint.directory) and rerun the same "
                f"command to resume; details in {Path(self.cfg.run_dir) / LOG_FILE}") from e

    def close(self) -> None:
        self.manager.close()


def console_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers of `logger` that write to the process's stderr or stdout."""
    return [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
            and getattr(h.stream, "name", None) in ("<stderr>", "<stdout>")]


class LibraryLog(logging.FileHandler):
    """The file `library_log` sends library logging to."""


@contextlib.contextmanager
def library_log(directory: str | Path):
    """Within this block what libraries log through Python's `logging` (Orbax through absl: a failed
    async save's traceback, its warnings while reading a checkpoint; jax, grain) goes to
    DIRECTORY/shardtrain.log (shardtrain.process<i>.log on other processes), not the console;
    to the system's temporary directory when DIRECTORY is not a directory this process can write.
    Inside another such block (a run reading its checkpoint.init_from) the outer file keeps it all."""
    root = logging.getLogger()
    if any(isinstance(h, LibraryLog) for h in root.handlers):
        yield
        return
    name = LOG_FILE if jax.process_index() == 0 else f"shardtrain.process{jax.process_index()}.log"
    writable = os.path.isdir(directory) and os.access(directory, os.W_OK)
    handler = LibraryLog(Path(directory if writable else tempfile.gettempdir()) / name,
                         delay=True)  # created on the first record
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = console_handlers(root)
    for h in console:
        root.removeHandler(h)
    root.addHandler(handler)
    unraisable, sys.unraisablehook = sys.unraisablehook, log_unraisable
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        root.removeHandler(handler)
        for h in console:
            root.addHandler(h)
        handler.close()


def log_unraisable(u) -> None:
    """sys.unraisablehook inside `library_log`: an exception nobody can catch (tensorstore completing a
    write after Orbax closed the event loop of a failed save: "Event loop is closed", dozens of them) is
    logged, not printed."""
    logging.getLogger("shardtrain.unraisable").warning(
        "%s %r", u.err_msg or "Exception ignored in", u.object,
        exc_info=(u.exc_type, u.exc_value, u.exc_traceback))


def start_step_from(meta: dict, cfg: config_lib.RunConfig) -> int:
    """The step to continue from, checking that the data position maps onto whole steps."""
    position, batch, step = meta["data_position"], cfg.train.global_batch_size, meta["step"]
    if position != step * batch:
        raise config_lib.ConfigError(
            f"train.global_batch_size={batch}, but checkpoint step {step} was written with "
            f"{position // max(step, 1)} (data position {position} samples); resume with "
            f"train.global_batch_size={position // max(step, 1)} or use a new run_dir")
    return step
