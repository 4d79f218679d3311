"""`shardtrain ckpt RUN_DIR`: the step folders on disk, committed or half-written, and where they are."""

import json

import pytest

from shardtrain import config
from shardtrain.checkpoint import listing


def test_list_shows_uncommitted_steps_and_the_custom_directory(tmp_path, capsys):
    run, ckpts = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (run / "config.yaml").write_text(f"checkpoint:\n  directory: {ckpts}\n")
    (ckpts / "4" / "meta").mkdir(parents=True)
    (ckpts / "4" / "commit_success.txt").write_text("ok")
    (ckpts / "4" / "meta" / "metadata").write_text(json.dumps(
        {"mesh": {"data": 1, "pipeline": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}, "devices": 8,
         "processes": 2}))
    (ckpts / "6.orbax-checkpoint-tmp").mkdir()
    (ckpts / "6.orbax-checkpoint-tmp" / "x").write_bytes(b"0" * 500_000)
    assert listing.list_main(str(run)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"checkpoints in {ckpts}"
    assert out[2].split()[:9] == ["4", "committed", "0.00", "MB", "fsdp=8", "(8", "devices,", "2", "processes);"]
    assert out[2].endswith("no checksums (written before shardtrain recorded them)")  # no checksums.json
    assert out[3].split()[:4] == ["6", "uncommitted", "0.50", "MB"] and "half-written" in out[3]


def test_list_of_missing_run_dir_is_a_config_error(tmp_path):
    with pytest.raises(config.ConfigError, match="does not exist"):
        listing.list_main(str(tmp_path / "nope"))
    (tmp_path / "run").mkdir()
    assert listing.list_main(str(tmp_path / "run")) == 0


def test_verify_calls_a_step_without_arrays_damaged_even_without_checksums(tmp_path, capsys):
    """A committed step that holds only its meta (a second trainer's leftovers) is what restore
    cannot read: --verify says so (exit 1) although the step has no checksums to compare."""
    step = tmp_path / "run" / "checkpoints" / "4"
    (step / "meta").mkdir(parents=True)
    (step / "commit_success.txt").write_text("ok")
    (step / "meta" / "metadata").write_text("{}")
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    assert listing.verify_main(str(tmp_path / "run")) == 1
    out = capsys.readouterr().out
    assert f"step 4: damaged: {step}/state/_METADATA is missing" in out, out
