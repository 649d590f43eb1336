"""rapidformer: train transformers fast by flipping switches."""

from rapidformer.config import RapidformerConfig, parse_args
from rapidformer.engine import RapidformerEngine
from rapidformer.state import StepFunctions
from rapidformer.templates import DataBundle, Finetuner, Pretrainer, Trainer

__version__ = "0.1.0"

__all__ = [
    "DataBundle",
    "Finetuner",
    "Pretrainer",
    "RapidformerConfig",
    "RapidformerEngine",
    "StepFunctions",
    "Trainer",
    "parse_args",
]
