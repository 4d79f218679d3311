"""`shardtrain plan` for NVIDIA GPUs with XLA:GPU, on compile-only devices (no GPU here; the `gpu`
extra's CUDA plugin): per-GPU argument bytes against the analytical shard bytes, FSDP's collectives,
cuDNN fused attention read from the program, two nodes over DCN, and the one-line errors."""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import TINY
from shardtrain import chips, config, step
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import hlo, planner, topology

pytestmark = pytest.mark.skipif(not topology.cuda_plugin_installed(), reason="the gpu extra is not installed")

D = 512
SMALL = ["model.name=mlp", "model.n_layers=1", f"model.d_model={D}", f"model.d_ff={D}", f"model.vocab_size={D}",
         "data.seq_len=127", "train.global_batch_size=32", "data.source=synthetic"]
PARAM_BYTES = 4 * D * D * 4  # embedding, w_in, w_out, unembed; float32
MESHES = {"data": (8, 1, 1), "fsdp": (1, 8, 1), "tensor": (1, 1, 8)}
H100 = chips.CHIPS["h100"]


@functools.cache
def planned(mesh_name: str) -> dict:
    d, f, t = MESHES[mesh_name]
    cfg = config.load(None, [*SMALL, "hardware.chip=h100", f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}"])
    return planner.plan_one(cfg, *planner.target(cfg, 8))


def test_gpu_plan_compiles_with_xla_gpu_for_the_configs_chip():
    r = planned("fsdp")
    assert r["compiler"] == "gpu" and r["chip"] == "h100" and r["devices"] == 8
    assert r["topology"] == "NVIDIA H100 80GB HBM3, 8 GPUs" and "XLA:GPU" in r["compiler_note"]
    assert r["memory_limit_bytes"] == 80e9 and r["fits"] and 0 < r["estimate"]["mfu"] <= 1


def test_gpu_argument_bytes_are_the_analytical_shard_bytes():
    for name, ways in (("data", 1), ("fsdp", 8), ("tensor", 8)):
        m, args = planned(name)["memory_per_device_bytes"], planned(name)["compiled_memory_bytes"]["arguments"]
        assert m["params"] == PARAM_BYTES // ways
        assert m["batch"] == 32 * 128 * 4 // (1 if name == "tensor" else 8)
        # params and AdamW's two moments, the batch, and three int32 counters (step, Adam's, the schedule's)
        assert args == 3 * m["params"] + m["batch"] + 3 * 4


def test_gpu_fsdp_gathers_weights_and_reduce_scatters_gradients():
    c = planned("fsdp")["collectives"]
    assert {a for row in c.values() for a in row["axes"]} == {"fsdp"}
    # the three matrices' gradients; the embedding's arrives in an all-to-all (its vocab-parallel lookup)
    assert c["reduce-scatter"]["bytes"] == 3 * PARAM_BYTES // 4 and "all-to-all" in c
    assert PARAM_BYTES <= c["all-gather"]["bytes"] <= 2 * PARAM_BYTES
    d = planned("data")["collectives"]
    assert PARAM_BYTES <= d["all-reduce"]["bytes"] <= PARAM_BYTES + 64


def test_cudnn_fused_attention_is_read_from_the_gpu_program():
    cfg = config.load(None, [*TINY, "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=2", "data.seq_len=128",
                             "model.attention=auto", "train.compute_dtype=bfloat16", "mesh.fsdp=8",
                             "hardware.chip=h100"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, planner.target(cfg, 8)[0]))
    compiled, seconds = planner.compile_program(prog)
    assert "__cudnn$fmha" in compiled.as_text()
    r = planner.report(prog, compiled, H100, seconds)
    assert r["attention_kernel"] == "cudnn"
    assert r["flops_per_device"] > 0 and r["bytes_accessed_per_device"] > 0  # from the HLO: no cost analysis


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zero_bubble", marks=pytest.mark.slow),
                                      pytest.param("interleaved_1f1b", marks=pytest.mark.slow)])
def test_cudnn_fused_attention_runs_inside_a_pipeline_schedule(schedule):
    """Inside the pipeline's shard_map (manual over `pipeline`; every schedule's) cuDNN attention runs on each
    device's shards: XLA:GPU's custom partitioner of it cannot read a partly manual sharding (it failed to
    compile)."""
    cfg = config.load(None, [*TINY, "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=2", "data.seq_len=128",
                             "model.n_layers=4", "model.attention=cudnn", "train.compute_dtype=bfloat16",
                             "mesh.fsdp=4", "mesh.pipeline=2", f"train.pipeline.schedule={schedule}",
                             f"train.pipeline.repeats={2 if schedule == 'interleaved_1f1b' else 1}",
                             "train.pipeline.microbatches=2", "hardware.chip=h100"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, planner.target(cfg, 8)[0]))
    compiled, _ = planner.compile_program(prog)
    assert "__cudnn$fmha" in compiled.as_text()


GPT_OSS_LIKE = [*TINY, "model.name=gpt_oss", "model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2",
                "data.seq_len=128", "model.attn_sinks=true", "model.sliding_window=64",
                "model.layer_pattern=[local,global]", "train.compute_dtype=bfloat16", "hardware.chip=h100"]


@pytest.mark.parametrize("parallel", [["mesh.fsdp=4", "mesh.tensor=2"],
                                      pytest.param(["model.n_layers=4", "mesh.fsdp=4", "mesh.pipeline=2",
                                                    "train.pipeline.schedule=1f1b", "train.pipeline.microbatches=2"],
                                                   marks=pytest.mark.slow)],
                         ids=["fsdp_tensor", "pipeline"])
def test_cudnn_attention_with_sinks_compiles_for_h100(parallel):
    """A gpt-oss-like model (sinks, sliding and full layers, GQA) with `auto` attention: cuDNN's fused
    attention forward and backward (sinks by the kernel's logsumexp), with the heads and their sinks
    over `tensor`, and per shard inside a pipeline stage."""
    cfg = config.load(None, [*GPT_OSS_LIKE, *parallel, "model.attention=auto"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, planner.target(cfg, 8)[0]))
    compiled, seconds = planner.compile_program(prog)
    kernels = set(re.findall(r'custom_call_target="__cudnn\$fmha(\w*)"', compiled.as_text()))
    assert {"Softmax", "SoftmaxBackward"} <= kernels or {"ScaleBiasSoftmax", "ScaleBiasSoftmaxBackward"} <= kernels
    assert planner.report(prog, compiled, H100, seconds)["attention_kernel"] == "cudnn"


def test_two_nodes_put_the_dcn_axis_across_nodes_at_inter_node_bandwidth():
    cfg = config.load(None, [*SMALL, "data.seq_len=128", "mesh.fsdp=8", "mesh.dcn.data=2", "hardware.chip=h100"])
    devices, chip = planner.target(cfg, 16, topology_flag="2x8")
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    assert mesh_lib.cross_granule_axes(mesh) == {"data"}
    prog = step.build(cfg, mesh)
    compiled, seconds = planner.compile_program(prog)
    r = planner.report(prog, compiled, chip, seconds)
    assert r["devices"] == 16 and r["dcn_axes"] == ["data"] and "in 2 nodes" in r["topology"]
    colls = hlo.collectives(hlo.parse_module(compiled.as_text()), dict(mesh.shape))
    across = sum(c.traffic_bytes * c.count for c in colls if "data" in c.axes)
    inside = sum(c.traffic_bytes * c.count for c in colls if "data" not in c.axes)
    assert across > 0 and inside > 0
    assert r["estimate"]["comm_s"] == pytest.approx(across / chip.dcn_bandwidth + inside / chip.ici_bandwidth)
    # every byte over NVLink instead would be faster: the node boundary is what costs
    nvlink_only = planner.report(prog, compiled, dataclasses.replace(chip, dcn_bandwidth=chip.ici_bandwidth))
    assert nvlink_only["estimate"]["comm_s"] < r["estimate"]["comm_s"]


def test_gpu_topology_and_attention_mistakes_are_one_line_config_errors():
    with pytest.raises(config.ConfigError, match="model.attention=cudnn: cuDNN's fused attention takes bfloat16"):
        config.load(None, ["model.attention=cudnn", "train.compute_dtype=float32"])
    with pytest.raises(config.ConfigError, match="a GPU topology is NODESxGPUS"):
        config.load(None, ["hardware.chip=h100", "hardware.topology=2x2x2"])
    cfg = config.load(None, ["hardware.chip=h100", "mesh.dcn.data=2"])
    with pytest.raises(config.ConfigError, match=r"mesh.dcn: its product 2 must equal the 1 node\(s\)"):
        planner.target(cfg, 8, topology_flag="1x8")


def test_without_the_cuda_plugin_a_gpu_plan_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(topology, "cuda_plugin_installed", lambda: False)
    with pytest.raises(config.ConfigError, match=r"pip install 'shardtrain\[gpu\]'") as e:
        topology.devices(chips.CHIPS["a100"], "1x3")
    assert "\n" not in str(e.value)


def test_an_installed_cuda_plugin_without_a_gpu_prints_nothing():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "from shardtrain import cli; cli.skip_absent_accelerators(); import jax; print(jax.devices()[0].platform)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "cpu\n" and out.stderr == "", out.stderr[-2000:]


def test_gpu_search_ranks_the_splits_of_the_nodes_with_xla_gpu(tmp_path, capsys):
    from shardtrain.plan import search
    cfg = config.load(None, [*TINY, "model.name=mlp", "mesh.dcn.data=2", "hardware.chip=h100",
                             f"run_dir={tmp_path / 'run'}"])
    assert search.main(cfg, *planner.target(cfg, 2, topology_flag="2x1"), as_json=True, meshes=0) == 0  # all
    result = json.loads(capsys.readouterr().out)
    tried = [r["dcn"] for r in result["rows"]]
    assert {tuple(d[a] for a in ("data", "pipeline", "fsdp")) for d in tried} == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}
    assert {r["report"]["compiler"] for r in result["rows"]} == {"gpu"}


@pytest.mark.slow
def test_gpu_moe_runs_grouped_gemm_kernels_not_a_dense_dot_over_every_expert():
    """XLA:GPU lowers `ragged_dot` to a dense dot over all 8 experts (8x the grouped FLOPs); the MoE
    layer's three products run jax's Mosaic GPU grouped-GEMM kernels instead, forward (y) and
    backward (dx, dw), and the plan counts their FLOPs: the step's compiled FLOPs stay near the
    model's (remat full: 8/6, and the receive buffer's quarter over balanced routing on the experts).
    Under train.quantization=fp8 (the kernels under every quantization: tests/models/test_grouped_gemm.py):
    the other matmuls are fp8, the MoE's FLOPs the 12 bf16 kernel products (3 matmuls x y, dx, dw, and y
    again under remat), each over the 1280 rows of the receive buffer (1.25 x 512 tokens x 2 experts per GPU)."""
    moe = ["model.name=gpt", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=512", "model.moe.n_experts=8",
           "model.moe.experts_per_token=2", "mesh.expert=8", "mesh.data=1", "train.compute_dtype=bfloat16",
           "train.remat=full", "train.quantization=fp8"]
    cfg = config.load(None, [*SMALL, *moe, "hardware.chip=h100", "model.d_model=256", "data.seq_len=256",
                             "train.global_batch_size=16"])
    devices, chip = planner.target(cfg, 8)
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    compiled = planner.compile_fast(prog.lower(), "gpu")
    kinds = re.findall(r'custom_call_target="mosaic_gpu_v2".*op_name="[^"]*grouped_gemm_(y|dx|dw)', compiled.as_text())
    assert sorted(set(kinds)) == ["dw", "dx", "y"], kinds
    r = planner.report(prog, compiled, chip)
    ratio = r["flops_per_device"] * r["devices"] / r["model_flops_per_step"]
    assert 1.3 < ratio < 1.5, ratio  # 2.5 while the overflow rounds' loop counted once
    assert r["moe_flops_by_dtype"] == {"bf16": 12 * 2 * 1280 * 256 * 512} and r["moe_low_precision_share"] == 0
    assert any(k.startswith("f8") for k in r["flops_by_dtype"])
    assert "(0.0% in int8 / fp8; the GPU's grouped-GEMM kernels take 16-bit operands only" in planner.format_report(r)
