"""Group relative policy optimisation (train.objective=grpo) with on-policy sampling on the mesh.

One step of a batch of train.global_batch_size rows, global_batch_size / G prompts each repeated
G = grpo.group_size times (data/prompts.py):
  1. sample: the KV-cache generator (generate.py) continues every row from the current
     parameters on the training mesh (temperature, top-p, at most max_new_tokens, stopping at EOS),
     with the key of (train.seed, step): a resumed run draws the same completions;
  2. score: the user's reward function(row, text, ids) -> float for each completion (host);
  3. advantages: A = (r - mean of its group) / (std of its group + ADV_EPS) (std over the G,
     ddof 0), the same for every token of the completion;
  4. update (jitted, `make_step`): grpo.epochs_per_batch optimizer updates on the batch of
     prompt + completion rows, each minimising per completion token t (completion mean, then
     batch mean)
        -min(rho_t A, clip(rho_t, 1 - clip, 1 + clip) A) + kl_coef (e^(ref_t - logp_t) - (ref_t - logp_t) - 1)
     with rho_t = e^(logp_t - old_t), `old` the log-probs of the parameters that sampled (taken at
     the step's start) and `ref` the frozen starting weights' (dpo.py holds them: state entry
     `reference`, or LoRA's base). The KL term is the k3 estimator of KL(policy || reference).
Logged: loss, kl, clip_fraction (completion tokens whose ratio was clipped), reward_mean,
reward_std, completion_len; every log step run_dir/samples.jsonl gets the first group's
completions with their rewards. Generation and scoring count as `generation` in goodput.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardtrain import dpo, generate
from shardtrain.config import ConfigError, GrpoConfig, RunConfig

ADV_EPS = 1e-4
"""Added to a group's reward std: a group of equal rewards gets advantages 0."""
SAMPLE_SEED = 1_000_003
"""Step s of seed k samples with the key of k * SAMPLE_SEED + s."""


def load_reward(spec: str) -> Callable:
    """The function of grpo.reward `path/to/file.py:function`; ConfigError naming what is missing."""
    path, _, name = spec.rpartition(":")
    if not Path(path).is_file():
        raise ConfigError(f"grpo.reward: no file {path} (give path/to/file.py:function)")
    module_spec = importlib.util.spec_from_file_location(f"shardtrain_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"grpo.reward: {path} defines no function {name!r}")
    return fn


def advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """Rewards (B,) in consecutive groups of `group` -> advantages normalised within each group."""
    r = rewards.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + ADV_EPS)).reshape(-1)


def clipped_objective(g: GrpoConfig, logp, old, ref, adv, w):
    """(loss, kl, clip fraction) of per-token log-probs (B, T): policy, sampling policy, reference
    (None: no KL term), advantages and the completion mask (see the module docstring)."""
    ratio = jnp.exp(logp - old)
    clipped = jnp.clip(ratio, 1 - g.clip, 1 + g.clip)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(logp) if ref is None else jnp.exp(ref - logp) - (ref - logp) - 1
    n = jnp.maximum(w.sum(-1), 1.0)
    completion_mean = lambda x: ((x * w).sum(-1) / n).mean()  # noqa: E731
    was_clipped = ((ratio < 1 - g.clip) & (adv < 0)) | ((ratio > 1 + g.clip) & (adv > 0))
    return (completion_mean(per_token + g.kl_coef * kl), completion_mean(kl),
            (was_clipped * w).sum() / jnp.maximum(w.sum(), 1.0))


def make_step(cfg: RunConfig, token_logps: Callable, update: Callable) -> Callable:
    """(state, batch {tokens, mask, advantages}, each (B, T+1)) -> (state, metrics): the jitted part,
    grpo.epochs_per_batch optimizer updates; the state's step advances by one."""
    g = cfg.grpo

    def loss(params, old, ref, batch):
        logp, aux = token_logps(params, batch["tokens"])
        value, kl, clip_fraction = clipped_objective(g, logp, old, ref, batch["advantages"][:, 1:],
                                                     batch["mask"][:, 1:].astype(jnp.float32))
        values = {"loss": value, **aux, "kl": kl, "clip_fraction": clip_fraction}
        return value + sum(v for k, v in aux.items() if jnp.ndim(v) == 0), values

    def step(state, batch):
        old = jax.lax.stop_gradient(token_logps(state["params"], batch["tokens"])[0])
        reference = dpo.reference_of(cfg, state)
        ref = None if reference is None else jax.lax.stop_gradient(
            token_logps(jax.lax.stop_gradient(reference), batch["tokens"])[0])
        first = state["step"]
        for _ in range(g.epochs_per_batch):
            grads, values = jax.grad(loss, has_aux=True)(state["params"], old, ref, batch)
            state, metrics = update({**state, "step": first}, values, grads)
        return state, metrics
    return step


class Sampler:
    """The step the loop runs under train.objective=grpo: sample and score (host), then the
    compiled update. Called with the loader's host batch {tokens, length} of prompts."""

    def __init__(self, prog, compiled, clock, prompts, main: bool):
        self.prog, self.compiled, self.clock, self.prompts = prog, compiled, clock, prompts
        self.reward = load_reward(prog.cfg.grpo.reward)
        self.samples = Path(prog.cfg.run_dir) / "samples.jsonl" if main else None

    def __call__(self, state, batch):
        cfg, g, tok = self.prog.cfg, self.prog.cfg.grpo, self.prompts.tokenizer
        step = int(state["step"]) + 1  # waits for the previous update: its time is a step's, not generation's
        self.clock.charge("step_s")
        prompts = [batch["tokens"][r, :batch["length"][r]].tolist() for r in range(len(batch["length"]))]
        model = nnx.merge(self.prog.layout.graphdef, state["params"])
        gen = generate.Generator(cfg, model, self.prog.mesh, tok, (self.prompts.eos_id,))
        outs = gen.generate(prompts, g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                            seed=(cfg.train.seed * SAMPLE_SEED + step) % 2**31)
        rows = [self.prompts.row(int(d)) for d in batch["index"]]
        texts = [tok.decode([t for t in ids if t != self.prompts.eos_id]) for ids in outs]
        rewards = np.array([self.score(row, text, ids) for row, text, ids in zip(rows, texts, outs)], np.float32)
        self.clock.charge("generation")
        train = self.training_batch(prompts, outs, advantages(rewards, g.group_size))
        state, metrics = self.compiled(state, self.prog.device_batch(train))
        if self.samples is not None and step % cfg.train.log_every == 0:
            with self.samples.open("a") as f:
                for row, text, r in list(zip(rows, texts, rewards))[:g.group_size]:
                    f.write(json.dumps({"step": step, **row, "completion": text, "reward": float(r)}) + "\n")
        return state, {**metrics, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                       "completion_len": float(np.mean([len(o) for o in outs]))}

    def score(self, row: dict, text: str, ids: list[int]) -> float:
        try:
            return float(self.reward(row, text, ids))
        except Exception as e:  # the user's code: say whose
            raise ConfigError(f"grpo.reward {self.prog.cfg.grpo.reward} failed on a completion: "
                              f"{type(e).__name__}: {e}") from None

    def training_batch(self, prompts: list, outs: list, adv_b: np.ndarray) -> dict:
        """Rows prompt + completion from position 0, zero-padded; mask 1 on the completion."""
        b, width = len(prompts), self.prog.cfg.data.seq_len + 1
        tokens, mask = np.zeros((b, width), np.int32), np.zeros((b, width), np.int32)
        for r, (p, o) in enumerate(zip(prompts, outs)):
            tokens[r, :len(p) + len(o)], mask[r, len(p):len(p) + len(o)] = p + o, 1
        return {"tokens": tokens, "mask": mask,
                "advantages": np.broadcast_to(adv_b[:, None], (b, width)).astype(np.float32)}
