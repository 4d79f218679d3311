"""What a run survives without a person (the multi-process scenario is in tests/system/test_multihost.py):
non-finite steps (stop | skip, exact), the local tier's fallback from a damaged copy, the hang
watchdog, stragglers, the goodput report, and the bad inputs that stop before any work."""

import errno
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import conftest
from shardtrain import cli, config, loop, metrics
from shardtrain.checkpoint import local
from shardtrain.runtime import faults, goodput, health

REPO = Path(__file__).resolve().parents[2]
TINY = [*conftest.TINY, "model.name=mlp", "optimizer.warmup_steps=1"]


def train(tmp_path, monkeypatch, capsys, fault: str, *overrides) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.VARIABLE, fault)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(REPO / "meshes/demo.yaml"), f"run_dir={run_dir}", *TINY, *overrides])
    out = capsys.readouterr()
    return e.value.code, out.out + out.err, run_dir


def saved_state(step_dir: Path) -> dict:
    """A checkpoint's state as numpy arrays."""
    with ocp.PyTreeCheckpointer() as c:
        tree = c.metadata(step_dir / "state").item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return c.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def test_nonfinite_stop_names_the_step_and_saves_nothing_from_it(tmp_path, monkeypatch, capsys):
    code, out, run_dir = train(tmp_path, monkeypatch, capsys, "nan@2", "train.steps=3", "checkpoint.every_steps=2")
    assert code == 65 and "non-finite loss or gradients at step 2" in out and "Traceback" not in out
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert (run_dir / "faults" / "nan@2").exists()


def test_nonfinite_skip_leaves_the_state_bit_identical_and_goes_on(tmp_path, monkeypatch, capsys):
    code, out, run_dir = train(tmp_path, monkeypatch, capsys, "nan@3", "train.steps=4", "checkpoint.every_steps=1",
                               "train.on_nonfinite=skip", "checkpoint.max_to_keep=5")
    assert code == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "nonfinite" and r["step"] == 3 and r["action"] == "skip" for r in rows)
    s2, s3, s4 = (saved_state(run_dir / "checkpoints" / str(i)) for i in (2, 3, 4))
    trained = lambda s: jax.tree.leaves({"params": s["params"], "opt": s["opt"]})  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(trained(s2), trained(s3)))  # step 3 changed nothing
    assert not all(np.array_equal(a, b) for a, b in zip(trained(s3), trained(s4)))  # step 4 trained
    assert all(np.isfinite(x).all() for x in trained(s4))


def test_nonfinite_skip_stops_at_the_limit_and_counts_the_skips(tmp_path, monkeypatch, capsys):
    """A run that diverges (every step non-finite once the parameters blew up) is stopped, not skipped through."""
    code, out, run_dir = train(tmp_path, monkeypatch, capsys, "", "train.steps=30", "train.on_nonfinite=skip",
                               "optimizer.learning_rate=1e30")
    assert code == loop.EXIT_NONFINITE and "Traceback" not in out, out
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    assert [r["skipped_total"] for r in rows if r.get("event") == "nonfinite"] == list(range(1, loop.SKIP_LIMIT))
    assert (f"the {loop.SKIP_LIMIT}th skipped in the last {loop.SKIP_WINDOW} steps: train.on_nonfinite=skip stops "
            f"there; {loop.SKIP_LIMIT} skipped in this start") in out.strip().splitlines()[-1]


def test_a_config_error_before_the_first_step_leaves_the_run_dir_as_it_was(tmp_path, monkeypatch, capsys):
    code, out, run_dir = train(tmp_path, monkeypatch, capsys, "", "train.steps=2")
    assert code == 0, out
    files = ("goodput.jsonl", "metrics.jsonl", "config.yaml")
    before = {f: (run_dir / f).read_bytes() for f in files}

    def refuse(*_):
        raise config.ConfigError("refused by the test")
    monkeypatch.setattr(loop, "_start", refuse)  # the last thing _train does before the first step
    code, out, _ = train(tmp_path, monkeypatch, capsys, "", "train.steps=4")
    assert code == 2 and out.strip().splitlines()[-1] == "shardtrain: error: refused by the test"
    assert {f: (run_dir / f).read_bytes() for f in files} == before


def test_a_full_disk_under_the_run_dir_stops_the_run_with_a_checkpoint_and_one_line(tmp_path, monkeypatch, capsys):
    """TensorBoard's file fails at step 3 (ENOSPC): the run saves step 3 and exits 1 (it hung for good before)."""
    def full(self, tag, value, step):
        if step >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(metrics.Board, "add_scalar", full)
    code, out, run_dir = train(tmp_path, monkeypatch, capsys, "", "train.steps=20", "checkpoint.every_steps=100")
    assert code == 1 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (f"shardtrain: error: cannot write {run_dir / 'tensorboard'}: No space left "
                                            f"on device; stopped at step 4 and saved checkpoint step 4; make room and "
                                            f"rerun the same command to resume")
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == ["4"]


class Persistent:
    """Stands in for manager.Checkpointer: its newest step is 2."""

    def latest_step(self):
        return 2

    def restore_latest(self, say):
        return "persistent state", {"step": 2}


def test_local_tier_restores_exactly_and_a_damaged_copy_falls_back_to_the_persistent_tier(cfg_factory, tmp_path):
    cfg = cfg_factory(f"checkpoint.local.directory={tmp_path / 'local'}", "checkpoint.local.every_steps=2")
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = {"w": jax.NamedSharding(mesh, jax.P("a", None)), "v": jax.NamedSharding(mesh, jax.P(None, "b")),
                 "step": jax.NamedSharding(mesh, jax.P())}  # sharded, half replicated, replicated
    state = {"w": jnp.arange(24.0).reshape(8, 3), "v": jnp.ones((3, 4), jnp.bfloat16), "step": jnp.int32(4)}
    state = jax.device_put(state, shardings)
    tier = local.LocalTier(cfg, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                             state, shardings))
    tier.save(4, state, {"step": 4})
    tier.wait()
    restored, meta, which = local.restore_newest(Persistent(), tier, say=print)
    assert which == "local" and meta["step"] == 4
    for k in state:
        assert restored[k].sharding == shardings[k] and np.array_equal(restored[k], state[k])
    npy = sorted((tier.dir / "4").glob("*.npy"))[0]
    npy.write_bytes(npy.read_bytes()[:-8])  # a write cut short
    said = []
    assert local.restore_newest(Persistent(), tier, say=said.append)[2] == "persistent"
    assert any("local checkpoint step 4 cannot be read" in s for s in said), said
    tier.forget_after(2)
    assert tier.steps() == []
    tier.close()


def test_goodput_report_adds_up_and_counts_redone_steps_and_the_restart_gap(tmp_path):
    records = [{"kind": "start", "t": 0}, {"kind": "ready", "t": 10, "step": 0, "restore_s": 1},
               *({"kind": "step", "t": 10 + s, "step": s, "step_s": 0.75, "data_wait": 0.25} for s in (1, 2, 3, 4)),
               {"kind": "start", "t": 20}, {"kind": "ready", "t": 25, "step": 2, "restore_s": 2},  # steps 3, 4 redone
               *({"kind": "step", "t": 25 + s, "step": s + 2, "step_s": 1.0} for s in (1, 2)),
               {"kind": "end", "t": 28, "reason": "done", "checkpoint_save": 1.0}]
    (tmp_path / goodput.FILE).write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "st')
    rep = goodput.report(tmp_path)
    cats = rep["categories"]
    assert rep["wall_s"] == pytest.approx(28) and sum(cats.values()) == pytest.approx(28) and rep["starts"] == 2
    assert cats["redone_steps"] == 1.5 and cats["productive_steps"] == 3.5 and cats["restart_gap"] == 6
    assert cats["startup_compile"] == 12 and cats["checkpoint_restore"] == 3 and cats["data_wait"] == 1
    assert rep["goodput"] == pytest.approx(3.5 / 28)
    assert "goodput 0.125" in goodput.table(rep)


def test_the_goodput_clock_writes_nothing_before_ready_and_nothing_at_all_when_refused(tmp_path):
    path = tmp_path / goodput.FILE
    refused = goodput.Clock(tmp_path, 1.0, write=True)
    refused.discard()
    refused.close()
    assert not path.exists()
    crashed = goodput.Clock(tmp_path, 2.0, write=True)  # failed while compiling: its time was lost, and is counted
    assert not path.exists()
    crashed.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"kind": "start", "t": 2.0}]
    (tmp_path / "full" / goodput.FILE).mkdir(parents=True)  # open() fails as on a full disk
    full = goodput.Clock(tmp_path / "full", 3.0, write=True)
    full.ready(0, 0.0)
    assert full.failed == f"cannot write {tmp_path / 'full' / goodput.FILE}: Is a directory"
    full.step(1)  # later records are dropped, not raised
    full.close()


def test_stragglers_are_named_after_consecutive_slow_log_steps():
    cfg = config.WatchdogConfig(straggler_factor=1.5, straggler_logs=2)
    s = health.Stragglers(cfg, 3)
    assert s.update([0.1, 0.1, 0.3], 1.0) == []  # once is not yet
    assert s.update([0.1, 0.1, 0.3], 1.0) == [2]  # twice in a row: named, once
    assert s.update([0.1, 0.1, 0.3], 1.0) == []
    assert health.slow_processes([0.001, 0.001, 0.004], 1.5, 1.0) == []  # 3 ms of a 1 s step is noise


WATCHED = """
import sys, time
from shardtrain import config
from shardtrain.runtime import health
health.Watchdog(config.WatchdogConfig(startup_s=0.5), sys.argv[1], 3, poll_s=0.1)
time.sleep(30)
"""


def test_the_hang_watchdog_writes_the_stacks_and_exits_70(tmp_path):
    r = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == health.EXIT_HUNG, r.stderr
    assert f"hang-process3.txt; exiting {health.EXIT_HUNG}" in r.stderr and len(r.stderr.splitlines()) == 1
    assert "time.sleep(30)" in (tmp_path / "hang-process3.txt").read_text() or \
        "<string>" in (tmp_path / "hang-process3.txt").read_text()


def test_the_watchdog_exits_70_when_its_report_cannot_be_written(tmp_path):
    (tmp_path / "hang-process3.txt").mkdir()  # open(..., "w") fails as on a full disk
    r = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == health.EXIT_HUNG, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(
        f"cannot write {tmp_path / 'hang-process3.txt'} (Is a directory): Python stacks on stderr above; exiting 70")


@pytest.mark.parametrize("overrides,message", [
    (["checkpoint.local.every_steps=100"], "checkpoint.local.every_steps=100 must be smaller than the persistent"),
    (["checkpoint.local.directory=gs://b/x"], "must be a directory on each host"),
    (["train.watchdog.straggler_factor=1"], "train.watchdog.straggler_factor: must be > 1"),
])
def test_bad_resilience_settings_are_one_line_config_errors(cfg_factory, tmp_path, overrides, message):
    with pytest.raises(config.ConfigError, match=message):
        cfg_factory(f"checkpoint.local.directory={tmp_path}", *overrides)


def test_a_local_tier_directory_that_is_a_file_or_a_bad_fault_stops_before_any_work(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    code, out, _ = train(tmp_path, monkeypatch, capsys, "", f"checkpoint.local.directory={tmp_path / 'file'}")
    assert code == 2 and "checkpoint.local.directory" in out and "is a file" in out
    code, out, _ = train(tmp_path, monkeypatch, capsys, "nan@x")
    assert code == 2 and "SHARDTRAIN_FAULT='nan@x'" in out and len(out.strip().splitlines()) == 1
