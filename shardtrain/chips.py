"""Accelerator figures used for MFU and the planner's roofline (per chip, dense bf16). A leaf: it imports
nothing from shardtrain, and the config (hardware.chip), the metrics (MFU) and the planner read it.

Sources (vendor spec sheets, retrieved 2026):
  TPU v4:  cloud.google.com/tpu/docs/v4       275 TFLOP/s, 32 GiB HBM2 at 1200 GB/s, ICI 6 x 50 GB/s
  TPU v5e: cloud.google.com/tpu/docs/v5e      197 TFLOP/s, 16 GiB HBM2 at 819 GB/s, ICI 1600 Gbit/s = 200 GB/s
  TPU v5p: cloud.google.com/tpu/docs/v5p      459 TFLOP/s, 95 GiB HBM2e at 2765 GB/s, ICI 4800 Gbit/s = 600 GB/s
  TPU v6e: cloud.google.com/tpu/docs/v6e      918 TFLOP/s, 32 GiB HBM at 1640 GB/s, ICI 3584 Gbit/s = 448 GB/s
  TPU7x:   cloud.google.com/tpu/docs/tpu7x    2307 TFLOP/s (fp8 4614), 192 GiB HBM at 7380 GB/s, ICI 1200 GB/s both
           directions = 600 GB/s, DCN 100 Gbit/s; two TensorCores per chip, which jax shows as two devices
  A100:    nvidia.com A100 datasheet (SXM 80GB) 312 TFLOP/s, 80 GB at 2039 GB/s, NVLink 600 GB/s
  H100:    nvidia.com H100 datasheet (SXM)    989 TFLOP/s, 80 GB at 3350 GB/s, NVLink 900 GB/s
  H200:    nvidia.com H200 datasheet (SXM)    989 TFLOP/s, 141 GB at 4800 GB/s, NVLink 900 GB/s
  B200:    nvidia.com HGX B200 datasheet       2250 TFLOP/s, 180 GB at 8000 GB/s, NVLink 1800 GB/s
  DCN / inter-node, per chip: a TPU VM host's 200 Gbit/s NIC class (25 GB/s) shared by its chips (4 per
  v4 / v5p host, 8 per v5e / v6e host); DGX A100: one 200 Gbit/s HDR InfiniBand port per GPU (25 GB/s);
  DGX H100 / H200: one 400 Gbit/s NDR port per GPU (50 GB/s). These are the least certain figures here.
  Interconnect figures are one direction: NVLink's 600 / 900 GB/s are both directions together.
  Host link (train.offload's traffic), one direction per chip: A100 PCIe Gen4 x16 32 GB/s, H100 / H200 /
  B200 PCIe Gen5 x16 64 GB/s (the datasheets' 64 / 128 GB/s are both directions); TPUs: Google lists no
  host-link figure, so a PCIe Gen4 x16 link per chip (32 GB/s) is assumed, as uncertain as DCN.
A GPU's `GpuTarget` is what XLA:GPU compiles for (`target_config`): streaming multiprocessors,
compute capability, memory size and bandwidth, L2 and shared memory per SM from the CUDA programming
guide's table for the compute capability and the vendor's architecture whitepapers (A100: Ampere
GA100; H100 / H200: Hopper GH100, and an H200's 143771 MiB and 60 MiB of L2 as its driver reported
them; B200: Blackwell), with the cuDNN and CUDA versions of the tested `jax[cuda12]` wheels.
The `cpu` entry describes the whole host that simulates the devices (the planner divides it among
them): float32 matmul FLOP/s and copy bandwidth as calibrate_cpu() measures them (bench/README.md,
Planner accuracy, records the measurement), and an 8 GiB share of the host's memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
KiB, MiB, GiB = 2 ** 10, 2 ** 20, 2 ** 30
CPU_FLOPS, CPU_BANDWIDTH = 184.6e9, 5.43 * GB


@dataclass(frozen=True)
class GpuTarget:
    """An NVIDIA GPU as XLA:GPU's compiler sees it (a GpuTargetConfigProto), for compiling without one."""
    description: str
    """nvidia-smi's name, which becomes the compile-only devices' device_kind."""
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    l2_bytes: int
    clock_ghz: float
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    cudnn: tuple[int, int] = (9, 8)
    cuda: tuple[int, int] = (12, 9)

    def target_config(self, memory_bandwidth: float) -> str:
        """The GpuTargetConfigProto in text form that jax.experimental.topologies takes."""
        info = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
                "shared_memory_per_core": self.shared_memory_per_sm, "threads_per_core_limit": 2048,
                "core_count": self.sm_count, "fpus_per_core": 128, "block_dim_limit_x": 2 ** 31 - 1,
                "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "memory_bandwidth": int(memory_bandwidth),
                "l2_cache_size": self.l2_bytes, "clock_rate_ghz": self.clock_ghz,
                "device_memory_size": self.memory_bytes,
                "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
                "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
        major, minor = self.compute_capability
        fields = " ".join(f"{k}: {v}" for k, v in info.items())
        return (f"gpu_device_info {{ {fields} cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
                f'platform_name: "CUDA" dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} }} '
                f"runtime_version {{ major: {self.cuda[0]} minor: {self.cuda[1]} }} "
                f'device_description_str: "{self.description}"')


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s per chip."""
    hbm_bytes: float
    hbm_bandwidth: float
    """Bytes/s."""
    ici_bandwidth: float
    """Bytes/s per chip over the fast interconnect (ICI / NVLink), one direction."""
    dcn_bandwidth: float
    """Bytes/s per chip across hosts / slices."""
    device_kinds: tuple[str, ...] = ()
    """Substrings of jax's `device_kind` that identify this chip."""
    host_shared: bool = False
    """The figures are for a whole host that simulates all devices (the `cpu` entry): the planner
    divides them among the devices."""
    tpu_name: str | None = None
    """libtpu's name of a TPU generation in topology names ("v5e" in "v5e:16x16"); None: not a TPU."""
    gpu: GpuTarget | None = None
    """What XLA:GPU compiles for; None: not an NVIDIA GPU."""
    devices_per_chip: int = 1
    """jax devices one chip shows (TPU7x: its two TensorCores are two devices, each with half the chip's figures)."""
    host_bandwidth: float = 32 * GB
    """Bytes/s per chip between host memory and the chip (PCIe), one direction: train.offload's link."""

    def per_device(self) -> Chip:
        """The figures of one of the chip's devices."""
        n = self.devices_per_chip
        if n == 1:
            return self
        return dataclasses.replace(self, peak_flops=self.peak_flops / n, hbm_bytes=self.hbm_bytes / n,
                                   hbm_bandwidth=self.hbm_bandwidth / n, ici_bandwidth=self.ici_bandwidth / n,
                                   dcn_bandwidth=self.dcn_bandwidth / n, host_bandwidth=self.host_bandwidth / n,
                                   devices_per_chip=1)


CHIPS = {c.name: c for c in [
    Chip("v4", 275e12, 32 * GiB, 1200 * GB, 300 * GB, 25 / 4 * GB, ("TPU v4",), tpu_name="v4"),
    Chip("v5e", 197e12, 16 * GiB, 819 * GB, 200 * GB, 25 / 8 * GB, ("TPU v5 lite", "TPU v5e"), tpu_name="v5e"),
    Chip("v5p", 459e12, 95 * GiB, 2765 * GB, 600 * GB, 25 / 4 * GB, ("TPU v5p", "TPU v5"), tpu_name="v5p"),
    Chip("v6e", 918e12, 32 * GiB, 1640 * GB, 448 * GB, 25 / 8 * GB, ("TPU v6", "TPU v6e"), tpu_name="v6e"),
    Chip("tpu7x", 2307e12, 192 * GiB, 7380 * GB, 600 * GB, 12.5 * GB, ("TPU7x",), tpu_name="tpu7x",
         devices_per_chip=2),
    Chip("a100", 312e12, 80 * GB, 2039 * GB, 300 * GB, 25 * GB, ("A100",), gpu=GpuTarget(
        "NVIDIA A100-SXM4-80GB", (8, 0), 108, 81920 * MiB, 40 * MiB, 1.41, 164 * KiB, 163 * KiB)),
    Chip("h100", 989e12, 80 * GB, 3350 * GB, 450 * GB, 50 * GB, ("H100",), gpu=GpuTarget(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 80994 * MiB, 50 * MiB, 1.98, 228 * KiB, 227 * KiB),
         host_bandwidth=64 * GB),
    Chip("h200", 989e12, 141 * GB, 4800 * GB, 450 * GB, 50 * GB, ("H200",), gpu=GpuTarget(
        "NVIDIA H200", (9, 0), 132, 143771 * MiB, 60 * MiB, 1.98, 228 * KiB, 227 * KiB),
         host_bandwidth=64 * GB),
    Chip("b200", 2250e12, 180 * GB, 8000 * GB, 900 * GB, 50 * GB, ("B200",), gpu=GpuTarget(
        "NVIDIA B200", (10, 0), 148, 180_000_000_000, 126 * MiB, 1.965, 228 * KiB, 227 * KiB),
         host_bandwidth=64 * GB),
    # The whole host, as calibrate_cpu() measured it (bench/README.md); "ICI" is a copy in memory.
    Chip("cpu", CPU_FLOPS, 8 * GiB, CPU_BANDWIDTH, CPU_BANDWIDTH, CPU_BANDWIDTH, (), host_shared=True,
         host_bandwidth=CPU_BANDWIDTH),
]}


LOW_PRECISION_FLOPS = {
    "v5e": {"int8": 394e12}, "v5p": {"int8": 918e12}, "v6e": {"int8": 1836e12}, "tpu7x": {"fp8": 4614e12},
    "a100": {"int8": 624e12}, "h100": {"int8": 1979e12, "fp8": 1979e12}, "h200": {"int8": 1979e12, "fp8": 1979e12},
}
"""Dense peak operations/s per chip of int8 and fp8 matmuls (vendor spec sheets as above: v5e 394,
v5p 918, v6e 1836 int8 TOPS; TPU7x 4614 fp8 TFLOP/s (its page lists no int8 rate); A100 624 int8 TOPS;
H100 / H200 SXM 1979 fp8 TFLOP/s and int8 TOPS, without sparsity). A type a chip does not list runs at
its bf16 peak."""


def operand_kind(dtype: str) -> str:
    """"int8", "fp8" or "bf16" (the rest) for an HLO operand type key of `hlo.matmul_flops_by_dtype`
    ("s8", "f8e4m3fn", "f8e5m2xf8e4m3fn", "bf16"): a matmul runs at a low-precision peak only when
    both operands have that type."""
    types = dtype.split("x")  # no HLO type name has an x
    if all(t in ("s8", "u8") for t in types):
        return "int8"
    if all(t.startswith("f8") for t in types):
        return "fp8"
    return "bf16"


def peak_flops(chip: Chip, dtype: str) -> float:
    """The chip's peak for matmuls whose operands are of HLO type `dtype`."""
    low = LOW_PRECISION_FLOPS.get(chip.name, {}).get(operand_kind(dtype))
    return chip.peak_flops if low is None else low * (chip.peak_flops / CHIPS[chip.name].peak_flops)  # per device


def for_device_kind(kind: str) -> Chip | None:
    """The chip whose device_kind matches (None for CPUs and unknown devices)."""
    for chip in CHIPS.values():
        if any(k.lower() in kind.lower() for k in chip.device_kinds):
            return chip
    return None


def calibrate_cpu(seconds: float = 1.0) -> Chip:
    """A `cpu` entry measured now on this machine: float32 matmul FLOP/s and copy bandwidth of the
    whole host (best of a few repetitions, each about seconds / 4)."""
    import time

    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]

    def best_rate(f, x, work):
        f(x).block_until_ready()
        best, end = 0.0, time.perf_counter() + seconds / 2
        while time.perf_counter() < end or best == 0.0:
            t0 = time.perf_counter()
            f(x).block_until_ready()
            best = max(best, work / (time.perf_counter() - t0))
        return best

    n = 1024
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    flops = best_rate(jax.jit(lambda x: x @ x), a, 2 * n ** 3)
    v = jax.device_put(jnp.ones((32 * 2 ** 20,), jnp.float32), cpu)  # 128 MiB: past the caches
    bandwidth = best_rate(jax.jit(lambda x: x * 1.0001), v, 2 * v.nbytes)  # read + write
    return Chip("cpu", flops, CHIPS["cpu"].hbm_bytes, bandwidth, bandwidth, bandwidth, (), host_shared=True,
                host_bandwidth=bandwidth)
