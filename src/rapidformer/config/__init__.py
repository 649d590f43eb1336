"""The typed configuration, its loaders and its validation."""

from rapidformer.config.loading import build_parser, parse_args, read_config_file
from rapidformer.config.root import RapidformerConfig
from rapidformer.config.schema import (
    CheckpointConfig,
    DataConfig,
    GraphConfig,
    LoggingConfig,
    MemoryConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PlanningConfig,
    PrecisionConfig,
    TrainingConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "GraphConfig",
    "LoggingConfig",
    "MemoryConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PlanningConfig",
    "PrecisionConfig",
    "RapidformerConfig",
    "TrainingConfig",
    "build_parser",
    "parse_args",
    "read_config_file",
]
