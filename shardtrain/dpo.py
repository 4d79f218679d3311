"""Direct preference optimisation (train.objective=dpo) and its reference-free variants.

A batch holds B preference pairs (data/preference.py: chosen, chosen_mask, rejected,
rejected_mask, each (B, T+1)). The policy's log-probability of a completion is the sum of its
tokens' (mask 1: the completion and its EOS) next-token log-probabilities; the reference's is the
same sum under the reference weights (`reference`, below), without gradient. From those,
per pair (d = cfg.dpo, l = d.label_smoothing):

  sigmoid  r_c = beta (logp_c - ref_c), r_r = beta (logp_r - ref_r), z = r_c - r_r
           loss = -(1 - l) log sigmoid(z) - l log sigmoid(-z)
  ipo      the same log-ratios per token (divided by the completion's length), h = their difference
           loss = (h - 1 / (2 beta))^2, rewards r = beta x the per-token log-ratios
  simpo    r = beta x logp / length (no reference), z = r_c - r_r - simpo_gamma; loss as sigmoid's

and the step's loss is the mean over pairs. Logged: loss, reward_margin (mean r_c - r_r),
reward_accuracy (fraction with r_c > r_r), chosen_logp and rejected_logp (mean sums). With the
reference equal to the policy (step 1 from checkpoint.init_from), z = 0 and the loss is log 2.

The reference: `dpo.reference=frozen` keeps the starting parameters in the train state entry
`reference` (sharded like `params`, no optimizer state, checkpointed with the rest); under LoRA
it is the policy's own base weights with the adapters' B factors zeroed (no copy). SimPO and
`dpo.reference=none` hold none (log-probs 0).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models import LORA_B
from shardtrain.config import ConfigError, DpoConfig, RunConfig
from shardtrain.loss import cross_entropy


def uses_reference(cfg: RunConfig) -> bool:
    """Whether the objective compares with the frozen starting weights (DPO's reference, GRPO's KL)."""
    if cfg.train.objective == "grpo":
        return cfg.grpo.kl_coef > 0
    return cfg.train.objective == "dpo" and cfg.dpo.reference == "frozen" and cfg.dpo.loss != "simpo"


def holds_reference(cfg: RunConfig) -> bool:
    """Whether the train state carries a `reference` copy of the parameters (frozen, without LoRA)."""
    return uses_reference(cfg) and cfg.model.lora.rank == 0


def adapters_off(params):
    """The parameters with every LoRA adapter's B factor zero: the base model."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.zeros_like(p) if str(getattr(path[-1], "key", path[-1])).endswith(LORA_B) else p, params)


def reference_of(cfg: RunConfig, state: dict):
    """The reference parameters of a train state, or None (reference-free)."""
    if not uses_reference(cfg):
        return None
    return state["reference"] if holds_reference(cfg) else adapters_off(state["params"])


def check(cfg: RunConfig, mesh) -> None:
    """What train.objective=dpo|grpo does not combine with yet: one line each."""
    objective = cfg.train.objective
    if mesh.shape["pipeline"] > 1 or mesh.shape["context"] > 1:
        raise ConfigError(f"train.objective={objective}: mesh.pipeline and mesh.context must be 1 (not supported yet)")
    if cfg.train.grad_accum_steps > 1:
        raise ConfigError(f"train.objective={objective}: train.grad_accum_steps must be 1 (not supported yet)")
    if objective == "grpo" and jax.process_count() > 1:
        raise ConfigError("train.objective=grpo runs in one process (its rewards are scored on one host) for now")


def pair_losses(d: DpoConfig, logp_c, logp_r, ref_c, ref_r, n_c, n_r):
    """(loss, chosen reward, rejected reward), each (B,), of B pairs: the policy's and reference's
    summed completion log-probs and the completions' token counts (see the module docstring)."""
    if d.loss == "sigmoid":
        r_c, r_r = d.beta * (logp_c - ref_c), d.beta * (logp_r - ref_r)
        z = r_c - r_r
    elif d.loss == "ipo":
        h_c, h_r = (logp_c - ref_c) / n_c, (logp_r - ref_r) / n_r
        r_c, r_r = d.beta * h_c, d.beta * h_r
        return (h_c - h_r - 1 / (2 * d.beta)) ** 2, r_c, r_r
    else:  # simpo
        r_c, r_r = d.beta * logp_c / n_c, d.beta * logp_r / n_r
        z = r_c - r_r - d.simpo_gamma
    ls = d.label_smoothing
    return -(1 - ls) * jax.nn.log_sigmoid(z) - ls * jax.nn.log_sigmoid(-z), r_c, r_r


def token_logps_fn(cfg: RunConfig, graphdef, run_blocks: Callable) -> Callable:
    """(params, tokens_bt) -> (log-prob of each next token (B, T-1), the model's auxiliary losses):
    each row one sequence from position 0, padding after it."""
    compute_dtype = jnp.dtype(cfg.train.compute_dtype)

    def token_logps(params, tokens_bt):
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        out = run_blocks(model.blocks, model.embed(tokens_bt[:, :-1]))
        x_btd, aux = out if isinstance(out, tuple) else (out, {})
        return -cross_entropy(model.head(x_btd), tokens_bt[:, 1:]), aux
    return token_logps


def sequence_logps_fn(cfg: RunConfig, graphdef, run_blocks: Callable) -> Callable:
    """(params, tokens_bt, mask_bt) -> (summed log-probs of the masked targets (B,), their count (B,),
    the model's auxiliary losses)."""
    token_logps = token_logps_fn(cfg, graphdef, run_blocks)

    def sequence_logps(params, tokens_bt, mask_bt):
        logp_bt, aux = token_logps(params, tokens_bt)
        weights_bt = mask_bt[:, 1:].astype(jnp.float32)
        return (logp_bt * weights_bt).sum(-1), weights_bt.sum(-1), aux
    return sequence_logps


def loss_fn(cfg: RunConfig, sequence_logps: Callable, constrain) -> Callable:
    """(params, reference or None, batch) -> (objective, logged values): the mean pair loss plus any
    auxiliary loss the model reports. Chosen and rejected go through the model as one (2B, T+1) batch
    with each pair's two rows side by side, so a pair's log-probs meet on its own shard: no collective
    joins them (on XLA:CPU one independent of the forward pass can deadlock the devices' rendezvous)."""
    def interleave(c, r):
        return jnp.stack([c, r], axis=1).reshape(-1, *c.shape[1:])

    def split(v):  # (2B,) -> chosen (B,), rejected (B,)
        pairs = v.reshape(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    def loss(params, reference, batch):
        tokens = constrain(interleave(batch["chosen"], batch["rejected"]), ("batch", None))  # (2B, T+1)
        mask = constrain(interleave(batch["chosen_mask"], batch["rejected_mask"]), ("batch", None))
        logp, n, aux = sequence_logps(params, tokens, mask)
        ref = (jnp.zeros_like(logp) if reference is None else
               jax.lax.stop_gradient(sequence_logps(jax.lax.stop_gradient(reference), tokens, mask)[0]))
        (logp_c, logp_r), (ref_c, ref_r), (n_c, n_r) = split(logp), split(ref), split(n)
        pair_loss, r_c, r_r = pair_losses(cfg.dpo, logp_c, logp_r, ref_c, ref_r,
                                          jnp.maximum(n_c, 1.0), jnp.maximum(n_r, 1.0))
        values = {"loss": pair_loss.mean(), **aux, "reward_margin": (r_c - r_r).mean(),
                  "reward_accuracy": (r_c > r_r).astype(jnp.float32).mean(),
                  "chosen_logp": logp_c.mean(), "rejected_logp": logp_r.mean()}
        return values["loss"] + sum(v for k, v in aux.items() if jnp.ndim(v) == 0), values
    return loss


def make_loss_and_grads(cfg: RunConfig, sequence_logps: Callable, constrain) -> Callable:
    """(params, reference or None, batch) -> (logged values, gradients with respect to params)."""
    grad_fn = jax.grad(loss_fn(cfg, sequence_logps, constrain), has_aux=True)

    def loss_and_grads(params, reference, batch):
        grads, values = grad_fn(params, reference, batch)
        return values, grads
    return loss_and_grads
