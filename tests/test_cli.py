"""The CLI's contract: bad input exits 2 with one message naming the field, no traceback; the
demo trains on real text and writes what a user plots."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from shardtrain import cli

TINY = [*conftest.TINY, "data.source=text", "data.seq_len=32", "train.compile_cache=false"]


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["mesh.data=3"], "mesh (data=3, pipeline=1, fsdp=2, tensor=2) needs 12 devices but 8 are present"),
    (["mesh.data=-1", "mesh.tensor=-1"], "mesh: only one axis may be -1"),
    (["train.stpes=3"], "did you mean 'steps'?"),
    (["train.steps=ten"], "train.steps: expected int, got 'ten'"),
    (["rules.mlp=fsdp"], "mesh axis 'fsdp' is used twice in one PartitionSpec (by logical axes 'mlp' and 'embed')"),
    (["rules.heads=model"], "rules.heads: unknown mesh axis 'model'"),
    (["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8"],
     "parameter blocks/wk_dke (2, 32, 4, 8): dimension 2 ('kv_heads') of size 4 is not divisible by "
     "mesh axes tensor = 8"),
    (["data.path=/nonexistent/*.txt"], "data.path: no files found at '/nonexistent/*.txt'"),
    (["model.name=bert"], "model.name: unknown model 'bert'; known: gpt, mlp"),
])
def test_bad_input_exits_2_with_the_field(capsys, tmp_path, overrides, message):
    code, err = run_cli(capsys, "train", "meshes/demo.yaml", *TINY, *overrides, f"run_dir={tmp_path}")
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_yaml_syntax_error_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: {data: 2\n")
    code, err = run_cli(capsys, "train", str(bad))
    assert code == 2 and "YAML syntax error" in err


@pytest.mark.slow
def test_demo_config_trains_on_text(tmp_path):
    """The shipped demo (GPT, 2x2x2 mesh, stdlib text) through the real command: loss falls,
    and the run dir has metrics.jsonl, TensorBoard events, the resolved config, a plot, a profile."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "shardtrain.cli", "train", "meshes/demo.yaml", "train.steps=24", "train.log_every=2",
         "train.profile_steps=[3, 4]", "train.compile_cache=false", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(2, 25, 2))
    assert {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm", "lr"} <= set(steps[0])
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.5
    assert "done: step 24" in result.stdout
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "name: demo" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert list(Path(run_dir / "profile").rglob("*.xplane.pb"))
