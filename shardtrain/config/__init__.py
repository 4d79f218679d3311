"""Run configuration: typed, frozen, nested dataclasses loaded from YAML with dotted overrides.

One source of truth: every other module reads a `RunConfig`. Errors a user can cause raise
`ConfigError`, whose message names the field and the fix; the CLI turns it into exit code 2.

- `schema.py`: the sections (`RunConfig`, `ModelConfig`, `TrainConfig`, ...), `MESH_AXES`, `ConfigError`.
- `load.py`: YAML + `key=value` overrides -> a validated config with absolute paths; `dump`, `from_dict`.
- `validate.py`: the cross-field checks, one `validate_<section>` per section.
"""

from shardtrain.config.load import absolute, dump, from_dict, load, read_yaml, repeated, resolve_paths, to_dict
from shardtrain.config.model import (
    LinearAttentionConfig,
    LoraConfig,
    MlaConfig,
    ModelConfig,
    MoeConfig,
    RopeScalingConfig,
)
from shardtrain.config.schema import (
    MESH_AXES,
    MOVED,
    AxisRule,
    CheckpointConfig,
    CommConfig,
    ConfigError,
    DataConfig,
    DcnConfig,
    DpoConfig,
    GrpoConfig,
    HardwareConfig,
    LocalTierConfig,
    MeshConfig,
    MixtureEntry,
    OptimizerConfig,
    PipelineConfig,
    RulesConfig,
    RunConfig,
    TrainConfig,
    WatchdogConfig,
    is_url,
    mesh_axes,
    shown,
)
from shardtrain.config.validate import validate, validate_hardware, validate_optimizer

__all__ = [
    "MESH_AXES", "MOVED", "AxisRule", "CheckpointConfig", "CommConfig", "ConfigError", "DataConfig", "DcnConfig",
    "DpoConfig", "GrpoConfig", "HardwareConfig", "LocalTierConfig", "LoraConfig", "MeshConfig", "MixtureEntry",
    "LinearAttentionConfig", "MlaConfig", "ModelConfig", "MoeConfig",
    "OptimizerConfig", "PipelineConfig", "RopeScalingConfig", "RulesConfig", "RunConfig", "TrainConfig",
    "WatchdogConfig", "absolute", "dump", "from_dict", "is_url", "load", "mesh_axes", "read_yaml", "repeated",
    "resolve_paths", "shown", "to_dict", "validate", "validate_hardware", "validate_optimizer",
]
