"""The GPU grouped matmul's custom_vjp (models/grouped_gemm.py) in reference mode against
`jax.lax.ragged_dot` and its autodiff gradients, and the MoE taking it under every quantization; its
compile for an H100 is in tests/plan/test_plan_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import grouped_gemm, moe

GROUPS = {"ragged": [3, 0, 5, 2], "empty": [0, 0, 0, 0], "full": [4, 4, 1, 3]}  # of 12 rows


@pytest.mark.parametrize("groups", GROUPS)
def test_grouped_gemm_results_and_gradients_equal_ragged_dot(groups):
    """y, dx and dw of the kernels' rule (reference products) = ragged_dot's and its autodiff's, for
    groups with padding rows after them, all empty, and filling every row; padding rows give zero."""
    group_e = jnp.array(GROUPS[groups], jnp.int32)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x_rd, w_edf = jax.random.normal(kx, (12, 8)), jax.random.normal(kw, (4, 8, 16))
    g_rf = jax.random.normal(kg, (12, 16))
    y, vjp = jax.vjp(lambda x, w: grouped_gemm.gmm(x, w, group_e, True), x_rd, w_edf)
    y_ref, vjp_ref = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_e), x_rd, w_edf)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    for got, want in zip(vjp(g_rf), vjp_ref(g_rf)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.any(np.asarray(y)[int(group_e.sum()):])
    if groups == "empty":
        assert not np.any(np.asarray(vjp(g_rf)[1]))


def test_grouped_gemm_takes_only_16_bit_operands_in_whole_blocks():
    bf16 = jnp.bfloat16
    assert grouped_gemm.supported(jnp.zeros((8, 256), bf16), jnp.zeros((4, 256, 1408), bf16))
    assert not grouped_gemm.supported(jnp.zeros((8, 256)), jnp.zeros((4, 256, 1408)))  # float32
    assert not grouped_gemm.supported(jnp.zeros((8, 96), bf16), jnp.zeros((4, 96, 128), bf16))


@pytest.mark.parametrize("quantization", ["none", "int8", "fp8"])
def test_on_gpus_the_experts_take_the_16_bit_kernels_under_every_quantization(quantization):
    """No grouped kernel in jax 0.12 takes int8 / fp8 operands for this (ragged_dot_mgpu: one type for
    both operands, the product written in it, no transposed 8-bit wgmma), and XLA:GPU makes a
    quantized `ragged_dot` a dense dot over every group: on GPUs the experts' products, forward and
    backward, are the bf16 kernels; elsewhere the quantized `ragged_dot`."""
    x_rd, w_edf = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((2, 128, 256), jnp.bfloat16)
    group_e = jnp.array([100, 100], jnp.int32)

    def program(platform):
        loss = lambda x, w: moe.grouped(x, w, group_e, quantization, platform).astype(jnp.float32).sum()  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x_rd, w_edf))
    gpu, other = program("gpu"), program(None)
    assert "wgmma" in gpu and "ragged_dot" not in gpu and not any(t in gpu for t in ("f8_", "i8["))
    assert other.count("ragged_dot_general") == 3
    assert any(t in other for t in ("f8_", "i8[")) == (quantization != "none")
