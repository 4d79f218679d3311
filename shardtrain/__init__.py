"""shardtrain: sharded JAX training from a small YAML mesh config."""

from shardtrain.config import ConfigError, RunConfig, load

__all__ = ["ConfigError", "RunConfig", "load"]
