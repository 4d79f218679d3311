"""Weights from elsewhere: what `checkpoint.init_from`, `import-hf`, `export-hf` and `generate`
accept, and loading its parameters (only the parameters) into a program's shardings.

A source is one of
- a Hugging Face model directory (config.json + *.safetensors): read by shardtrain/hf.py;
- a directory written by `shardtrain import-hf`, or a run directory: its newest committed
  checkpoint under checkpoints/ (or the run's checkpoint.directory);
- one checkpoint step directory (`.../checkpoints/N`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml

from shardtrain import checkpoint, config as config_lib, hf

HF_CONFIG = "hf_config.json"
"""The imported model's original config.json, kept beside the checkpoint for export."""


@dataclasses.dataclass
class Source:
    path: Path
    model: config_lib.ModelConfig
    config: dict
    """The run config (as a dict) the weights were trained or imported with ({} for an HF dir)."""
    step_dir: Path | None = None
    """The Orbax step directory; None for an HF directory."""
    hf_dir: Path | None = None
    files_dir: Path | None = None
    """Where the tokenizer and the original HF config live (None: unknown)."""

    def base_hf_config(self) -> dict | None:
        d = self.files_dir
        for name in (HF_CONFIG, "config.json"):
            if d is not None and (d / name).is_file():
                return json.loads((d / name).read_text())
        return None

    def params(self, abstract_params: dict) -> dict:
        """The parameters, restored straight into the shardings of `abstract_params`."""
        if self.hf_dir is not None:
            return hf.Source(self.hf_dir, self.model).params(abstract_params)
        return restore_params(self.step_dir, abstract_params)


def model_from_dict(d: dict) -> config_lib.ModelConfig:
    return config_lib._build(config_lib.ModelConfig, d, "model")


def find(path: str | Path, what: str = "checkpoint.init_from") -> Source:
    """Resolves a weights source; ConfigError (naming `what`) if there is none."""
    p = Path(path)
    if not p.exists():
        raise config_lib.ConfigError(f"{what}: '{path}' does not exist")
    if hf.is_hf_dir(p):
        src = hf.Source(p)  # checks architecture, shards and shapes before any work
        return Source(p, src.model, {}, hf_dir=p, files_dir=p)
    if (p / "state").is_dir():
        step_dir = p
    else:
        ckpt_dir = Path(checkpoint.checkpoint_dir_of(str(p)))
        committed = [s for s in checkpoint.scan(str(ckpt_dir)) if s.state == "committed"]
        if not committed:
            raise config_lib.ConfigError(f"{what}: '{path}' holds no committed checkpoint and no Hugging Face "
                                         "model (config.json + *.safetensors)")
        step_dir = Path(str(committed[-1].path))
    meta = checkpoint.read_meta(step_dir)
    if not meta or "config" not in meta:
        raise config_lib.ConfigError(f"{what}: {step_dir} has no readable meta/metadata (is it a shardtrain checkpoint?)")
    cfg = meta["config"]
    run_dir = step_dir.parent.parent
    files_dir = None
    for d in (run_dir, Path(cfg.get("checkpoint", {}).get("init_from") or run_dir)):
        if d.is_dir() and any((d / n).is_file() for n in (*hf.TOKENIZER_FILES, HF_CONFIG, "config.json")):
            files_dir = d
            break
    return Source(p, model_from_dict(cfg["model"]), cfg, step_dir=step_dir, files_dir=files_dir)


def restore_params(step_dir: Path, abstract_params: dict) -> dict:
    """Only `params` of a checkpoint step (the optimizer state, if any, is not read)."""
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    saved = ckptr.metadata(step_dir / "state")
    saved = getattr(saved, "item_metadata", saved)
    saved = getattr(saved, "tree", saved)
    bad = checkpoint.mismatches(checkpoint.leaf_shapes(saved.get("params", {})), checkpoint.leaf_shapes(abstract_params))
    if bad:
        raise config_lib.ConfigError(f"{step_dir}: the checkpoint's parameters do not fit this model "
                                     f"({len(bad)} paths): " + "; ".join(bad[:8]))
    item = {"params": abstract_params}
    restored = ckptr.restore(step_dir / "state", args=ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    ckptr.close()
    return restored["params"]


def initial_state(prog, source: Source) -> dict:
    """A fresh train state (step 0, new optimizer state) around the source's parameters."""
    from shardtrain import comm, optim
    if comm.enabled(prog.cfg):
        raise config_lib.ConfigError("checkpoint.init_from: not supported with train.sync=local_sgd or a "
                                     "compressed train.grad_reduce_dtype yet; start with the defaults")
    params = source.params(prog.abstract_state["params"])
    tx = optim.make(prog.cfg)
    make = jax.jit(lambda p: {"params": p, "opt": tx.init(p), "step": jnp.zeros((), jnp.int32)},
                   out_shardings=prog.state_shardings, donate_argnums=0)
    return make(params)


def write_run_config(cfg: config_lib.RunConfig, path: Path) -> None:
    """The resolved config without run_dir (a rerun chooses its own) as YAML."""
    tree = yaml.safe_load(config_lib.dump(cfg))
    tree.pop("run_dir", None)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
