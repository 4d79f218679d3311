"""Where a run's first weights come from: what `checkpoint.init_from`, `import-hf`, `export-hf` and
`generate` accept (a `WeightSource`), and loading its parameters (only the parameters) into a
program's shardings; LoRA adapters split, started and merged; the `import-hf` / `export-hf` commands.

A source is one of
- a Hugging Face model directory (config.json + *.safetensors): read by hf/io.py's HfDir;
- a directory written by `shardtrain import-hf`, or a run directory: its newest committed
  checkpoint under checkpoints/ (or the run's checkpoint.directory);
- one checkpoint step directory (`.../checkpoints/N`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml
from etils import epath

import models
from models import LORA_A, LORA_B, is_adapter
from shardtrain import config as config_lib
from shardtrain.checkpoint import diagnose, integrity, listing, manager
from shardtrain.data import loader, tokenize
from shardtrain.hf import io as hf_io, tokenizer as hf_tokenizer
from shardtrain.parallel import comm, mesh as mesh_lib, sharding

FINE_TUNE_HINT = (f"tokenize your data with this model's tokenizer, `shardtrain prepare INPUT... --tokenizer {{out}} "
                  f"--out DIR` (--chat for conversations),\nthen `shardtrain train {{out}}/config.yaml data.path=DIR` "
                  f"(data.path: {loader.DATA_PATH_TO_FILL_IN} stands for it)")
"""What import-hf prints and writes atop its config.yaml: the data is the user's to prepare."""
HF_CONFIG = "hf_config.json"
"""The imported model's original config.json, kept beside the checkpoint for export."""


@dataclasses.dataclass
class WeightSource:
    path: Path
    model: config_lib.ModelConfig
    config: dict
    """The run config (as a dict) the weights were trained or imported with ({} for an HF dir)."""
    step_dir: Path | None = None
    """The Orbax step directory; None for an HF directory."""
    hf_dir: hf_io.HfDir | None = None
    """The HF directory, its headers read and checked; None for a checkpoint."""
    dirs: tuple[Path, ...] = ()
    """Where the tokenizer, the special tokens and the original HF config may be, in order: the HF
    directory, or the run's directory, checkpoint.init_from's chain and its prepared data (`chain`)."""

    def base_hf_config(self) -> dict | None:
        for d in self.dirs:
            for name in (HF_CONFIG, "config.json"):
                if (d / name).is_file():
                    return json.loads((d / name).read_text())
        return None

    def tokenizer(self) -> hf_tokenizer.TokenizerFiles:
        return hf_tokenizer.find(list(self.dirs), self.config)

    def params(self, abstract_params: dict, model: config_lib.ModelConfig | None = None) -> dict:
        """The parameters, restored straight into the shapes and shardings of `abstract_params`
        (of `model`, by default the source's own); ConfigError naming the tensors that differ."""
        if self.hf_dir is not None:
            return self.hf_dir.params(abstract_params, model)
        with manager.library_log(self.step_dir.parent.parent):  # Orbax's chatter: beside checkpoints/
            return restore_params(self.step_dir, abstract_params)


def model_from_dict(d: dict) -> config_lib.ModelConfig:
    return config_lib.from_dict(d, config_lib.ModelConfig)


def find(path: str | Path, what: str = "checkpoint.init_from") -> WeightSource:
    """Resolves a weights source; ConfigError (naming `what`) if there is none."""
    p = Path(path)
    if not p.exists():
        raise config_lib.ConfigError(f"{what}: '{path}' does not exist{listing.steps_near(p)}")
    if hf_io.is_hf_dir(p):
        hf_dir = hf_io.HfDir(p)  # checks architecture, shards and shapes before any work
        return WeightSource(p, hf_dir.model, {}, hf_dir=hf_dir, dirs=(p,))
    step_dir = newest_step(p, what)
    meta = listing.read_meta(step_dir)
    if not meta or "config" not in meta:
        raise config_lib.ConfigError(f"{what}: {step_dir} has no readable meta/metadata "
                                     "(is it a shardtrain checkpoint?)")
    cfg = meta["config"]
    return WeightSource(p, model_from_dict(cfg["model"]), cfg, step_dir=step_dir,
                        dirs=chain(cfg, step_dir.parent.parent))


def newest_step(p: Path, what: str) -> Path:
    """The step directory `p` names, or the newest committed one of the run or checkpoints dir `p`."""
    ckpt_dir, step = listing.locate(str(p), what)
    if step is not None:
        return Path(ckpt_dir) / str(step)
    committed = [s for s in listing.scan(ckpt_dir) if s.state == "committed"]
    if not committed:
        raise config_lib.ConfigError(f"{what}: '{p}' holds no committed checkpoint and no Hugging Face "
                                     "model (config.json + *.safetensors)")
    return Path(str(committed[-1].path))


def chain(cfg: dict, run_dir: Path, depth: int = 3) -> tuple[Path, ...]:
    """The directories a run's tokenizer and original HF config may be in, in order: the run dir,
    checkpoint.init_from (and, for a run there, its own chain), the prepared data (data.source=tokens)."""
    dirs = [run_dir]
    init_from = (cfg.get("checkpoint") or {}).get("init_from")
    if init_from and Path(init_from).is_dir():
        dirs.append(Path(init_from))
        if depth and not hf_io.is_hf_dir(init_from):
            try:
                step_dir = newest_step(Path(init_from), "checkpoint.init_from")
                dirs += chain((listing.read_meta(step_dir) or {}).get("config", {}), step_dir.parent.parent, depth - 1)
            except config_lib.ConfigError:
                pass
    data = cfg.get("data") or {}
    for path in [data.get("path"), *(e.get("path") for e in data.get("mixture") or [])]:
        if data.get("source") == "tokens" and path and not config_lib.is_url(path) and Path(path).is_dir():
            dirs.append(Path(path))
    return tuple(dict.fromkeys(dirs))


def check_tokenizer(cfg: config_lib.RunConfig, opened: list) -> config_lib.RunConfig:
    """`cfg` with data.tokenizer resolved to the fingerprint of the data's tokenizer (`opened`: its
    sources), once the tokenizer the weights read is found to be the same: a resumed run's (its newest
    checkpoint's) or checkpoint.init_from's, and data.tokenizer as set. ConfigError naming both
    tokenizers unless data.allow_tokenizer_mismatch; a mixture must have one tokenizer too."""
    data, allow = loader.tokenizers(cfg, opened), cfg.data.allow_tokenizer_mismatch
    if len({fp for _, fp in data}) > 1 and not allow:
        raise config_lib.ConfigError("data.mixture: the datasets come from different tokenizers (" + "; ".join(
            f"{w}: {fp}" for w, fp in data) + "); prepare them all with one tokenizer (or set "
            "data.allow_tokenizer_mismatch=true to train on them anyway)")
    if not data:
        return cfg
    where, fp = data[0]
    models = model_tokenizers(cfg)
    for whose, theirs, _ in models:
        if theirs is None or theirs == fp or allow:
            continue
        tok = next((d for _, _, d in models if d is not None), "THE_MODEL'S_TOKENIZER")
        if cfg.data.source == "text":
            raise config_lib.ConfigError(
                f"data.source=text feeds UTF-8 bytes as token ids, but {whose} reads another tokenizer ({theirs}): "
                f"tokenize the text with it, `shardtrain prepare 'GLOB' --tokenizer {tok} --out DIR`, then train "
                "with data.source=tokens data.path=DIR (or set data.allow_tokenizer_mismatch=true to train on bytes)")
        raise config_lib.ConfigError(
            f"{where} was made by the tokenizer {fp}, but {whose} reads another tokenizer ({theirs}): prepare the "
            f"data with the model's, `shardtrain prepare INPUT... --tokenizer {tok} --out DIR` (or set "
            "data.allow_tokenizer_mismatch=true to train on it anyway)")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=fp))


def model_tokenizer(cfg: config_lib.RunConfig):
    """The tokenizer the run's weights read (a resumed run's, checkpoint.init_from's), loaded to
    tokenize text for them (GRPO's JSONL prompts); ConfigError when they name none."""
    for _, fingerprint, tok_dir in model_tokenizers(cfg):
        if tok_dir is not None:
            return tokenize.load(str(tok_dir))
        if fingerprint == tokenize.BYTES:
            return tokenize.load("bytes")
    raise config_lib.ConfigError(f"data.path={cfg.data.path}: no tokenizer for its prompts: the weights (checkpoint."
                                 "init_from) name none; start from weights that have one, or tokenize the prompts "
                                 "with `shardtrain prepare FILE.jsonl --text-field prompt --tokenizer TOK --out DIR` "
                                 "and pass data.source=tokens data.path=DIR")


def model_tokenizers(cfg: config_lib.RunConfig) -> list:
    """(whose, fingerprint or None, the tokenizer's directory or None) of each tokenizer the
    run's weights come with: a resumed run's, else checkpoint.init_from's (recorded in their config,
    else found along their chain: hf/tokenizer.py), then data.tokenizer as set."""
    def of(config: dict, dirs: tuple) -> tuple:
        tok_dir = next((d for d in dirs if any((d / n).is_file() for n in hf_tokenizer.TOKENIZER_FILES)), None)
        recorded = (config.get("data") or {}).get("tokenizer")
        if recorded is None and tok_dir is not None:  # one that does not load here is still not the data's
            recorded = tokenize.fingerprint_of(tok_dir) or f"the one in {tok_dir}, which does not load here"
        elif recorded is None and hf_tokenizer.find(list(dirs), config).byte_ids:
            recorded = tokenize.BYTES
        return recorded, tok_dir

    out = []
    meta = listing.newest_meta(cfg)
    if meta and "config" in meta:
        dirs = chain(meta["config"], Path(cfg.run_dir))
        out.append((f"the model of this run's checkpoint step {meta.get('step')}", *of(meta["config"], dirs)))
    elif cfg.checkpoint.init_from:
        source = find(cfg.checkpoint.init_from)
        out.append((f"the model of checkpoint.init_from={cfg.checkpoint.init_from}", *of(source.config, source.dirs)))
    if cfg.data.tokenizer is not None:
        out.append(("the model (data.tokenizer, as set in the config)", cfg.data.tokenizer, None))
    return out


def restore_params(step_dir: Path, abstract_params: dict) -> dict:
    """Only `params` of a checkpoint step (the optimizer state, if any, is not read)."""
    step_dir = Path(step_dir).absolute()  # orbax's metadata of a relative path has no tree (orbax 0.12.8)
    try:
        integrity.verify(epath.Path(step_dir))
    except integrity.Damaged as e:
        raise config_lib.ConfigError(f"{step_dir}: the checkpoint is damaged ({e}); use another step") from None
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    saved = ckptr.metadata(step_dir / "state")
    saved = getattr(saved, "item_metadata", saved)
    saved = getattr(saved, "tree", saved)
    if saved is None:
        raise config_lib.ConfigError(f"{step_dir}: its array metadata (state/_METADATA) is missing; use another step")
    bad = diagnose.mismatches(diagnose.leaf_shapes(saved.get("params", {})),
                              diagnose.leaf_shapes(abstract_params))
    if bad:
        raise config_lib.ConfigError(f"{step_dir}: the checkpoint's parameters do not fit this model "
                                     f"({len(bad)} paths): " + "; ".join(bad[:8]))
    item = {"params": abstract_params}
    try:
        restored = ckptr.restore(step_dir / "state", args=ocp.args.PyTreeRestore(
            item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    except Exception as e:  # noqa: BLE001 - any read failure: one line naming the damage
        raise config_lib.ConfigError(f"{step_dir} cannot be read: {diagnose.read_error(e, epath.Path(step_dir))}; "
                                     "use another step") from None
    finally:
        ckptr.close()
    return restored["params"]


def split_adapters(tree: dict) -> tuple[dict, dict]:
    """(everything but the LoRA adapters, the adapters) of a parameter tree."""
    def pick(node, keep, path=()):
        if isinstance(node, dict):
            out = {k: pick(v, keep, (*path, k)) for k, v in node.items()}
            return {k: v for k, v in out.items() if v is not None and not (isinstance(v, dict) and not v)}
        return node if is_adapter(path) == keep else None
    return pick(tree, False), pick(tree, True)


def merge_adapters(params: dict, model: config_lib.ModelConfig) -> dict:
    """The parameters with each LoRA adapter folded into its weight: W + (alpha/r) A @ B."""
    targets = models.adapted_weights(model)
    if not targets:
        return params
    base, _ = split_adapters(params)
    scale = model.lora.alpha / model.lora.rank

    @jax.jit
    def merge(blocks):
        out = {k: v for k, v in blocks.items() if not is_adapter((k,))}
        for name in targets:
            a, b = blocks[name + LORA_A], blocks[name + LORA_B]  # (L, in..., r), (L, r, out...)
            delta = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))(a, b)
            out[name] = (out[name] + scale * delta).astype(out[name].dtype)
        return out
    return {**base, "blocks": merge(params["blocks"])}


def initial_state(prog, source: WeightSource) -> dict:
    """A fresh train state of `prog` (a step.Program: step 0, new optimizer state) around the
    source's parameters; LoRA adapters (model.lora.rank > 0) start fresh (B = 0: the model starts
    as the source)."""
    if comm.enabled(prog.cfg):
        raise config_lib.ConfigError("checkpoint.init_from: not supported with train.comm.sync=local_sgd or a "
                                     "compressed train.comm.grad_reduce_dtype yet; start with the defaults")
    base_abstract, adapter_abstract = split_adapters(prog.layout.params)
    params = source.params(base_abstract, prog.cfg.model)
    if adapter_abstract:
        params = merge_trees(params, fresh_adapters(prog.layout, prog.cfg.train.seed))
    return prog.fresh_state(params)


def merge_trees(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge_trees(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def fresh_adapters(layout: sharding.ParamLayout, seed: int) -> dict:
    """The LoRA adapters of the model initialised from `seed`, in the layout's shardings (XLA
    drops the unused base init)."""
    shardings = split_adapters(layout.shardings)[1]
    return jax.jit(lambda: split_adapters(layout.init(jax.random.key(seed)))[1], out_shardings=shardings)()


def write_run_config(cfg: config_lib.RunConfig, path: Path, header: str = "") -> None:
    """The resolved config without run_dir (a rerun chooses its own) as YAML, after a `header` comment."""
    tree = yaml.safe_load(config_lib.dump(cfg))
    tree.pop("run_dir", None)
    if str(tree["data"].get("path")).endswith("/" + loader.DATA_PATH_TO_FILL_IN):  # the placeholder, as written
        tree["data"]["path"] = loader.DATA_PATH_TO_FILL_IN
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(tree, sort_keys=False))


# ----------------------------------------------------------------------------- import-hf / export-hf


def run_config_of(source: WeightSource) -> config_lib.RunConfig:
    """The run config the source's weights were written with (the defaults for an HF dir)."""
    tree = {**source.config, "model": dataclasses.asdict(source.model)}
    cfg = config_lib.from_dict(tree)
    config_lib.validate(cfg)
    return cfg


def fsdp_layout(cfg: config_lib.RunConfig, what: str = "import-hf / export-hf") -> sharding.ParamLayout:
    """The parameter layout import-hf and export-hf move weights through: cfg's model by cfg's
    rules on a mesh of every device present, all of them FSDP (mesh.fsdp=-1), whatever mesh cfg
    trains on (the machine that converts need not be the one that trains). No train step is built;
    a parameter the devices do not divide is a ConfigError naming it (never a fallback)."""
    cfg = dataclasses.replace(cfg, mesh=config_lib.MeshConfig(fsdp=-1))
    try:
        return sharding.param_layout(cfg, mesh_lib.make_mesh(cfg.mesh))
    except config_lib.ConfigError as e:
        raise config_lib.ConfigError(f"{what} lays the parameters out over all {jax.device_count()} devices "
                                     f"present (FSDP): {e}") from None


def import_hf(hf_dir: str, out_dir: str, overrides=(), say=print) -> None:
    """`shardtrain import-hf`: an HF model directory -> OUT_DIR/checkpoints/0 (the parameters at
    step 0; the optimizer state starts fresh wherever it is used), OUT_DIR/config.yaml (a training
    config with checkpoint.init_from: OUT_DIR), the original config.json as hf_config.json and the
    tokenizer files."""
    t0 = time.perf_counter()
    apart("import-hf", hf_dir, out_dir)
    src = hf_io.HfDir(hf_dir)  # architecture, shards, headers, shapes: checked before any work
    out = Path(out_dir).resolve()
    if listing.scan(str(out / "checkpoints")):
        raise config_lib.ConfigError(f"import-hf: {out} already holds checkpoints; give a new OUT_DIR")
    cfg = config_lib.load(None, ["mesh.fsdp=-1", f"run_dir={out}", f"checkpoint.init_from={out}",
                                 "optimizer.learning_rate=1e-4", "optimizer.warmup_steps=10", "data.source=tokens",
                                 f"data.path={loader.DATA_PATH_TO_FILL_IN}", *overrides])
    cfg = dataclasses.replace(cfg, model=src.model, name=f"{out.name}-ft",  # its runs: runs/NAME-ft, not OUT_DIR
                              data=dataclasses.replace(cfg.data, tokenizer=tokenize.fingerprint_of(src.dir)))
    config_lib.validate(cfg)
    layout = fsdp_layout(cfg, "import-hf")
    params = src.params(layout.params)
    save_params(cfg, layout, params)
    write_run_config(cfg, out / "config.yaml", header=FINE_TUNE_HINT.format(out=out))
    shutil.copyfile(src.dir / "config.json", out / HF_CONFIG)
    hf_tokenizer.copy_side_files(src.dir, out)
    n = sum(x.size for x in jax.tree.leaves(params))
    found = hf_tokenizer.find([out], {})
    eos = f"EOS {found.eos_token!r} (id {found.eos_ids[0]})" if found.eos_ids else "no EOS token known"
    say(f"imported {src.family.architecture} ({n / 1e6:.2f}M parameters, {eos}) from {src.dir} to {out} in "
        f"{time.perf_counter() - t0:.1f} s; fine-tune: {FINE_TUNE_HINT.format(out=out)}")


def apart(command: str, source: str | Path, out_dir: str | Path) -> None:
    """ConfigError unless OUT_DIR and the source are apart (neither is the other nor inside it): a
    command never writes into what it reads."""
    src, out = Path(source).resolve(), Path(out_dir).resolve()
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        where = "is" if out == src else "is inside" if out.is_relative_to(src) else "holds"
        raise config_lib.ConfigError(f"{command}: OUT_DIR {out_dir} {where} the source {source}; a command never "
                                     "writes into what it reads: give another OUT_DIR")


def save_params(cfg: config_lib.RunConfig, layout: sharding.ParamLayout, params: dict) -> None:
    """`params` (in the layout's shardings) as step 0 of cfg's checkpoints, with no optimizer state:
    what import-hf writes and `checkpoint.init_from` reads back (the optimizer state starts where it is
    used)."""
    state = {"params": params, "step": jnp.zeros((), jnp.int32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    ckpt = manager.Checkpointer(cfg, abstract, layout.mesh.shape)
    ckpt.save(0, state)
    ckpt.wait()
    ckpt.close()


def parse_bytes(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[:-len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise config_lib.ConfigError(f"--max-shard-size {text!r}: give bytes like 5GB, 500MB or 2000000")


def export_hf(source_path: str, out_dir: str, dtype: str | None = None, max_shard_size: str = "5GB",
              say=print) -> None:
    """`shardtrain export-hf`: a run directory, checkpoint step or import-hf directory -> an HF
    model directory loadable by transformers (config.json, safetensors weights, the tokenizer of the
    source's chain with its EOS / BOS: hf/tokenizer.py); says in one line when it writes no tokenizer."""
    t0 = time.perf_counter()
    apart("export-hf", source_path, out_dir)
    source = find(source_path, what="export-hf")
    if source.step_dir is not None:  # a step directory: its run's directory is the source too
        apart("export-hf", source.step_dir.parent.parent, out_dir)
    base = source.base_hf_config()
    if dtype is None:
        dtype = (base or {}).get("dtype") or (base or {}).get("torch_dtype") or "float32"
        dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    limit = parse_bytes(max_shard_size)
    params = merge_adapters(source.params(fsdp_layout(run_config_of(source), "export-hf").params), source.model)
    found = source.tokenizer()
    files = hf_io.export(params, source.model, out_dir, base=base, dtype=dtype, max_shard_bytes=limit,
                         special_ids=hf_tokenizer.config_ids(found))
    if jax.process_index() == 0:
        missing = hf_tokenizer.write(Path(out_dir), found)
        tokenizer = f"tokenizer from {found.dir}" if found.dir else "no tokenizer"
        eos = f", EOS {found.eos_token!r} (id {found.eos_ids[0]})" if found.eos_ids else ", no EOS known"
        say(f"exported {source.step_dir or source.path} to {out_dir} ({len(files)} safetensors file"
            f"{'s' * (len(files) > 1)}, {dtype}; {tokenizer}{eos}) in {time.perf_counter() - t0:.1f} s")
        if missing:
            say(f"export-hf: {missing}")
