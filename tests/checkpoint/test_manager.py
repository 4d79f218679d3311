"""Checkpoint unit tests (in process, 8 simulated devices): fit check, corrupt-step fallback,
failed async saves, retention options, gs:// paths, the `ckpt` listing, metrics after resume."""

import asyncio
import errno
import glob
import json
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint.path import atomicity

import conftest
from shardtrain import config, loop, step as step_lib
from shardtrain.checkpoint import diagnose, listing, manager
from shardtrain.parallel import mesh as mesh_lib

TINY = [*conftest.TINY, "model.name=mlp", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def program(cfg_factory, *overrides):
    cfg = cfg_factory(*TINY, *overrides)
    return step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))


def checkpointer(prog, **kw) -> manager.Checkpointer:
    return manager.Checkpointer(prog.cfg, prog.abstract_state, prog.mesh.shape, **kw)


def save_steps(prog, steps):
    ckpt = checkpointer(prog)
    state = prog.init(0)
    for s in steps:
        ckpt.save(s, state)
    ckpt.wait()
    ckpt.close()
    return state


def test_checkpoint_of_another_model_lists_mismatching_paths(cfg_factory):
    save_steps(program(cfg_factory), [2])
    other = program(cfg_factory, "model.d_model=64", "model.n_layers=3")
    with pytest.raises(config.ConfigError) as e:
        checkpointer(other).restore_latest(say=lambda _: None)
    msg = str(e.value)
    assert "checkpoint step 2" in msg and "does not fit" in msg
    assert "params/blocks/w_in_df: checkpoint (2, 32, 64), this config (3, 64, 64)" in msg
    assert "opt/1/0/mu/embedding_vd: checkpoint (256, 32), this config (256, 64)" in msg
    assert "model.d_model: 32 -> 64" in msg and "model.n_layers: 2 -> 3" in msg


def test_config_changes_name_nested_fields_and_ignore_json_lists():
    saved = json.loads(json.dumps(config.to_dict(config.load(None, ["model.moe.n_experts=8", "model.d_model=64"]))))
    now = config.load(None, ["model.moe.n_experts=4"])
    assert diagnose.config_changes(saved, now) == ["model.d_model: 64 -> 128", "model.moe.n_experts: 8 -> 4"]


def test_checkpoint_with_other_parameter_names_lists_them(cfg_factory):
    save_steps(program(cfg_factory), [2])
    with pytest.raises(config.ConfigError) as e:
        checkpointer(program(cfg_factory, "model.name=gpt", "model.n_heads=2",
                             "model.n_kv_heads=2")).restore_latest(say=lambda _: None)
    assert "params/blocks/w_in_df: only in the checkpoint" in str(e.value)
    assert "params/blocks/attn" in str(e.value) and "missing from the checkpoint" in str(e.value)


def test_state_keeps_orbax_default_array_metadata(cfg_factory):
    """Our state handler writes the per-array metadata orbax's default handler writes. The store is
    orbax's private attribute (`manager.orbax_array_metadata_store`, no public accessor in orbax
    0.12.8): this fails when orbax renames it or stops writing through it."""
    prog = program(cfg_factory)
    save_steps(prog, [1])
    assert os.listdir(f"{prog.cfg.checkpoint_dir()}/1/state/array_metadatas") == ["process_0"]
    assert type(manager.orbax_array_metadata_store()).__name__ == "Store"


def test_draining_event_loops_is_undone_on_exit():
    """Inside the block (also nested) new event loops drain; after it asyncio's policy is as before."""
    def kind():
        loop = asyncio.new_event_loop()
        loop.close()
        return type(loop).__name__

    with manager.draining_event_loops():
        with manager.draining_event_loops():
            assert kind() == "_DrainingEventLoop"
        assert kind() == "_DrainingEventLoop"
    assert kind() != "_DrainingEventLoop"
    assert "new_event_loop" not in vars(asyncio.get_event_loop_policy())


def test_truncated_and_deleted_files_fall_back_to_newest_good_step(cfg_factory, capsys):
    prog = program(cfg_factory)
    state = save_steps(prog, [2, 4, 6])
    root = prog.cfg.checkpoint_dir()
    big = max(glob.glob(f"{root}/6/state/ocdbt.process_0/d/*"), key=os.path.getsize)
    os.truncate(big, os.path.getsize(big) // 2)
    os.remove(f"{root}/4/state/_METADATA")
    os.makedirs(f"{root}/8.orbax-checkpoint-tmp/state")  # a save killed half-way

    ckpt = checkpointer(prog)
    said = []
    _, meta = ckpt.restore_latest(say=said.append)
    assert meta["step"] == 2 and meta["data_position"] == 2 * 8
    assert said[0].startswith("checkpoint step 8 was never committed")
    assert said[1].startswith("checkpoint step 6 is unusable (") and said[1].endswith(
        f"moved it to {root}/unusable/6 and fell back to step 2")
    assert said[2].startswith("checkpoint step 4 is unusable (") and "_METADATA" in said[2]
    assert ckpt.manager.all_steps() == [2]
    assert said[1].startswith(f"checkpoint step 6 is unusable ({big} is truncated (")  # names the damaged file
    aside = Path(f"{root}/unusable/6/UNUSABLE.txt").read_text()  # what `shardtrain ckpt` shows
    assert aside.startswith(f"{root}/unusable/6/state/ocdbt.process_0/d/{Path(big).name} is truncated (")
    # New saves of the same step numbers work; the bad ones stay aside, never deleted.
    for s in (4, 6):
        ckpt.save(s, state)
    ckpt.wait()
    assert ckpt.manager.all_steps() == [2, 4, 6]
    assert sorted(os.listdir(f"{root}/unusable")) == ["4", "6"]
    assert checkpointer(prog).restore_latest(say=said.append)[1]["step"] == 6

    assert listing.list_main(prog.cfg.run_dir) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["2", "committed"], ["4", "committed"], ["4", "unusable"],
                                     ["6", "committed"], ["6", "unusable"]]
    assert rows[0][4:6] == ["data=2,fsdp=2,tensor=2", "(8"] and float(rows[0][2]) > 0.1  # MB


def test_no_readable_checkpoint_stops_without_moving_anything(cfg_factory):
    prog = program(cfg_factory)
    save_steps(prog, [2])
    root = prog.cfg.checkpoint_dir()
    os.remove(f"{root}/2/meta/metadata")
    with pytest.raises(config.ConfigError, match="(?s)none of the committed checkpoints .* step 2: "
                                                 "[^\\n]*/2/meta/metadata is missing.*Nothing was moved"):
        checkpointer(prog).restore_latest(say=lambda _: None)
    assert sorted(os.listdir(root)) == ["2"]


def test_newest_corrupt_step_falls_back_and_good_steps_survive_later_saves(cfg_factory):
    prog = program(cfg_factory, "checkpoint.max_to_keep=2")
    state = save_steps(prog, [2, 4])
    root = prog.cfg.checkpoint_dir()
    for f in glob.glob(f"{root}/4/state/ocdbt.process_0/d/*"):
        os.remove(f)
    ckpt = checkpointer(prog)
    said = []
    _, meta = ckpt.restore_latest(say=said.append)
    assert meta["step"] == 2 and len(said) == 1 and "step 4 is unusable" in said[0]
    ckpt.save(4, state)  # the bad step 4 does not count towards max_to_keep: step 2 stays
    ckpt.wait()
    assert sorted(os.listdir(root)) == ["2", "4", "unusable"]


def test_failed_async_save_stops_the_run_and_keeps_good_steps(cfg_factory, monkeypatch):
    prog = program(cfg_factory, "checkpoint.max_to_keep=1")
    state = save_steps(prog, [1])
    ckpt = checkpointer(prog)

    async def disk_full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    ckpt.save(2, state)  # async: returns before the failure
    with pytest.raises(manager.SaveFailed) as e:
        ckpt.wait()
    assert "saving checkpoint step 2" in str(e.value) and "No space left on device" in str(e.value)
    assert "newest committed checkpoint is step 1" in str(e.value)
    assert ckpt.manager.all_steps() == [1]
    assert os.path.exists(f"{prog.cfg.checkpoint_dir()}/1/commit_success.txt")  # max_to_keep=1 did not delete it


def test_failed_async_save_stops_the_training_loop(cfg_factory, monkeypatch, capfd):
    cfg = cfg_factory(*TINY, "train.steps=8", "checkpoint.every_steps=2")

    async def disk_full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    with pytest.raises(manager.SaveFailed) as e:
        loop.train(cfg)
    message = str(e.value)
    assert "\n" not in message and "saving checkpoint step 2" in message and "No space left" in message
    assert "newest committed checkpoint is step none yet" in message and "rerun the same command" in message
    lines = Path(cfg.run_dir, "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in lines if "loss" in line]
    assert max(logged) <= 4  # stopped at the next step boundary or save, not at the end
    console = capfd.readouterr()
    assert "Traceback" not in console.err + console.out and "done: step" not in console.out
    log = Path(cfg.run_dir, manager.LOG_FILE)
    assert str(log) in message and "Traceback" in log.read_text() and "No space left" in log.read_text()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread niceness is Linux's")
def test_async_save_writes_at_low_cpu_priority(cfg_factory):
    prog = program(cfg_factory, "checkpoint.writer_niceness=19")
    ckpt = checkpointer(prog)
    state = prog.init(0)
    for step in (1, 2):  # threads tensorstore starts late in one save are lowered in the next
        ckpt.save(step, state)
        while ckpt.manager.is_saving_in_progress():
            ckpt.check()
        ckpt.wait()
    ckpt.close()
    niceness = {}
    for task in Path("/proc/self/task").iterdir():
        try:  # a thread may end between the listing and these reads
            if (task / "comm").read_text().strip() == manager.WRITER_THREAD:
                niceness[task.name] = os.getpriority(os.PRIO_PROCESS, int(task.name))
        except OSError:
            pass
    assert niceness and set(niceness.values()) == {19}


def test_retention_every_steps_keep_period_and_final_checkpoint(cfg_factory):
    cfg = cfg_factory(*TINY, "train.steps=10", "checkpoint.every_steps=3", "checkpoint.max_to_keep=2",
                      "checkpoint.keep_period=6")
    assert loop.train(cfg) == 0
    steps = {s.step: s.state for s in listing.scan(cfg.checkpoint_dir())}
    assert steps == {6: "committed", 9: "committed", 10: "committed"}  # 3 dropped; 6 kept by keep_period


def test_gs_directory_is_passed_to_orbax_untouched(cfg_factory, monkeypatch):
    seen = {}

    class Manager:
        def __init__(self, directory, options, item_handlers):
            seen["directory"], seen["options"] = directory, options

    prog = program(cfg_factory, "checkpoint.directory=gs://bucket/runs/x", "checkpoint.max_to_keep=5",
                   "checkpoint.keep_period=100")
    monkeypatch.setattr(listing, "scan", lambda d: [])
    monkeypatch.setattr(ocp, "CheckpointManager", Manager)
    monkeypatch.setattr(listing.importlib.util, "find_spec", lambda name: name == "gcsfs")
    checkpointer(prog)
    assert seen["directory"] == "gs://bucket/runs/x"
    assert seen["options"].max_to_keep == 5 and seen["options"].keep_period == 100
    monkeypatch.setattr(listing.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(config.ConfigError, match=r"directory=gs://bucket/runs/x: .*pip install 'shardtrain\[gcs\]'"):
        checkpointer(prog)
    with pytest.raises(config.ConfigError, match="run_dir=gs://b/r: must be a local directory"):
        config.load(None, ["run_dir=gs://b/r"])


def test_batch_size_change_is_a_config_error(cfg_factory):
    cfg = cfg_factory(*TINY, "train.global_batch_size=16")
    with pytest.raises(config.ConfigError,
                       match="train.global_batch_size=16, but checkpoint step 3 was written with 8"):
        manager.start_step_from({"step": 3, "data_position": 24}, cfg)
    assert manager.start_step_from({"step": 3, "data_position": 48}, cfg) == 3


def test_restored_state_is_bitwise_the_saved_one_on_another_mesh(cfg_factory):
    prog = program(cfg_factory)
    state = save_steps(prog, [3])
    other = program(cfg_factory, "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1")
    restored, meta = checkpointer(other).restore_latest(say=lambda _: None)
    assert meta["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    for a, b, s in zip(jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(other.state_shardings)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding == s


def test_damaged_step_messages_name_the_file(cfg_factory):
    """The reason a step is unusable names the damaged file, not tensorstore's repr of its spec."""
    prog = program(cfg_factory, "checkpoint.max_to_keep=10")
    save_steps(prog, [1, 2, 3, 4])
    root = Path(prog.cfg.checkpoint_dir())
    big = max(glob.glob(f"{root}/1/state/ocdbt.process_0/d/*"), key=os.path.getsize)
    os.truncate(big, os.path.getsize(big) // 2)
    os.remove(root / "2/state/manifest.ocdbt")
    os.truncate(root / "3/state/_METADATA", 100)
    for f in glob.glob(f"{root}/4/state/ocdbt.process_0/d/*"):
        os.remove(f)
    ckpt = checkpointer(prog)
    expected = {1: f"{big} is truncated (", 2: f"{root}/2/state/manifest.ocdbt is missing",
                3: f"{root}/3/state/_METADATA is not valid JSON",
                4: "array params/blocks/w_in_df has no data (a data file under "
                   f"{root}/4/state/ocdbt.process_*/d is missing)"}
    for step, message in expected.items():
        with pytest.raises(Exception) as e:
            ckpt.restore(step)
        reason = diagnose.read_error(e.value, root / str(step))
        assert reason.startswith(message), reason
        assert "pybind11" not in reason and "TensorStore({" not in reason and "\n" not in reason
    ckpt.close()


def test_uncatchable_errors_during_a_run_go_to_the_log_not_the_console(tmp_path, capsys):
    """What tensorstore raises into a closed event loop after a failed save ("Event loop is closed",
    dozens of times) reaches sys.unraisablehook: inside library_log it is logged to shardtrain.log."""
    class Closing:
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    with manager.library_log(tmp_path):
        Closing()
    assert "Event loop is closed" not in capsys.readouterr().err
    assert "RuntimeError: Event loop is closed" in (tmp_path / manager.LOG_FILE).read_text()


@pytest.mark.slow  # three short training runs
def test_offloaded_run_resumes_bit_for_bit_into_host_memory(cfg_factory, tmp_path):
    """train.offload: a run stopped after its step-2 checkpoint and started again logs the losses of
    an uninterrupted run without offload, bit for bit, and the state it restores lands in the
    host's pinned memory again (the restore Levanter got wrong: marin PR#8471)."""
    def losses(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}
    run = [*TINY, "checkpoint.every_steps=2", "train.log_every=1", "optimizer.decay_steps=4", "train.eval_every=4",
           "train.eval_steps=1"]  # the evaluation reads the offloaded parameters too
    offload = ["train.offload.optimizer=true", "train.offload.params=true"]
    assert loop.train(cfg_factory(*run, "train.steps=4", f"run_dir={tmp_path / 'plain'}")) == 0
    for steps in (2, 4):
        assert loop.train(cfg_factory(*run, *offload, f"train.steps={steps}", f"run_dir={tmp_path / 'off'}")) == 0
    assert losses(tmp_path / "off") == losses(tmp_path / "plain") and len(losses(tmp_path / "plain")) == 4
    prog = program(cfg_factory, *offload, f"run_dir={tmp_path / 'off'}")
    restored, _ = checkpointer(prog).restore_latest(say=lambda _: None)
    assert {x.sharding.memory_kind for k in ("params", "opt") for x in jax.tree.leaves(restored[k])} == {"pinned_host"}
