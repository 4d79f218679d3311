"""End-to-end preemption tests: `python -m shardtrain.cli train` subprocesses stopped by SIGTERM
and kill -9, resumed onto the same mesh, another mesh shape and fewer devices, each compared with
one uninterrupted run of the same config."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import FAST_COMPILE, TINY, cli_env
from shardtrain import cli
from shardtrain.checkpoint import listing
from shardtrain.runtime import faults

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
BASE = ["meshes/demo.yaml", *TINY, "model.name=mlp", f"train.steps={STEPS}",
        f"optimizer.decay_steps={STEPS}", "checkpoint.every_steps=2"]


CLI_WITH_SIGINT = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "runpy.run_module('shardtrain.cli', run_name='__main__')")


def start(run_dir, *overrides, devices=8, env=None, log=None) -> subprocess.Popen:
    """The run in a subprocess; its output through a pipe, or into the file `log` (to read it while it runs).
    Its SIGINT is the default one, as in a terminal, even where pytest was started with SIGINT ignored
    (`pytest &` in a script), which a child would inherit and keep (runtime/preemption.py)."""
    env = cli_env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}",
                  **(env or {}))
    with open(log or os.devnull, "w") as out:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-c", CLI_WITH_SIGINT, "train", *BASE, f"run_dir={run_dir}",
                                 *overrides], cwd=ROOT, env=env, stdout=out if log else subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)


def train(run_dir, *overrides, devices=8) -> str:
    p = start(run_dir, *overrides, devices=devices)
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    return out


def rows(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:  # a line being written while we poll, or cut by a kill
            pass
    return found


def losses(run_dir) -> dict[int, float]:
    steps = [r["step"] for r in rows(run_dir) if "loss" in r]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {sorted(steps)}"
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def saved(run_dir, step) -> tuple[list[np.ndarray], dict]:
    """The state leaves and metadata of checkpoint `step`, read back as written."""
    step_dir = Path(run_dir) / "checkpoints" / str(step)
    state = ocp.StandardCheckpointer().restore(step_dir / "state")
    return [np.asarray(x) for x in jax.tree.leaves(state)], json.loads((step_dir / "meta" / "metadata").read_text())


def newest_committed(run_dir) -> int | None:
    steps = [s.step for s in listing.scan(str(Path(run_dir) / "checkpoints")) if s.state == "committed"]
    return max(steps, default=None)


def wait_for(condition, p: subprocess.Popen, timeout=300.0, poll=0.005) -> bool:
    """True once `condition()` holds; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if p.poll() is not None:
            return False
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)
    return True


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    train(run_dir)
    return run_dir


def test_sigterm_exits_75_with_event_and_resumes_bitwise(straight, tmp_path):
    p = start(tmp_path)
    assert wait_for(lambda: len(losses(tmp_path)) >= 5, p)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 75, out[-3000:]
    stop = max(losses(tmp_path))
    assert 5 <= stop < STEPS
    assert f"preempted at step {stop}: saved checkpoint step {stop}; rerun the same command to resume" in out
    assert f"preempted: step {stop}, loss" in out and "done:" not in out  # the end line says how it ended
    assert [r["step"] for r in rows(tmp_path) if r.get("event") == "preempted"] == [stop]
    assert newest_committed(tmp_path) == stop

    out = train(tmp_path)
    assert f"resuming from checkpoint step {stop} " in out
    assert losses(tmp_path) == losses(straight)  # every step, bitwise
    for a, b in zip(saved(tmp_path, STEPS)[0], saved(straight, STEPS)[0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_ctrl_c_saves_at_the_step_said_exits_75_without_a_traceback_and_resumes_bitwise(straight, tmp_path):
    p = start(tmp_path)
    assert wait_for(lambda: len(losses(tmp_path)) >= 5, p)
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 75 and "Traceback" not in out, out[-3000:]
    stop = max(losses(tmp_path))
    assert f"preempted at step {stop}: saved checkpoint step {stop}" in out and newest_committed(tmp_path) == stop
    out = train(tmp_path)
    assert f"resuming from checkpoint step {stop} " in out
    assert losses(tmp_path) == losses(straight)


def test_a_second_trainer_on_a_run_dir_exits_2_at_once_and_changes_nothing(straight, tmp_path, capsys):
    """The first trains past the schedule's end (train.steps far away; optimizer.decay_steps fixes
    the schedule); the second, started while it runs, is refused in one line naming its pid."""
    p = start(tmp_path, "train.steps=100000")
    assert wait_for(lambda: len(losses(tmp_path)) >= STEPS, p)
    before = {f: (tmp_path / f).read_bytes() for f in ("goodput.jsonl", "config.yaml")}
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(ROOT / BASE[0]), *BASE[1:], f"run_dir={tmp_path}", "train.steps=100000"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and time.monotonic() - t0 < 10, err
    assert f"is being trained by pid {p.pid} on host" in err and len(err.strip().splitlines()) == 1
    assert p.poll() is None and all((tmp_path / f).read_bytes().startswith(b) for f, b in before.items())
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 75, out[-3000:]
    got = losses(tmp_path)
    assert {s: got[s] for s in range(1, STEPS + 1)} == losses(straight)  # each step once, exact


def test_a_second_ctrl_c_exits_at_once_and_a_signal_before_the_first_step_says_nothing_was_trained(tmp_path):
    p = start(tmp_path, env={faults.VARIABLE: "hang@3"})  # step 3 never returns
    assert wait_for(lambda: len(losses(tmp_path)) >= 2, p)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out = p.communicate(timeout=30)[0]
    assert p.returncode == 130 and time.monotonic() - t0 < 10 and "Traceback" not in out, out[-3000:]
    assert "Ctrl-C (SIGINT) again: stopping now" in out

    log = tmp_path / "first.log"
    p = start(tmp_path / "first", env={faults.VARIABLE: "hang@1"}, log=log)  # the first step never returns
    assert wait_for(lambda: "compiling..." in log.read_text(), p, poll=0.05)  # compiling, or in step 1
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    out = log.read_text()
    assert p.returncode == 75 and "SIGTERM before the first step of this start finished: nothing was trained" in out
    assert losses(tmp_path / "first") == {} and "Traceback" not in out


def test_elastic_resume_onto_another_mesh_and_fewer_devices(straight, tmp_path):
    train(tmp_path, "train.steps=10")  # data=2 x fsdp=2 x tensor=2 on 8 devices
    out = train(tmp_path, "train.steps=20", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1")
    assert "resuming from checkpoint step 10 (written on mesh data=2,fsdp=2,tensor=2 (8 devices" in out
    assert "data position 80 samples" in out
    out = train(tmp_path, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", devices=4)
    assert "on 4 cpu devices" in out and "resuming from checkpoint step 20 (written on mesh fsdp=8 (8 devices" in out
    assert "data position 160 samples" in out

    got, want = losses(tmp_path), losses(straight)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == want[s] for s in range(1, 11))  # same mesh: bitwise
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], [want[s] for s in range(1, STEPS + 1)],
                               rtol=1e-5, atol=0)
    leaves, meta = saved(tmp_path, STEPS)
    assert meta["data_position"] == STEPS * 8 and meta["devices"] == 4
    assert meta["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1}
    for a, b in zip(leaves, saved(straight, STEPS)[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_kill9_at_random_moments_then_final_params_equal_uninterrupted(straight, tmp_path):
    """Ten kill -9s (during start-up, in the middle of a checkpoint write, at a random moment after
    progress) of a run that cannot finish first (train.steps far away; the schedule is fixed by
    optimizer.decay_steps), then one run to the end: every loss and the final state equal an
    uninterrupted run's."""
    seed = int(time.time())
    rng = random.Random(seed)
    plan = ["startup"] * 2 + ["mid-write"] * 4 + ["random"] * 4  # 10 kills, in a random order
    rng.shuffle(plan)
    for mode in plan:
        resume_from = newest_committed(tmp_path)
        p = start(tmp_path, "checkpoint.every_steps=1", "train.steps=100000")
        if mode == "startup":  # during imports, compilation or restore
            time.sleep(rng.uniform(0.0, 4.0))
        elif wait_for(lambda: (newest_committed(tmp_path) or 0) > (resume_from or 0), p):  # made progress  # noqa: B023
            ckpt_dir = tmp_path / "checkpoints"
            if mode == "mid-write":
                wait_for(lambda: any(listing.TMP_MARK in n for n in os.listdir(ckpt_dir)), p)  # noqa: B023
            else:
                time.sleep(rng.uniform(0.0, 0.3))
        p.kill()
        out = p.communicate()[0]
        assert p.returncode == -signal.SIGKILL, f"seed {seed}, {mode}: " + out[-3000:]  # alive until the kill
        assert "is unusable" not in out, out[-3000:]
        if resume_from is not None and "ready in" in out:
            assert f"resuming from checkpoint step {resume_from} " in out, out[-3000:]
    end = max(STEPS, (newest_committed(tmp_path) or 0) + 1)
    train(tmp_path, "checkpoint.every_steps=1", f"train.steps={end}")
    reference = straight
    if end > STEPS:  # a slow poll let the killed runs go past the usual end: compare as far as they went
        reference = tmp_path.parent / f"{tmp_path.name}-straight"
        train(reference, f"train.steps={end}", "checkpoint.every_steps=1")
    assert losses(tmp_path) == losses(reference), f"seed {seed}"
    for a, b in zip(saved(tmp_path, end)[0], saved(reference, end)[0], strict=True):
        np.testing.assert_array_equal(a, b)
