"""Loading a RunConfig: YAML file + dotted `key=value` overrides -> typed, validated, resolved config.

The loader is generic: it walks the dataclasses of `schema.py` by their type annotations
(`Optional`, `Literal`, tuples, nested sections), so a new field needs no loader code. Every way
input can be wrong (unreadable file, YAML syntax, duplicate key, unknown or moved key, wrong type)
is one ConfigError line naming the file or the field. `load` then runs `validate.validate` and
makes every path absolute (`resolve_paths`); `dump` writes the resolved config back as YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Literal

import yaml

from shardtrain.config.schema import MOVED, ConfigError, RunConfig, is_url, shown
from shardtrain.config.validate import validate


def _convert(tp, value, where: str):
    """Checks and converts a YAML value to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {shown(value)}")
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1] if len(errors) == 1 else
                          f"{where}: {shown(value)} is not a valid {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(map(str, typing.get_args(tp)))
            raise ConfigError(f"{where}: {shown(value)} is not one of: {choices}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        if args and args[-1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {shown(value)}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # (YAML 1.1 reads 1e-2, without a dot, as a string)
            number = float(value)
        except (ValueError, OverflowError):
            number = None
        if number is not None and not math.isfinite(number):
            raise ConfigError(f"{where}: must be a finite number, got {shown(value)}")
        if number is not None:
            return number
    if tp is int and isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
        raise ConfigError(f"{where}: {shown(value)} is out of range (an integer here is at most {INT_LIMIT} "
                          "in magnitude)")
    if tp in (int, str, bool) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {shown(value)}")


INT_LIMIT = 2**63 - 1
"""The largest integer any config field may hold (int64: what numpy and jax take); validate.py
bounds some fields further."""


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _build(cls, values: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key in MOVED.get(cls, {}):
            raise ConfigError(f"{path} moved to {where}.{MOVED[cls][key]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(names)}"
            raise ConfigError(f"unknown config key {shown(path)}{hint}")
        kwargs[key] = _convert(hints[key], value, path)
    return cls(**kwargs)


def from_dict(tree: dict, cls=None):
    """A config (RunConfig by default, or the section class `cls`) from a plain dict such as a
    checkpoint's saved config; unknown keys and wrong types raise ConfigError."""
    return _build(cls or RunConfig, tree, "" if cls is None else cls.__name__)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        tree = node
    tree[last] = value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    would silently keep the last value)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # PyYAML itself reports an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (YAML would keep only the last one; remove the other)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(p: Path) -> dict:
    """A config file's top-level mapping; every way a file can be unusable is one ConfigError line."""
    if p.is_dir():
        raise ConfigError(f"config '{p}' is a directory, not a YAML file; pass a file such as meshes/demo.yaml")
    if not p.exists():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{p}' cannot be read: {e}") from None
    if not text.strip():
        raise ConfigError(f"config file '{p}' is empty; give at least one section, e.g. copy meshes/demo.yaml")
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        what = " ".join(x for x in (e.context, e.problem) if x)
        kind = "" if what.startswith("duplicate key") else "YAML syntax error: "
        raise ConfigError(f"{where}: {kind}{what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: YAML syntax error: {' '.join(str(e).split())}") from None
    if tree is None:
        raise ConfigError(f"config file '{p}' holds only comments; give at least one section, "
                          "e.g. copy meshes/demo.yaml")
    if not isinstance(tree, dict):
        raise ConfigError(f"{p}: expected a mapping of sections (mesh:, model:, ...) at the top level, "
                          f"got {type(tree).__name__}")
    return tree


def repeated(overrides: typing.Sequence[str]) -> list[str]:
    """A line for each KEY that `key=value` overrides give more than once, saying which value wins
    (the last, as `load` applies them in order: scripts build on a base list of overrides)."""
    given: dict[str, list[str]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if sep:
            given.setdefault(key.strip(), []).append(raw)
    return [f"{k[:100]} is given {len(v)} times ({', then '.join(shown(x, 60) for x in v)}); "
            f"the last one wins" for k, v in given.items() if len(v) > 1]


def load(path: str | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Loads a YAML config (or the defaults) and applies `key=value` overrides (YAML values, in order:
    a later one wins; the command line says so, `repeated`)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        tree = read_yaml(p)
        tree.setdefault("name", p.stem)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {shown(item)} is not KEY=VALUE (e.g. train.steps=50)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    cfg = _build(RunConfig, tree, "")
    validate(cfg)
    return resolve_paths(cfg)


def absolute(path: str | None) -> str | None:
    """A path the user gave, made absolute against the current directory once, at load time (so
    that a later chdir or a library that insists on absolute paths cannot break it); URLs such as
    gs://... are returned untouched."""
    if path is None or is_url(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """The config with run_dir defaulted (runs/<name>) and every path made absolute."""
    return dataclasses.replace(
        cfg, run_dir=absolute(cfg.run_dir or str(Path("runs") / cfg.name)),
        checkpoint=dataclasses.replace(cfg.checkpoint, directory=absolute(cfg.checkpoint.directory),
                                       init_from=absolute(cfg.checkpoint.init_from),
                                       local=dataclasses.replace(cfg.checkpoint.local,
                                                                 directory=absolute(cfg.checkpoint.local.directory))),
        data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path), mixture=tuple(
            dataclasses.replace(e, path=absolute(e.path)) for e in cfg.data.mixture)))


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML (tuples as lists)."""
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return yaml.safe_dump(plain(to_dict(cfg)), sort_keys=False)
