"""`shardtrain plan` (plan/planner.py): per-device bytes and collectives against analytical values,
agreement with the compiled train step, the roofline against hand-computed times, bad input."""

import functools
import json
import subprocess
import sys

import jax
import pytest

from conftest import TINY, cli_env
from shardtrain import chips, cli, config, step
from shardtrain.parallel import mesh as mesh_lib, pipeline
from shardtrain.plan import hlo, planner

MESHES = {"data": (8, 1, 1), "fsdp": (1, 8, 1), "tensor": (2, 1, 4), "combined": (2, 2, 2)}


def small_cfg(model, dft, *extra):
    d, f, t = dft
    return config.load(None, [*TINY, f"model.name={model}", f"mesh.data={d}", f"mesh.fsdp={f}",
                              f"mesh.tensor={t}", *extra])


@functools.cache
def planned(model: str, mesh_name: str) -> dict:
    cfg = small_cfg(model, MESHES[mesh_name])
    return planner.plan_one(cfg, jax.devices(), chips.CHIPS["v5e"])


def analytical_params(model: str) -> tuple[int, int]:
    """(parameters sharded over fsdp x tensor, replicated norm scales) for the TINY config:
    every matrix has exactly one 'embed' (fsdp) and one vocab/heads/mlp (tensor) dimension."""
    d, f, v, layers, heads = 32, 64, 256, 2, 4
    if model == "mlp":
        return 2 * v * d + layers * 2 * d * f, 0
    attention = 4 * d * heads * (d // heads)
    return 2 * v * d + layers * (attention + 3 * d * f), 2 * layers * d + d


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_per_device_param_and_optimizer_bytes_are_exact(model, mesh_name):
    r = planned(model, mesh_name)
    _, f, t = MESHES[mesh_name]
    sharded, replicated = analytical_params(model)
    assert r["params"] == {"count": sharded + replicated, "bytes": 4 * (sharded + replicated)}
    m = r["memory_per_device_bytes"]
    assert m["params"] == 4 * (sharded // (f * t) + replicated)
    # AdamW mu and nu like the parameters, plus the int32 counts of Adam and the schedule and the step
    assert m["optimizer"] == 2 * m["params"] + 3 * 4
    d = MESHES[mesh_name][0]
    assert m["batch"] == 8 * 17 * 4 // (d * f)
    assert m["total"] >= m["params"] + m["optimizer"] + m["batch"] + m["temp"]


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_data_parallel_all_reduces_every_gradient_once(model):
    r = planned(model, "data")
    param_bytes = r["params"]["bytes"]
    assert set(r["collectives"]) == {"all-reduce"}
    ar = r["collectives"]["all-reduce"]
    assert ar["axes"] == ["data"]
    assert param_bytes <= ar["bytes"] <= param_bytes + 16  # + the loss and metric scalars
    assert ar["traffic_bytes"] == pytest.approx(ar["bytes"] * 2 * 7 / 8, rel=1e-6)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(model):
    # the CPU compiler writes every gradient's reduce-scatter as all-reduce + slice by the partition
    # id (inside the rolled layer scan too); a one-hot embedding, as a gather from the table adds an all-to-all
    cfg = small_cfg(model, MESHES["fsdp"], "model.embed=one_hot")
    r = planner.plan_one(cfg, jax.devices(), chips.CHIPS["v5e"])
    sharded, replicated = analytical_params(model)
    c = r["collectives"]
    assert {a for row in c.values() for a in row["axes"]} == {"fsdp"}
    # gradients of the sharded weights: reduced and scattered once (CPU: all-reduce + slice)
    assert c["reduce-scatter"]["bytes"] == 4 * sharded
    assert "all-to-all" not in c
    # weights gathered for the forward pass, and again for the backward unless XLA keeps them
    assert 4 * sharded <= c["all-gather"]["bytes"] <= 2 * 4 * sharded
    # the replicated norm scales' gradients (and scalars) are all-reduced
    assert 4 * replicated <= c.get("all-reduce", {"bytes": 0})["bytes"] <= 4 * replicated + 128


def test_plan_json_equals_the_compiled_train_step(cfg_factory, capsys):
    overrides = [*TINY, "model.name=gpt", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    cfg = cfg_factory(*overrides)
    assert planner.main(cfg, *planner.target(cfg, 8, chip="v5p"), as_json=True) == 0  # the CPU standing in
    r = json.loads(capsys.readouterr().out)
    compiled = step.build(cfg, mesh_lib.make_mesh(cfg.mesh)).lower().compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    m = r["memory_per_device_bytes"]
    assert m["params"] + m["optimizer"] + m["batch"] == mem.argument_size_in_bytes
    assert m["temp"] == mem.temp_size_in_bytes
    loop_flops, loop_bytes = hlo.loop_repeats_cost(compiled.as_text())
    assert r["loop_repeats_per_device"] == {"flops": loop_flops, "bytes": loop_bytes}
    assert r["flops_per_device"] == cost["flops"] + loop_flops and r["flops_per_step"] == 8 * r["flops_per_device"]
    assert r["bytes_accessed_per_device"] == cost["bytes accessed"] + loop_bytes
    assert r["collectives"] == hlo.summarize(hlo.collectives(compiled.as_text(), dict(r["mesh"])))
    assert r["devices"] == 8
    assert r["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert r["estimate"]["chip"] == "v5p" and r["compiler"] == "cpu" and "standing in for v5p" in r["compiler_note"]
    # the model's own FLOPs count (6N + attention) is what the compiled step computes, less the
    # optimizer's and the softmax's element-wise work
    assert 0.6 * r["flops_per_step"] < r["model_flops_per_step"] < r["flops_per_step"]
    assert r["fits"] and r["margin_bytes"] == 95 * 2 ** 30 - m["total"]


def test_gradient_accumulation_plans_the_flops_of_every_micro_batch():
    one, four = (planner.plan_one(small_cfg("gpt", MESHES["combined"], "train.global_batch_size=32",
                                            f"train.grad_accum_steps={k}"), jax.devices(),
                                  chips.CHIPS["v5e"]) for k in (1, 4))
    assert four["loop_repeats_per_device"]["flops"] > 0
    assert four["flops_per_device"] == pytest.approx(one["flops_per_device"], rel=0.03)


def test_plan_pipeline_is_the_schedule_the_trainer_compiles():
    cfg = small_cfg("gpt", (2, 2, 1), "mesh.pipeline=2", "train.global_batch_size=32")
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()))
    compiled, _ = planner.compile_program(prog)
    p = planner.report(prog, compiled, chips.CHIPS["cpu"])["pipeline"]
    # pipeline.py's default: the largest M <= 4 x 2 stages dividing the 32 / (2 x 2) rows per replica
    assert p["microbatches"] == pipeline.microbatches(cfg, prog.mesh) == 8
    # the step runs M + P - 1 schedule iterations: the loop the trainer compiles has that trip count
    assert p["microbatches"] + p["stages"] - 1 in hlo.loop_trip_counts(compiled.as_text())
    assert p["bubble_fraction"] == pytest.approx((p["stages"] - 1) / (p["microbatches"] + p["stages"] - 1))


def test_mfu_stays_within_one_when_the_compiler_counts_fewer_flops_than_the_model():
    # remat=dots recomputes no matmul and the one-hot embedding has no input gradient: with a large
    # vocabulary the compiled FLOPs fall below 6N + attention (as in meshes/gpu_1x8.yaml)
    cfg = config.load(None, ["model.d_model=256", "model.n_layers=1", "model.d_ff=512", "model.vocab_size=16384",
                             "data.seq_len=16", "train.global_batch_size=32", "data.source=synthetic", "mesh.data=1",
                             "mesh.fsdp=8", "mesh.tensor=1", "train.remat=dots", "model.embed=one_hot"])
    r = planner.plan_one(cfg, jax.devices(), chips.CHIPS["h100"])
    assert r["flops_per_step"] < r["model_flops_per_step"]
    e = r["estimate"]
    assert 0 < e["mfu"] <= 1
    assert e["compute_s"] == pytest.approx(r["model_flops_per_step"] / 8 / 989e12)
    quick = planner.estimate(1.0, 0.0, [], chips.CHIPS["h100"], set(), 8e12, 8)  # a kernel the cost model cannot see
    assert quick["mfu"] == pytest.approx(1.0) and quick["bottleneck"] == "compute"


def test_roofline_adds_communication_to_the_larger_of_compute_and_memory():
    # per H100: 989 TFLOP/s, 3350 GB/s of HBM, 450 GB/s over NVLink (ICI), 50 GB/s across hosts (DCN)
    h100 = chips.CHIPS["h100"]
    gradients = hlo.Collective("all-reduce", 100e9, 45e9, 2, 8, ("data",))  # 2 x 45 GB of ring traffic
    e = planner.estimate(989e12, 1675e9, [gradients], h100, set(), 4 * 989e12, 8)
    assert (e["compute_s"], e["memory_s"], e["comm_s"]) == pytest.approx((1.0, 0.5, 0.2))
    assert e["step_time_s"] == pytest.approx(1.2) and e["bottleneck"] == "compute"
    assert e["mfu"] == pytest.approx(4 / (1.2 * 8))  # 4 chip-seconds of model FLOPs in 1.2 s on 8 chips
    across_hosts = planner.estimate(989e12, 3 * 3350e9, [gradients], h100, {"data"}, 4 * 989e12, 8)
    assert (across_hosts["memory_s"], across_hosts["comm_s"]) == pytest.approx((3.0, 1.8))
    assert across_hosts["step_time_s"] == pytest.approx(4.8) and across_hosts["bottleneck"] == "memory"
    piped = planner.estimate(989e12, 1675e9, [gradients], h100, set(), 4 * 989e12, 8, idle_fraction=0.2)
    assert (piped["compute_s"], piped["memory_s"]) == pytest.approx((1.25, 0.625))  # an explicit schedule's bubble
    assert piped["step_time_s"] == pytest.approx(1.45)  # waits, at the busiest stage's work per busy slot


def test_each_loop_iterations_collectives_hide_behind_its_own_compute():
    """A layer loop of 4 iterations, each a 2 x 512^3 FLOP matmul and an all-gather over 8 devices,
    and one all-reduce after it: the overlapped step hides min(gather, matmul) per iteration, the
    all-reduce outside the loop stays added, and the serial bound is unchanged."""
    text = """HloModule layers

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[512,512], f32[64,512])) -> (s32[], f32[512,512], f32[64,512]) {
  %p = (s32[], f32[512,512], f32[64,512]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[512,512] get-tuple-element(%p), index=1
  %w = f32[64,512] get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(s32[] %i, s32[] %one)
  %g = f32[512,512] all-gather(f32[64,512] %w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %y = f32[512,512] dot(f32[512,512] %x, f32[512,512] %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[512,512], f32[64,512]) tuple(s32[] %next, f32[512,512] %y, f32[64,512] %w)
}

%cond (p: (s32[], f32[512,512], f32[64,512])) -> pred[] {
  %p = (s32[], f32[512,512], f32[64,512]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (x: f32[512,512], w: f32[64,512]) -> f32[512,512] {
  %x = f32[512,512] parameter(0)
  %w = f32[64,512] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[512,512], f32[64,512]) tuple(s32[] %zero, f32[512,512] %x, f32[64,512] %w)
  %loop = (s32[], f32[512,512], f32[64,512]) while(%init), condition=%cond, body=%body
  %y = f32[512,512] get-tuple-element(%loop), index=1
  ROOT %r = f32[512,512] all-reduce(f32[512,512] %y), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""
    colls = hlo.collectives(text, {"fsdp": 8})
    [body] = hlo.loop_bodies(text).values()
    assert body.runs == 4 and body.flops == 2 * 512 ** 3 + 1  # the matmul and the counter's add
    matmul_s, gather_s = body.flops / 1e12, 2 ** 20 * 7 / 8 / 1e9  # at 1 TFLOP/s and 1 GB/s
    reduce_s = 2 ** 20 * 2 * 7 / 8 / 1e9
    chip = chips.Chip("toy", 1e12, 1e12, 1e15, 1e9, 1e9)
    e = planner.estimate(4 * body.flops, 0.0, colls, chip, set(), 4 * body.flops, 1, {}, hlo.loop_bodies(text))
    assert e["step_time_s"] == pytest.approx(4 * matmul_s + 4 * gather_s + reduce_s)
    assert e["comm_hidden_s"] == pytest.approx(4 * min(matmul_s, gather_s))
    assert e["step_time_overlapped_s"] == pytest.approx(4 * max(matmul_s, gather_s) + reduce_s)


def test_unusable_device_count_is_a_config_error_naming_the_search():
    cfg = small_cfg("mlp", (2, 2, 2))
    with pytest.raises(config.ConfigError, match="needs 8 devices but 4 are present.*--search --devices 4"):
        planner.plan_one(cfg, jax.devices()[:4], chips.CHIPS["v5e"])


@pytest.mark.slow
def test_plan_a_1b_gpt_on_256_devices(tmp_path):
    overrides = ["model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=16", "model.d_ff=5632",
                 "model.n_layers=20", "data.seq_len=2048", "train.global_batch_size=256", "train.remat=full",
                 "mesh.data=16", "mesh.fsdp=16", "mesh.tensor=1"]
    env = cli_env()
    out = subprocess.run([sys.executable, "-m", "shardtrain.cli", "plan", "meshes/demo.yaml", *overrides,
                          "--chip", "v5p", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["devices"] == 256 and 0.95e9 < r["params"]["count"] < 1.1e9
    m = r["memory_per_device_bytes"]
    norms = 4 * (2 * 20 * 2048 + 2048)
    assert m["params"] == (r["params"]["bytes"] - norms) // 16 + norms
    assert m["optimizer"] == 2 * m["params"] + 12
    assert 0 < m["temp"] and m["total"] < 95 * 2 ** 30 and r["fits"]


def test_write_without_search_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "meshes/demo.yaml", "--write", "best.yaml"])
    assert e.value.code == 2 and "--write needs --search" in capsys.readouterr().err


def test_cli_bad_input_exits_2_with_the_fix(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "meshes/demo.yaml", "--devices", "6"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "does not divide the 6 devices" in err and "--search --devices 6" in err


