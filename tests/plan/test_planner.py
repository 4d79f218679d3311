"""`shardtrain plan`: per-device bytes and collectives against analytical values, agreement with
the compiled train step, --search, bad input."""

import functools
import json
import math
import os
import subprocess
import sys

import jax
import pytest

from conftest import TINY
from shardtrain import chips, cli, config, hlo, mesh as mesh_lib, pipeline, plan, search, step

# The core still calls flax/optax APIs that flax 0.12.8 / optax 0.2.8 deprecate (for the core to fix).

SMALL = TINY
MESHES = {"data": (8, 1, 1), "fsdp": (1, 8, 1), "tensor": (2, 1, 4), "combined": (2, 2, 2)}


def small_cfg(model, dft, *extra):
    d, f, t = dft
    return config.load(None, [*SMALL, f"model.name={model}", f"mesh.data={d}", f"mesh.fsdp={f}",
                              f"mesh.tensor={t}", *extra])


@functools.cache
def planned(model: str, mesh_name: str) -> dict:
    cfg = small_cfg(model, MESHES[mesh_name])
    return plan.plan_one(cfg, jax.devices(), chips.CHIPS["v5e"])


def analytical_params(model: str) -> tuple[int, int]:
    """(parameters sharded over fsdp x tensor, replicated norm scales) for the SMALL config:
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
    r = plan.plan_one(cfg, jax.devices(), chips.CHIPS["v5e"])
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
    overrides = [*SMALL, "model.name=gpt", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    cfg = cfg_factory(*overrides)
    assert plan.main(cfg, *plan.target(cfg, 8, chip="h100"), as_json=True) == 0
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
    e = r["estimate"]
    parts = {"compute": e["compute_s"], "memory": e["memory_s"], "communication": e["comm_s"]}
    assert e["bottleneck"] == max(parts, key=parts.get) and e["chip"] == "h100"
    # the roofline reads this compiled program's own figures per device (H100: 989 TFLOP/s, 3.35 TB/s)
    # (never below the model's own FLOPs at peak, so MFU <= 1)
    assert e["compute_s"] == pytest.approx(max(r["flops_per_device"], r["model_flops_per_step"] / 8) / 989e12)
    assert e["memory_s"] == pytest.approx(r["bytes_accessed_per_device"] / 3350e9)
    # the model's own FLOPs count (6N + attention) is what the compiled step computes, less the
    # optimizer's and the softmax's element-wise work
    assert 0.6 * r["flops_per_step"] < r["model_flops_per_step"] < r["flops_per_step"]
    assert r["fits"] and r["margin_bytes"] == 80e9 - m["total"]


def test_loop_iterations_that_cost_analysis_skips_are_added():
    def rolled(w, x):
        return jax.lax.fori_loop(0, 10, lambda i, x: jax.numpy.tanh(x @ w), x)

    def unrolled(w, x):
        for _ in range(10):
            x = jax.numpy.tanh(x @ w)
        return x

    args = (jax.numpy.ones((256, 256)), jax.numpy.ones((64, 256)))
    rolled_c, unrolled_c = (jax.jit(f).lower(*args).compile() for f in (rolled, unrolled))
    cost = {"rolled": rolled_c.cost_analysis(), "unrolled": unrolled_c.cost_analysis()}
    flops, nbytes = hlo.loop_repeats_cost(rolled_c.as_text())
    assert cost["rolled"]["flops"] < cost["unrolled"]["flops"] / 5  # the body counted once
    assert cost["rolled"]["flops"] + flops == pytest.approx(cost["unrolled"]["flops"], rel=1e-3)
    assert cost["rolled"]["bytes accessed"] + nbytes == pytest.approx(cost["unrolled"]["bytes accessed"], rel=0.05)
    assert hlo.loop_repeats_cost(unrolled_c.as_text()) == (0.0, 0.0)


def test_gradient_accumulation_plans_the_flops_of_every_micro_batch():
    one, four = (plan.plan_one(small_cfg("gpt", MESHES["combined"], "train.global_batch_size=32",
                                         f"train.grad_accum_steps={k}"), jax.devices(),
                               chips.CHIPS["v5e"]) for k in (1, 4))
    assert four["loop_repeats_per_device"]["flops"] > 0
    assert four["flops_per_device"] == pytest.approx(one["flops_per_device"], rel=0.03)


def test_plan_pipeline_is_the_schedule_the_trainer_compiles():
    cfg = small_cfg("gpt", (2, 2, 1), "mesh.pipeline=2", "train.global_batch_size=32")
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()))
    compiled, _ = plan.compile_program(prog)
    p = plan.report(prog, compiled, chips.CHIPS["cpu"])["pipeline"]
    # pipeline.py's default: the largest M <= 4 x 2 stages dividing the 32 / (2 x 2) rows per replica
    assert p["microbatches"] == pipeline.microbatches(cfg, prog.mesh) == 8
    # the step runs M + P - 1 schedule iterations: the loop the trainer compiles has that trip count
    trips = {int(n) for n in hlo._TRIP.findall(compiled.as_text())}
    assert p["microbatches"] + p["stages"] - 1 in trips
    assert p["bubble_fraction"] == pytest.approx((p["stages"] - 1) / (p["microbatches"] + p["stages"] - 1))


def test_mfu_stays_within_one_when_the_compiler_counts_fewer_flops_than_the_model():
    # remat=dots recomputes no matmul and the one-hot embedding has no input gradient: with a large
    # vocabulary the compiled FLOPs fall below 6N + attention (meshes/gpu_1x8.yaml read MFU 1.0066 on that)
    cfg = config.load(None, ["model.d_model=256", "model.n_layers=1", "model.d_ff=512", "model.vocab_size=16384",
                             "data.seq_len=16", "train.global_batch_size=32", "data.source=synthetic", "mesh.data=1",
                             "mesh.fsdp=8", "mesh.tensor=1", "train.remat=dots", "model.embed=one_hot"])
    r = plan.plan_one(cfg, jax.devices(), chips.CHIPS["h100"])
    assert r["flops_per_step"] < r["model_flops_per_step"]
    e = r["estimate"]
    assert 0 < e["mfu"] <= 1
    assert e["compute_s"] == pytest.approx(r["model_flops_per_step"] / 8 / 989e12)
    quick = plan.estimate(1.0, 0.0, [], chips.CHIPS["h100"], set(), 8e12, 8)  # a kernel the cost model cannot see
    assert quick["mfu"] == pytest.approx(1.0) and quick["bottleneck"] == "compute"


def test_factorisations_are_complete_and_unique():
    meshes = search.factorisations(8)
    keys = [tuple(m[a] for a in config.MESH_AXES) for m in meshes]
    assert len(keys) == len(set(keys)) == 20  # ordered factorisations of 2^3 into 4 factors: C(6, 3)
    assert all(math.prod(k) == 8 for k in keys)
    with_experts = search.factorisations(8, search.BASE_AXES + ("expert",))
    assert len(with_experts) == 35 and sum(m["expert"] > 1 for m in with_experts) == 15  # C(7, 4); 35 - 20


def test_search_offers_expert_and_context_axes_only_where_the_model_allows():
    dense = config.load(None, ["data.seq_len=128"])
    assert search.search_axes(dense) == search.BASE_AXES
    moe = config.load(None, ["model.n_experts=4", "data.seq_len=4096"])
    assert search.search_axes(moe) == (*search.BASE_AXES, "expert", "context")
    sizes = [m for m in search.factorisations(8, search.search_axes(moe)) if search.allowed(moe, m)]
    assert {m["expert"] for m in sizes} == {1, 2, 4} and {m["context"] for m in sizes} == {1, 2, 4}


def test_unknown_chip_and_unusable_device_count_are_config_errors():
    with pytest.raises(config.ConfigError, match="--chip: unknown chip 'tpu9'; known: v4, v5e"):
        plan.pick_chip("tpu9", jax.devices())
    cfg = small_cfg("mlp", (2, 2, 2))
    with pytest.raises(config.ConfigError, match="needs 8 devices but 4 are present.*--search --devices 4"):
        plan.plan_one(cfg, jax.devices()[:4], chips.CHIPS["v5e"])


def test_model_that_fits_nowhere_says_how_many_devices_would_do():
    cfg = small_cfg("mlp", (1, 1, 1))
    with pytest.raises(config.ConfigError, match=r"would fit on about (\d+) devices \(--devices \1\)"):
        search.search(cfg, jax.devices(), plan.pick_chip("v5e", jax.devices(), memory_limit=1000))


@pytest.mark.slow
def test_search_ranks_every_factorisation_once_and_its_top_row_trains(tmp_path):
    cfg = config.load(None, [*SMALL, "model.name=mlp", f"run_dir={tmp_path / 'run'}"])
    # per-device totals of this MLP are 150-250 KB with fsdp x tensor >= 4, more with data >= 4; data=8
    # holds the whole state (295 KB) and is pruned before compiling
    limit = 250_000
    result = search.search(cfg, jax.devices(), plan.pick_chip("cpu", jax.devices(), memory_limit=limit))
    seen = [(tuple(r["mesh"][a] for a in config.MESH_AXES), r["microbatches"]) for r in result["rows"]]
    seen += [(tuple(r["mesh"][a] for a in config.MESH_AXES), None) for r in result["rejected"]]
    assert len(seen) == len(set(seen))
    assert {s[0] for s in seen} == {tuple(m[a] for a in config.MESH_AXES) for m in search.factorisations(8)}
    plain = [r for r in result["rows"] if r["mesh"]["pipeline"] == 1]
    assert len(plain) == 10  # every pipeline=1 factorisation is valid for this MLP
    assert [r["status"] for r in plain if r["mesh"]["data"] == 8] == ["no fit (state)"]
    assert {tuple(r["mesh"].values()) for r in result["rejected"]} == {  # 2 layers: pipeline <= 2
        tuple(m.values()) for m in search.factorisations(8) if m["pipeline"] > 2}
    fits = [r["report"]["fits"] for r in result["rows"] if r["report"]]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits
    for r in result["rows"]:
        if r["report"]:
            assert r["report"]["fits"] == (r["report"]["memory_per_device_bytes"]["total"] <= limit)
    out = tmp_path / "best.yaml"
    search.write_best(cfg, result, str(out))
    best = config.load(str(out))
    top = result["rows"][0]["mesh"]
    assert {a: getattr(best.mesh, a) for a in config.MESH_AXES} == top and best.name == "best"
    run = subprocess.run([sys.executable, "-m", "shardtrain.cli", "train", str(out), f"run_dir={tmp_path / 'best'}",
                          "train.steps=2", "checkpoint.every_steps=2"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "best" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_plan_a_1b_gpt_on_256_devices(tmp_path):
    overrides = ["model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=16", "model.d_ff=5632",
                 "model.n_layers=20", "data.seq_len=2048", "train.global_batch_size=256", "train.remat=full",
                 "mesh.data=16", "mesh.fsdp=16", "mesh.tensor=1"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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


@pytest.mark.slow
def test_search_entry_point_prints_the_ranking_and_writes_the_top_row(tmp_path, capsys):
    cfg = config.load(None, [*SMALL, "model.name=mlp", f"run_dir={tmp_path / 'run'}"])
    out = tmp_path / "best.yaml"
    assert search.main(cfg, *plan.target(cfg, 2, chip="cpu"), as_json=True, write=str(out)) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["devices"] == 2 and result["chip"] == "cpu"
    meshes = {tuple(r["mesh"][a] for a in config.MESH_AXES) for r in result["rows"]}
    assert meshes == {tuple(m[a] for a in config.MESH_AXES) for m in search.factorisations(2)}
    best = config.load(str(out))
    assert {a: getattr(best.mesh, a) for a in config.MESH_AXES} == result["rows"][0]["mesh"]


@pytest.mark.slow
def test_search_across_slices_tries_each_split_of_the_slices(tmp_path, capsys):
    # two granules (mesh.dcn) of one device each: the slices split over data, pipeline or fsdp
    cfg = config.load(None, [*SMALL, "model.name=mlp", "mesh.dcn.data=2", f"run_dir={tmp_path / 'run'}"])
    out = tmp_path / "best.yaml"
    assert search.main(cfg, *plan.target(cfg, 2, chip="cpu"), as_json=True, write=str(out)) == 0
    result = json.loads(capsys.readouterr().out)
    tried = [r["dcn"] for r in result["rows"]] + [r["dcn"] for r in result["rejected"]]
    assert {tuple(d[a] for a in ("data", "pipeline", "fsdp")) for d in tried} == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}
    assert all(r["mesh"] == dict.fromkeys(config.MESH_AXES, 1) for r in result["rows"])  # one device per slice
    best = config.load(str(out))
    assert {a: getattr(best.mesh.dcn, a) for a in config.MESH_AXES} == result["rows"][0]["dcn"]
    assert "dcn" in search.format_table(result)


def test_cli_bad_input_exits_2_with_the_fix(tmp_path):
    run = subprocess.run([sys.executable, "-m", "shardtrain.cli", "plan", "meshes/demo.yaml", "--devices", "6"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "does not divide the 6 devices" in run.stderr and "--search --devices 6" in run.stderr


def test_search_table_lists_each_rejected_mesh_with_its_reason():
    row = {"mesh": {"data": 8, "pipeline": 1, "fsdp": 1, "tensor": 1}, "microbatches": None, "status": "no fit (state)",
           "state_bytes_per_device": 2 ** 20, "report": None}
    rejected = [{"mesh": {"data": 1, "pipeline": 8, "fsdp": 1, "tensor": 1},
                 "reason": "model.n_layers=2 is not a multiple of 8 stages"},
                {"mesh": {"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 8},
                 "reason": "kv_heads of size 4 is not divisible by tensor = 8"}]
    table = search.format_table({"devices": 8, "chip": "cpu", "memory_limit_bytes": 2 ** 30, "rows": [row],
                                 "rejected": rejected}).splitlines()
    assert "2 factorisations rejected" in table[0]
    assert table[-2].split() == ["1x8x1x1", "model.n_layers=2", "is", "not", "a", "multiple", "of", "8", "stages"]
    assert table[-1].startswith("     1x1x1x8") and table[-1].endswith("not divisible by tensor = 8")


@pytest.mark.parametrize("activations, hint", [(2 ** 20, "train.global_batch_size <= about 16"),
                                               (2 ** 30, "even one sequence per device does not fit")])
def test_no_fit_hint_never_suggests_a_batch_below_one_row_per_device(activations, hint):
    cfg = small_cfg("mlp", (2, 2, 2))  # global batch 8 (SMALL)
    params, opt = 2 ** 20, 2 ** 21
    limit = params + opt + 2 * 2 ** 20  # room for twice the activations of the first case
    report = {"fits": False, "memory_per_device_bytes": {"total": params + opt + activations, "params": params,
                                                          "optimizer": opt}}
    row = search.Row({"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 2}, None, "ranked", report, params + opt)
    message = search.no_fit_message(cfg, [row], 8, limit, chips.CHIPS["v5e"])
    assert hint in message and "about 0" not in message
