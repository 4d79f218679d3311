"""train.objective=grpo: group-normalised advantages and the clipped objective against a NumPy
computation token by token; a run's metrics and samples, and its exact resume (the sampling keys
follow the step)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from prepared_data import run_cli
from shardtrain import config, grpo, step
from shardtrain.data import prepare, prompts, tokenize
from shardtrain.parallel import mesh as mesh_lib, sharding


def test_advantages_are_normalised_within_each_group():
    rewards = np.array([0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 8.0], np.float32)
    got = grpo.advantages(rewards, 4)
    for group in (slice(0, 4), slice(4, 8)):
        r = rewards[group].astype(np.float64)
        want = [(x - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).mean()) + grpo.ADV_EPS) for x in r]
        np.testing.assert_allclose(got[group], want, rtol=1e-6)
    assert not grpo.advantages(np.ones(4, np.float32), 4).any()  # equal rewards teach nothing


def test_clipped_objective_equals_a_token_by_token_computation():
    g = config.load(None, ["grpo.clip=0.2", "grpo.kl_coef=0.3"]).grpo
    rng = np.random.default_rng(0)
    logp, old, ref = (rng.normal(-2, 0.3, (4, 6)) for _ in range(3))
    adv = np.repeat(rng.normal(0, 1, (4, 1)), 6, 1)
    w = (rng.random((4, 6)) < 0.7).astype(np.float64)
    losses, kls, clipped, counted = [], [], 0, 0
    for b in range(4):
        per_token, kl_row = [], []
        for t in range(6):
            if not w[b, t]:
                continue
            ratio = np.exp(logp[b, t] - old[b, t])
            kl = np.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
            unclipped, bounded = ratio * adv[b, t], min(max(ratio, 0.8), 1.2) * adv[b, t]
            per_token.append(-min(unclipped, bounded) + 0.3 * kl)
            kl_row.append(kl)
            clipped, counted = clipped + (bounded < unclipped), counted + 1
        losses.append(np.mean(per_token) if per_token else 0.0)
        kls.append(np.mean(kl_row) if kl_row else 0.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = grpo.clipped_objective(g, *map(f32, (logp, old, ref, adv, w)))
    np.testing.assert_allclose([float(x) for x in got], [np.mean(losses), np.mean(kls), clipped / counted], rtol=1e-5)
    assert 0 < clipped < counted


@pytest.mark.slow
def test_grpo_learns_a_toy_reward_and_resumes_exactly(tmp_path, capsys):
    """The reward (the fraction of completion tokens that are `a`) rises from about 0 to above 0.5
    in a dozen steps on a tiny model; prompts from a JSONL file and from their prepared directory
    give the same run, and one cut at step 6 and rerun to 12 logs the same losses."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}:"}) + "\n" for i in range(16)))
    prepare.prepare([str(tmp_path / "p.jsonl")], prepare.Options("bytes", str(tmp_path / "prompts"), "prompt"),
                    workers=1, say=lambda _: None)
    args = ["train", "meshes/demo.yaml", *TINY, "train.global_batch_size=16", "model.vocab_size=264",
            "data.tokenizer=bytes", "train.objective=grpo", "grpo.reward=examples/grpo_reward.py:letter_a",
            "grpo.group_size=8", "grpo.max_new_tokens=6", "optimizer.learning_rate=3e-2", "optimizer.warmup_steps=0",
            "optimizer.schedule=constant", "train.compile_cache=false"]  # constant: a rerun to more steps keeps the lr
    prepared = ["data.source=tokens", f"data.path={tmp_path / 'prompts'}"]

    def logged(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if "loss" in r}
    assert run_cli(capsys, *args, f"data.path={tmp_path / 'p.jsonl'}", "train.steps=12",
                   f"run_dir={tmp_path / 'straight'}")[0] == 0
    assert run_cli(capsys, *args, *prepared, "train.steps=6", f"run_dir={tmp_path / 'cut'}")[0] == 0
    assert run_cli(capsys, *args, *prepared, "train.steps=12", f"run_dir={tmp_path / 'cut'}")[0] == 0
    straight, cut = logged("straight"), logged("cut")
    assert sorted(straight) == list(range(1, 13))
    assert {s: (r["loss"], r["reward_mean"]) for s, r in cut.items()} == \
        {s: (r["loss"], r["reward_mean"]) for s, r in straight.items()}
    rewards = [straight[s]["reward_mean"] for s in range(1, 13)]
    assert np.mean(rewards[:3]) < 0.1 and np.mean(rewards[-3:]) > 0.5, rewards
    assert straight[1]["kl"] == 0 and {"reward_std", "completion_len", "clip_fraction"} <= set(straight[1])
    rows = [json.loads(x) for x in (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 12 * 8 and {"step", "prompt", "completion", "reward"} <= set(rows[0])


def test_plan_counts_the_reference_and_the_generation_cache():
    cfg = config.load(None, [*TINY, "model.n_heads=4", "model.n_kv_heads=2", "mesh.data=2", "mesh.fsdp=2",
                             "mesh.tensor=2", "data.source=tokens", "data.path=unused", "train.objective=grpo",
                             "grpo.reward=examples/grpo_reward.py:letter_a", "grpo.group_size=4",
                             "grpo.max_new_tokens=4"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    assert sharding.shard_bytes(prog.abstract_state["reference"]) == sharding.shard_bytes(prog.abstract_state["params"])
    # (layers, rows, slots, kv heads, head size) float32, k and v; rows over data x fsdp, kv heads over tensor
    assert sharding.shard_bytes(prog.generation_cache()) == 2 * 2 * 8 * 17 * 2 * 8 * 4 // (4 * 2)


@pytest.mark.parametrize("overrides, message", [
    (["train.objective=grpo", "grpo.reward=r.py:f", "data.source=text"],
     "train.objective=grpo trains on prompts: set data.source=tokens and data.path"),
    (["train.objective=grpo", "data.source=tokens", "data.path=x"], "grpo.reward: give the reward function as"),
    (["train.objective=grpo", "grpo.reward=r.py:f", "grpo.group_size=3", "data.source=tokens", "data.path=x"],
     "grpo.group_size=3 must be >= 2 and divide train.global_batch_size=8"),
    (["train.objective=dpo", "data.source=tokens", "data.path=PREPARED"],
     "train.objective=dpo reads preference pairs: data.path=PREPARED was not prepared with"),
    (["train.objective=grpo", "grpo.reward=/nonexistent.py:f", "grpo.max_new_tokens=4", "data.source=tokens",
      "data.path=PREPARED"],
     "grpo.reward: no file /nonexistent.py"),
])
def test_post_training_mistakes_exit_2_with_one_line(capsys, tmp_path, prepared, overrides, message):
    overrides = [o.replace("PREPARED", str(prepared)) for o in overrides]
    message = message.replace("PREPARED", str(prepared))
    code, _, err = run_cli(capsys, "train", "meshes/demo.yaml", *TINY, "model.vocab_size=320", *overrides,
                           f"run_dir={tmp_path}")
    assert code == 2 and message in err and "Traceback" not in err, err


def test_jsonl_prompts_keep_their_rows_for_the_reward_and_drop_those_without_room(tmp_path):
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "x" * 20, "answer": "?"}, {"prompt": "10+5=", "answer": "15"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config.load(None, [*TINY, f"data.path={tmp_path / 'p.jsonl'}", "train.objective=grpo",
                             "grpo.reward=examples/grpo_reward.py:letter_a", "grpo.max_new_tokens=8"])
    source = prompts.prompts(cfg, "train", tokenize.load("bytes"))
    assert (len(source), source.dropped) == (2, 1)  # 20 bytes + 8 new > 17
    second = source[1]
    assert second["tokens"][:second["length"]].tolist() == list(b"10+5=") and not second["tokens"][5:].any()
    assert source.row(int(second["index"])) == rows[2]  # the whole row reaches the reward
