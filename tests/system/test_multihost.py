"""Several real processes on this machine, joined by jax.distributed through launch/local.sh:
2 processes x 4 CPU devices train like 1 process x 8, checkpoints move between process counts,
SIGTERM to one process preempts all, and a killed process stops the others."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import conftest

REPO = Path(__file__).resolve().parents[2]
TINY = [*conftest.TINY, "model.name=mlp", "optimizer.warmup_steps=2", "optimizer.decay_steps=6",
        "checkpoint.every_steps=3"]
PLAIN = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
HYBRID = ["mesh.data=1", "mesh.dcn.data=2", "mesh.fsdp=2", "mesh.tensor=2"]  # data across the 2 processes
LONG = ["train.steps=100000", "checkpoint.every_steps=100000"]

pytestmark = pytest.mark.slow


def env() -> dict:
    e = conftest.cli_env()
    e.update(SHARDTRAIN_CMD=f"{sys.executable} -m shardtrain.cli", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
             SHARDTRAIN_HEARTBEAT_TIMEOUT="10")
    return e


def command(n_processes: int, run_dir: Path, *overrides: str) -> list[str]:
    args = ["meshes/demo.yaml", f"run_dir={run_dir}", *TINY, *overrides]
    if n_processes == 1:
        return [sys.executable, "-m", "shardtrain.cli", "train", *args]
    return ["launch/local.sh", str(n_processes), *args]


def train(n_processes: int, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    r = subprocess.run(command(n_processes, run_dir, *overrides), cwd=REPO, env=env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{n_processes} process(es) failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return r


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the last run in run_dir (rows after its last resume event)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resumed = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
    return {r["step"]: r["loss"] for r in rows[resumed[-1] + 1 if resumed else 0:] if "loss" in r}


def assert_close(got: dict, want: dict, steps):
    assert sorted(got) == list(steps)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    assert worst < 1e-5, f"losses differ by {worst:.1e} relative: {got} vs {want}"


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of run `src` as if it had stopped after checkpoint `step`."""
    shutil.copytree(src, dst)
    for s in checkpoint_steps(dst):
        if s > step:
            shutil.rmtree(dst / "checkpoints" / str(s))
    return dst


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(1, run_dir, "train.steps=6", *PLAIN)
    return run_dir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    r = train(2, run_dir, "train.steps=6", *HYBRID)
    assert "shardtrain[process 1/2] joined via SHARDTRAIN_* variables: 4 local of 8 devices" in r.stderr
    # Only process 0 reports: the progress bar and summary come from it alone.
    assert "done: step 6" in r.stdout + r.stderr
    process_1 = [line for line in r.stderr.splitlines() if line.startswith("[process 1]")]
    assert process_1 and not any("done:" in line or "step/s" in line for line in process_1)
    return run_dir


def test_two_processes_train_like_one(one_process, two_processes):
    """Hybrid mesh (mesh.dcn.data=2 over 2 processes) vs the plain 2x2x2 mesh on 1 process x 8."""
    assert_close(losses(two_processes), losses(one_process), range(1, 7))
    assert checkpoint_steps(two_processes) == [3, 6]


def test_checkpoint_from_two_processes_resumes_in_one(one_process, two_processes, tmp_path):
    run_dir = rewind(two_processes, tmp_path / "run", 3)
    r = train(1, run_dir, "train.steps=6", *PLAIN)
    assert "resuming from checkpoint step 3" in r.stdout
    assert_close(losses(run_dir), losses(one_process), range(4, 7))


def test_checkpoint_from_one_process_resumes_in_two(one_process, tmp_path):
    run_dir = rewind(one_process, tmp_path / "run", 3)
    r = train(2, run_dir, "train.steps=6", *PLAIN)
    assert "resuming from checkpoint step 3" in r.stdout
    assert_close(losses(run_dir), losses(one_process), range(4, 7))


def start_long_run(run_dir: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """Starts a 2-process run and waits until it trains; returns the launcher and process 1's pid."""
    with open(log, "w") as out:
        launcher = subprocess.Popen(command(2, run_dir, *PLAIN, *LONG), cwd=REPO, env=env(), text=True,
                                    stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "the run did not start training"
        time.sleep(0.5)
    pid = next(int(line.split()[-1]) for line in log.read_text().splitlines()
               if line.startswith("local.sh: process 1 of 2: pid"))
    return launcher, pid


def test_sigterm_to_one_process_preempts_both_and_the_rerun_resumes(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launcher.log"
    launcher, pid = start_long_run(run_dir, log)
    os.kill(pid, signal.SIGTERM)
    assert launcher.wait(timeout=120) == 75
    out = log.read_text()
    [saved] = checkpoint_steps(run_dir)
    # what JAX and Orbax log through absl goes to each process's log file in run_dir, not the console
    library_log = "".join(f.read_text() for f in sorted(run_dir.glob("shardtrain*.log")))
    for i in range(2):  # each process reached the same sync point, saved that step and exited 75
        assert re.search(rf"\[process={i}\]\[thread=\w+\] Reached preemption sync point, step={saved}\b",
                         library_log)
        assert re.search(rf"local.sh: process {i} \(pid \d+\) exited with 75 \(preempted", out)
    assert "run preempted: every process saved the same step" in out
    r = train(2, run_dir, *PLAIN, f"train.steps={saved + 2}")
    assert f"resuming from checkpoint step {saved}" in r.stdout
    assert sorted(losses(run_dir)) == [saved + 1, saved + 2]


def test_sigterm_to_the_launcher_is_forwarded_to_every_process(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launcher.log"
    launcher, _ = start_long_run(run_dir, log)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 75
    out = log.read_text()
    assert "local.sh: SIGTERM received: asking every process to save and stop (SIGTERM)" in out
    for i in range(2):
        assert re.search(rf"local.sh: process {i} \(pid \d+\) exited with 75 \(preempted", out)
    assert len(checkpoint_steps(run_dir)) == 1


def test_killed_process_stops_the_others_and_the_launcher_names_it(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launcher.log"
    launcher, pid = start_long_run(run_dir, log)
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    code = launcher.wait(timeout=120)
    elapsed = time.time() - killed
    out = log.read_text()
    assert code == 137, out[-3000:]
    assert elapsed < 10 + 15, f"the survivor took {elapsed:.0f} s to stop (heartbeat timeout 10 s)"
    assert f"local.sh: process 1 (pid {pid}) was killed by SIGKILL" in out
    assert "local.sh: run failed: process 1 failed first: it was killed by SIGKILL (exit 137)" in out
    # Process 0 stopped by itself (the launcher did not have to kill it), with a clear reason:
    # a failed collective (exit 69) or JAX's heartbeat abort (134).
    assert "killing them" not in out
    assert (re.search(r"local.sh: process 0 \(pid \d+\) exited with 69 \(lost contact", out)
            and "shardtrain[process 0/2]: error: a collective with another process failed" in out) or \
        ("aborted (SIGABRT, exit 134" in out and "stops sending heartbeats" in out), out[-3000:]


def test_errors_are_logged_with_the_process_index(tmp_path):
    """A mistake found after joining (here: a mesh of 16 devices on 8) is reported by every process."""
    r = subprocess.run(command(2, tmp_path / "run", "mesh.data=4"), cwd=REPO, env=env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    for i in range(2):
        assert f"shardtrain[process {i}/2]: error: mesh (data=4" in r.stderr
        assert re.search(rf"local.sh: process {i} \(pid \d+\) exited with 2", r.stderr)
    assert "needs 16 devices but 8 are present" in r.stderr


LEAVE = """
import sys, time
from shardtrain.runtime import distributed
cluster = distributed.initialize()
time.sleep(float(sys.argv[1]))
print("leaving", time.time(), flush=True)
cluster.leave_after_error(3, wait_for_peers_s=float(sys.argv[2]))
"""


def leave_after_error(delays: tuple[float, float], wait_for_peers_s: float) -> tuple[float, list]:
    """2 processes joined on this machine call leave_after_error after `delays` seconds each; returns
    the time process 0 ended and when each began to leave (None: process 1 did not get there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = {"SHARDTRAIN_COORDINATOR": f"127.0.0.1:{port}", "SHARDTRAIN_NUM_PROCESSES": "2",
               "XLA_FLAGS": f"{conftest.FAST_COMPILE} --xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, "-c", LEAVE, str(delay), str(wait_for_peers_s)], cwd=REPO,
                              env={**env(), **cluster, "SHARDTRAIN_PROCESS_ID": str(i)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for i, delay in enumerate(delays)]
    try:
        left_0 = float(procs[0].stdout.readline().split()[1])
        assert procs[0].wait(timeout=120) == 3
        ended = time.time()
        line_1 = procs[1].stdout.readline()  # none when process 0 ended first (then process 1 aborts)
        return ended, [left_0, float(line_1.split()[1]) if line_1 else None]
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_leaving_after_an_error_waits_for_peers_at_a_barrier_with_a_timeout():
    """A process that leaves after a config error waits for its peers (so none is cut off before it
    says why), but no longer than wait_for_peers_s when a peer never comes."""
    ended, left = leave_after_error((0, 4), wait_for_peers_s=60)
    assert left[1] is not None and left[1] <= ended < left[1] + 20  # released when process 1 came, not by the timeout
    ended, left = leave_after_error((0, 60), wait_for_peers_s=3)
    assert left[0] + 3 <= ended < left[0] + 20  # process 1 never came: gave up after 3 s


def test_killed_two_process_run_on_tokens_resumes_mid_epoch_in_one(tmp_path, capsys):
    """A 2-process run streaming prepared tokens is SIGKILLed (both processes) mid-epoch; one
    process resumes from its last checkpoint, and every step after it has the loss the killed run
    logged for that step: the same batches (sample index -> window), on another process count."""
    from shardtrain import cli
    from shardtrain.data import prepare
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefgh", k=rng.randint(1, 7))) for _ in range(200)]
    (tmp_path / "docs.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 60)))}) + "\n" for _ in range(120)))
    manifest = prepare.prepare([str(tmp_path / "docs.jsonl")], prepare.Options("bytes", str(tmp_path / "ds")),
                               say=lambda _: None)
    tokens = ["data.source=tokens", f"data.path={tmp_path / 'ds'}", "model.vocab_size=264",
              "checkpoint.every_steps=5"]
    steps_per_epoch = manifest["splits"]["train"]["tokens"] // 17 // 8  # windows of seq_len 16 + 1, batch 8
    run_dir, log = tmp_path / "run", tmp_path / "launcher.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(command(2, run_dir, *PLAIN, *tokens, "train.steps=100000"), cwd=REPO,
                                    env=env(), text=True, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 300

    def past_a_checkpoint():  # a step logged after the first (asynchronous) checkpoint is complete
        done = (run_dir / "checkpoints").is_dir() and checkpoint_steps(run_dir)
        try:
            return done and max(losses(run_dir)) > done[-1]
        except ValueError:  # a line being written
            return False
    while not past_a_checkpoint():
        assert launcher.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    for pid in re.findall(r"local.sh: process \d of 2: pid (\d+)", log.read_text()):
        os.kill(int(pid), signal.SIGKILL)
    launcher.wait(timeout=60)
    killed = losses(run_dir)
    saved = checkpoint_steps(run_dir)[-1]
    assert saved < max(killed) < steps_per_epoch, (saved, sorted(killed), steps_per_epoch)  # mid-epoch

    with pytest.raises(SystemExit) as e:  # in this process (8 devices): no second start-up
        cli.main(["train", str(REPO / "meshes/demo.yaml"), f"run_dir={run_dir}", *TINY, *PLAIN, *tokens,
                  f"train.steps={max(killed)}"])
    assert e.value.code == 0 and f"resuming from checkpoint step {saved}" in capsys.readouterr().out
    assert_close(losses(run_dir), killed, range(saved + 1, max(killed) + 1))


def test_export_hf_from_two_processes_writes_the_same_tensors(tmp_path):
    """export-hf run on 2 processes (fsdp=8 spreads every tensor over both): process 0 alone
    writes, the tensors gathered across processes; import -> export stays bit-exact."""
    from shardtrain import weights
    from shardtrain.hf import safetensors_io
    from shardtrain.hf.io import safetensors_files
    fixture = REPO / "tests" / "fixtures" / "hf" / "qwen2"
    imported, out = tmp_path / "imported", tmp_path / "exported"
    cli = [sys.executable, "-m", "shardtrain.cli"]
    weights.import_hf(str(fixture), str(imported), say=lambda _: None)  # one process: its checkpoint at step 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = {"SHARDTRAIN_COORDINATOR": f"127.0.0.1:{port}", "SHARDTRAIN_NUM_PROCESSES": "2",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = [subprocess.Popen([*cli, "export-hf", str(imported), str(out)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env(), **cluster, "SHARDTRAIN_PROCESS_ID": str(i)}) for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert "exported" in logs[0] and "exported" not in logs[1]
    a = safetensors_io.Reader(safetensors_files(out))
    b = safetensors_io.Reader(safetensors_files(fixture))
    assert sorted(a.names()) == sorted(b.names()) and all(np.array_equal(a.get(n), b.get(n)) for n in b.names())


def test_restarts_survive_a_hang_and_a_lost_local_copy_with_exact_losses(one_process, tmp_path):
    """One supervised 2-process run (local tier every 2 steps, persistent every 3) meets two faults:
    process 0 hangs in step 3 -> the watchdogs write stacks and exit 70, local.sh restarts, the job
    resumes from the local tier (step 2); process 1 dies in step 5 with its local copy (a host that
    does not come back) -> the restart falls back to the persistent tier (step 3), though process 0
    still holds local step 4. The losses are the uninterrupted run's; goodput adds up, with the
    redone steps and the restart gaps."""
    run_dir = tmp_path / "run"
    tiers = [f"checkpoint.local.directory={tmp_path / 'local'}", "checkpoint.local.every_steps=2"]
    watchdog = ["train.watchdog.startup_s=60", "train.watchdog.hang_min_s=10"]
    r = subprocess.run(["launch/local.sh", "--restarts", "2", "2", "meshes/demo.yaml", f"run_dir={run_dir}", *TINY,
                        *PLAIN, "train.steps=6", *tiers, *watchdog], cwd=REPO, capture_output=True, text=True,
                       env={**env(), "SHARDTRAIN_FAULT": "hang@3,lose@5"}, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "exited with 70 (hung" in out and "local.sh: restart 2 of 2" in out
    assert "Thread" in "".join(p.read_text() for p in run_dir.glob("hang-process*.txt"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [(e["step"], e["tier"]) for e in rows if e.get("event") == "resume"] == [(2, "local"), (3, "persistent")]
    assert "local checkpoint step 4 is not held whole by every process" in out
    assert_close({e["step"]: e["loss"] for e in rows if "loss" in e}, losses(one_process), range(1, 7))
    from shardtrain.runtime import goodput
    report = goodput.report(run_dir)
    assert report["starts"] == 3 and sum(report["categories"].values()) == pytest.approx(report["wall_s"])
    assert report["categories"]["redone_steps"] > 0 and report["categories"]["restart_gap"] > 0
    assert any(e.get("event") == "goodput" for e in rows)
