"""The CLI as a new user runs it: from the project directory, with relative paths."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.n_layers=1", "model.d_model=64", "model.d_ff=128", "train.global_batch_size=16",
         "data.seq_len=32", "checkpoint.every_steps=2"]


def shardtrain(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def loss_steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_default_relative_run_dir_trains_saves_finishes_and_continues():
    """Default run_dir (runs/<name>) and a relative checkpoint.directory: the run saves, records
    absolute paths, a rerun of the finished run changes nothing, raising train.steps continues."""
    name = f"fresh-{uuid.uuid4().hex[:8]}"
    run_dir, ckpt_dir = ROOT / "runs" / name, ROOT / "runs" / f"{name}-ckpt"
    args = ["train", "meshes/demo.yaml", f"name={name}", f"checkpoint.directory=runs/{name}-ckpt", *SMALL]
    try:
        first = shardtrain(*args, "train.steps=4")
        assert first.returncode == 0, first.stderr[-2000:]
        assert loss_steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4]
        assert (ckpt_dir / "4" / "commit_success.txt").exists()
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert saved["run_dir"] == str(run_dir) and saved["checkpoint"]["directory"] == str(ckpt_dir)

        def files():  # but run_dir/.lock, which every train takes before it looks at the checkpoints
            return {p: p.stat().st_mtime_ns for p in [*run_dir.rglob("*"), *ckpt_dir.rglob("*")] if p.name != ".lock"}
        before = files()
        again = shardtrain(*args, "train.steps=4")
        assert again.returncode == 0, again.stderr[-2000:]
        assert f"run {run_dir} is complete: checkpoint step 4" in again.stdout
        assert files() == before

        more = shardtrain(*args, "train.steps=6")
        assert more.returncode == 0, more.stderr[-2000:]
        assert "resuming from checkpoint step 4" in more.stdout
        assert loss_steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
        assert (ckpt_dir / "6" / "commit_success.txt").exists()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def test_paths_are_resolved_once_at_load(tmp_path, monkeypatch):
    from shardtrain import config
    monkeypatch.chdir(tmp_path)
    cfg = config.load(None, ["name=x", "checkpoint.directory=ck", "data.path=corpus/*.txt"])
    assert cfg.run_dir == str(tmp_path / "runs" / "x")
    assert cfg.checkpoint.directory == str(tmp_path / "ck") and cfg.data.path == str(tmp_path / "corpus" / "*.txt")
    gcs = config.load(None, ["checkpoint.directory=gs://bucket/ck", f"run_dir={os.path.join('a', 'b')}"])
    assert gcs.checkpoint.directory == "gs://bucket/ck" and gcs.run_dir == str(tmp_path / "a" / "b")
