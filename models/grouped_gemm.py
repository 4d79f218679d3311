"""The MoE experts' grouped matmul on NVIDIA GPUs: jax's own Mosaic GPU kernels
(`jax.experimental.pallas.ops.gpu`) instead of XLA:GPU's lowering of `jax.lax.ragged_dot`, which is a
dense dot over every group (E times the grouped FLOPs).

    y  = x @ w[group]      ragged_dot_mgpu.ragged_dot(x, w)                      (rows, N)
    dx = g @ w[group]^T    ragged_dot_mgpu.ragged_dot(g, w, transpose_rhs=True)   (rows, K)
    dw = x_e^T @ g_e       transposed_ragged_dot_mgpu.transposed_ragged_dot(x, g) (E, K, N)

Rows are sorted by group (group_e rows each) with padding after the last group. The kernels leave
what no group covers unwritten (the padding rows of y and dx, the dw of an empty group): those
are zeroed here. The kernels are Hopper warpgroup (wgmma) kernels in 16-bit types; other dtypes,
and every other backend, take `jax.lax.ragged_dot`. `reference=True` runs the same custom_vjp with
`ragged_dot` products in place of the kernels (for CPU tests of the rule).

The planner counts the kernels' FLOPs from the custom calls' shapes (named scope `grouped_gemm`,
plan/hlo/cost.py): every row of the static buffer, as the forward kernel computes them.
"""

from __future__ import annotations

import contextlib
import functools
import types
from unittest import mock

import jax
import jax.numpy as jnp

SCOPE = "grouped_gemm"
BLOCKS = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 8}
ROW_MULTIPLE = BLOCKS["block_m"]  # rows of a buffer the kernels take (their memory tiles need multiples of 8)
H100_SMS = 132  # what ragged_dot_mgpu assumes; transposed_ragged_dot_mgpu asks the first device


def supported(x_rd, w_edf) -> bool:
    """Whether the kernels take these operands (16-bit, dimensions in whole blocks)."""
    k, n = w_edf.shape[1:]
    return (x_rd.dtype in (jnp.bfloat16, jnp.float16) and k % BLOCKS["block_m"] == 0
            and n % BLOCKS["block_n"] == 0 and k % BLOCKS["block_k"] == 0 and n % BLOCKS["block_k"] == 0)


@contextlib.contextmanager
def _compile_only_devices():
    """transposed_ragged_dot sizes its grid by `jax.devices()[0].core_count`: where no GPU is
    present (planning for compile-only GPUs), it sees an H100's SMs."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as module
    if jax.default_backend() == "gpu":
        yield
        return
    with mock.patch.object(module, "jax", _JaxOfAnH100()):
        yield


class _JaxOfAnH100:
    """`jax`, but for `devices()`: one device with an H100's SMs."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def devices():
        return [types.SimpleNamespace(core_count=H100_SMS)]


def _kernel_product(kind: str, a, b, group_e):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    with jax.named_scope(f"{SCOPE}_{kind}"):
        if kind == "dw":
            with _compile_only_devices():
                return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=group_e, **BLOCKS)
        return ragged_dot_mgpu.ragged_dot(a, b, group_sizes=group_e, transpose_rhs=kind == "dx", **BLOCKS)


def _reference_product(kind: str, a, b, group_e):
    if kind == "dw":
        dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(a, b, group_e, dims)
    return jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2) if kind == "dx" else b, group_e)


def _product(reference: bool, kind: str, a, b, group_e):
    """One of the three products, with what the kernels leave unwritten zeroed."""
    out = (_reference_product if reference else _kernel_product)(kind, a, b, group_e)
    if kind == "dw":
        return jnp.where((group_e > 0)[:, None, None], out, 0)
    return jnp.where((jnp.arange(out.shape[0]) < group_e.sum())[:, None], out, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(x_rd, w_edf, group_e, reference: bool = False):
    """x_rd's rows (sorted by group, group_e rows each, padding last) times their group's w_edf,
    by the GPU kernels (module docstring); padding rows give zeros."""
    return _product(reference, "y", x_rd, w_edf.astype(x_rd.dtype), group_e)


def _gmm_fwd(x_rd, w_edf, group_e, reference):
    return gmm(x_rd, w_edf, group_e, reference), (x_rd, w_edf, group_e)


def _gmm_bwd(reference, res, g_rn):
    x_rd, w_edf, group_e = res
    g_rn = g_rn.astype(x_rd.dtype)
    g_x = _product(reference, "dx", g_rn, w_edf.astype(x_rd.dtype), group_e)
    g_w = _product(reference, "dw", x_rd, g_rn, group_e)
    return g_x, g_w.astype(w_edf.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
