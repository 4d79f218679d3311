"""The CLI's contract: bad input exits 2 with one message naming the field, no traceback; the
demo trains on real text and writes what a user plots."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from shardtrain import cli
from shardtrain.config import ConfigError

TINY = [*conftest.TINY, "data.source=text", "data.seq_len=32", "train.compile_cache=false"]


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["mesh.data=3"],
     "mesh (data=3, pipeline=1, fsdp=2, expert=1, context=1, tensor=2) needs 12 devices but 8 are present"),
    (["mesh.data=-1", "mesh.tensor=-1"], "mesh: only one axis may be -1"),
    (["train.stpes=3"], "did you mean 'steps'?"),
    (["train.steps=ten"], "train.steps: expected int, got 'ten'"),
    (["rules.mlp=fsdp"], "mesh axis 'fsdp' is used twice in one PartitionSpec (by logical axes 'mlp' and 'embed')"),
    (["rules.heads=model"], "rules.heads: unknown mesh axis 'model'"),
    (["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8"],
     "parameter blocks/wk_dke (2, 32, 4, 8): dimension 2 ('kv_heads') of size 4 is not divisible by "
     "mesh axes tensor = 8"),
    (["data.path=/nonexistent/*.txt"], "data.path: no files found at '/nonexistent/*.txt'"),
    (["model.name=bert"], "model.name: unknown model 'bert'; known: gpt, mlp, llama, mistral, qwen2"),
    (["mesh.fsdp=1", "mesh.context=2", "data.seq_len=48", "train.loss_chunk=16"],
     "train.loss_chunk=16 must divide the 24 positions of data.seq_len=48 each of the 2 context-parallel devices"),
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
    # no warning a user cannot act on: XLA's resharding of the embedding lookup (rules.vocab=tensor)
    assert "Involuntary full rematerialization" not in result.stderr
    assert "shardtrain: gpt, 1.12M params, all trainable" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(2, 25, 2))
    assert {"step", "loss", "step_time_s", "tokens_per_s", "grad_norm", "lr"} <= set(steps[0])
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.5
    assert "done: step 24" in result.stdout
    assert "data: text bytes (ids 0..255) of " in result.stdout  # every source says what it reads
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "name: demo" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert list(Path(run_dir / "profile").rglob("*.xplane.pb"))


@pytest.mark.parametrize("argv, message", [
    (["train", "meshes/demo.yaml", "train.profile_steps=[12,10]"],
     "train.profile_steps: [12, 10] must be [first, last]"),
    (["train", "meshes/demo.yaml", "optimizer.learning_rate=-1"], "optimizer.learning_rate: must be > 0"),
    (["train", "meshes/demo.yaml", "optimizer.name=adam"],
     "optimizer.name: 'adam' is not one of: adamw, adafactor, muon, lion"),
    (["plan", "meshes/demo.yaml", "optimizer.schedule=cos"],
     "optimizer.schedule: 'cos' is not one of: cosine, wsd, constant"),
    (["train", "{tmp}"], "is a directory, not a YAML file"),
    (["train", "{tmp}/empty.yaml"], "config file '{tmp}/empty.yaml' is empty"),
    (["train", "meshes/demo.yaml", "run_dir={tmp}/empty.yaml"], "'{tmp}/empty.yaml' is a file, not a directory"),
    (["train", "meshes/demo.yaml", "run_dir={tmp}/r", "checkpoint.directory={tmp}/empty.yaml/c"],
     "checkpoint.directory={tmp}/empty.yaml/c: '{tmp}/empty.yaml' is a file"),
    (["ckpt", "{tmp}/empty.yaml"], "'{tmp}/empty.yaml' is a file; pass the run directory"),
    (["plan", "meshes/demo.yaml", "--devices", "-8"], "--devices: must be a positive device count"),
    (["plan", "meshes/demo.yaml", "--devices", "0"], "--devices: must be a positive device count"),
    (["train", "meshes/demo.yaml", "train.seed=-1"], "error: train.seed: must be between 0 and 2147483647, got -1"),
    (["train", "meshes/demo.yaml", "model.d_model=0"], "error: model.d_model: must be > 0, got 0"),
    (["train", "meshes/demo.yaml", "train.steps=99999999999999999999999"], "error: train.steps: 9999"),
    (["train", "meshes/demo.yaml", "model.rope_theta=.nan"], "error: model.rope_theta: must be a finite number"),
    (["train", "meshes/demo.yaml", "data.source=tokens", "data.mixture=[{{path: /a, weight: .inf}}]"],
     "error: data.mixture[0].weight: must be a finite number, got inf"),
])
def test_newcomer_mistakes_exit_2_with_one_line_before_training(capsys, tmp_path, argv, message):
    (tmp_path / "empty.yaml").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] == "train" and not any(a.startswith("run_dir=") for a in argv):
        argv.append(f"run_dir={tmp_path / 'run'}")
    code, err = run_cli(capsys, *argv)
    assert code == 2 and message.format(tmp=tmp_path) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.slow
def test_resume_to_more_steps_keeps_the_lr_schedule_and_traces_the_rest_of_a_profile_range(tmp_path, capsys):
    """Raising train.steps on resume keeps the LR schedule recorded at the run's start (the cosine
    is not stretched over the new length: the LR stays at its final value) and says so. A profile
    range that started before the resume point traces the steps still ahead (it used to call
    stop_trace without a trace: `RuntimeError: No profile started`)."""
    from shardtrain import config, loop
    tiny = ["model.name=mlp", "model.d_model=32", "model.n_layers=2", "data.seq_len=16", "data.source=synthetic",
            "train.global_batch_size=8", "train.compile_cache=false", "optimizer.warmup_steps=1",
            f"run_dir={tmp_path}"]
    assert loop.train(config.load("meshes/demo.yaml", [*tiny, "train.steps=2"])) == 0
    assert "lr: linear warmup to 0.003 at step 1, then cosine decay to 0.0003 at step 2" in capsys.readouterr().out
    assert loop.train(config.load("meshes/demo.yaml", [*tiny, "train.steps=4", "train.profile_steps=[1, 3]"])) == 0
    assert "lr from step 2 (0.0003): 0.0003 from step 2 to 4 (the schedule recorded" in capsys.readouterr().out
    lr = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
          if "lr" in r}
    assert lr[1] == 0 and lr[2] == pytest.approx(3e-3) and lr[3] == lr[4] == pytest.approx(3e-4)  # row N: update N
    assert "decay_steps: 2" in (tmp_path / "config.yaml").read_text()  # the resolved schedule is recorded
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))


@pytest.mark.slow
def test_resuming_with_another_optimizer_exits_2_with_one_line_before_compiling(tmp_path, capsys):
    from shardtrain import config, loop
    tiny = ["model.name=mlp", "model.d_model=32", "model.n_layers=2", "data.seq_len=16", "data.source=synthetic",
            "train.global_batch_size=8", "train.compile_cache=false", "train.steps=2", f"run_dir={tmp_path}"]
    assert loop.train(config.load("meshes/demo.yaml", tiny)) == 0
    capsys.readouterr()
    code, err = run_cli(capsys, "train", "meshes/demo.yaml", *tiny, "train.steps=4", "optimizer.name=adafactor")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (f"error: optimizer.name=adafactor: checkpoint step 2 in {tmp_path}/checkpoints holds adamw's optimizer "
            "state; resume with optimizer.name=adamw") in err


def test_resume_refuses_a_new_model_function_before_compiling_and_says_other_changes(tmp_path, capsys):
    """model.activation keeps every shape: the resume used to train on with exit 0 and no line."""
    run = [*conftest.TINY, "optimizer.warmup_steps=1", "train.compile_cache=false", f"run_dir={tmp_path}"]
    assert run_cli(capsys, "train", "meshes/demo.yaml", *run, "train.steps=2")[0] == 0
    before = {f: (tmp_path / f).read_bytes() for f in ("metrics.jsonl", "config.yaml")}
    code, err = run_cli(capsys, "train", "meshes/demo.yaml", *run, "train.steps=3", "model.activation=gelu_tanh")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (f"error: resuming from checkpoint step 2 in {tmp_path}/checkpoints would change the model's function: "
            "model.activation silu -> gelu_tanh; to do it on purpose, allow it (checkpoint.allow_changes="
            "[model.activation]) or start a new run") in err
    assert {f: (tmp_path / f).read_bytes() for f in before} == before  # nothing trained, nothing written
    # what a resume may change is said instead: tests/checkpoint/test_diagnose.py, every kind of change


@pytest.mark.parametrize("overrides, line", [
    ([], "shardtrain: gpt, 37.0K params, all trainable; on 8 cpu devices"),
    (["model.name=llama", "model.lora.rank=2", "model.lora.targets=[q_proj,w_down_fd]"],
     # per layer, rank 2 x (in + out): q 32 + 32 (4 heads of 8), down 64 + 32; 2 layers
     f"shardtrain: llama, 37.7K params, {2 * 2 * (32 + 32 + 64 + 32)} (1.7%) trainable: LoRA rank 2, alpha 16 on "
     "q_proj, w_down_fd (the other 37.0K frozen); on 8 cpu devices"),
])
def test_start_of_a_run_says_what_trains(overrides, line):
    from shardtrain import config, loop, step
    from shardtrain.parallel import mesh as mesh_lib
    cfg = config.load("meshes/demo.yaml", [*TINY, *overrides])
    assert line in loop.model_line(step.build(cfg, mesh_lib.make_mesh(cfg.mesh)))


@pytest.mark.parametrize("overrides, line", [
    ([], "mode: mesh data=2,fsdp=2,tensor=2; remat none; compute float32, params float32; "
         "gradients reduced every step in float32; no pipeline"),
    (["mesh.data=1", "mesh.pipeline=2", "train.remat=full", "train.compute_dtype=bfloat16", "train.grad_accum_steps=2"],
     "mode: mesh pipeline=2,fsdp=2,tensor=2; remat full; compute bfloat16, params float32; "
     "gradients reduced every step in float32; pipeline gpipe, 2 stages, 8 micro-batches; 2 accumulation steps"),
    (["train.comm.sync=local_sgd", "train.comm.sync_every=4"],
     "local SGD over data, sync every 4 steps in float32 (outer lr 1.0, momentum 0.0)"),
    (["train.quantization=int8", "train.compute_dtype=bfloat16"],
     "; remat none; compute bfloat16 with int8 matmuls, params float32; "),
])
def test_start_of_a_run_says_its_mode_in_one_line(overrides, line):
    from shardtrain import config, loop, step
    from shardtrain.parallel import mesh as mesh_lib
    cfg = config.load("meshes/demo.yaml", overrides)
    assert line in loop.mode_line(step.build(cfg, mesh_lib.make_mesh(cfg.mesh)))


def test_a_key_given_twice_on_the_command_line_is_said(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:  # it used to keep the last value silently
        cli.main(["train", "meshes/demo.yaml", "train.steps=3", "train.steps=5", "model.d_model=0",
                  f"run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert e.value.code == 2 and out == "shardtrain: train.steps is given 2 times ('3', then '5'); the last one wins\n"


def test_lora_targets_the_model_lacks_stop_train_before_anything_is_written(tmp_path, capsys):
    code, err = run_cli(capsys, "train", "meshes/demo.yaml", "model.name=llama", "model.lora.rank=2",
                        "model.lora.targets=[q]", f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "model.lora.targets: unknown weight 'q' for this model; choose from wq_dhe" in err
    assert not (tmp_path / "run").exists()


def test_run_dir_that_is_a_file_or_unwritable_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=f"run_dir={tmp_path}/f/run: '{tmp_path}/f' is a file, not a directory"):
        cli.prepare_dir(str(tmp_path / "f" / "run"), "run_dir")
    with pytest.raises(ConfigError, match="run_dir=/proc/shardtrain-run: cannot write there"):
        cli.prepare_dir("/proc/shardtrain-run", "run_dir")
    cli.prepare_dir(str(tmp_path / "new" / "run"), "run_dir")
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
