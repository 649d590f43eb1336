"""The composition engine: applies the enabled accelerations in one canonical order and runs
each optimizer step through the train state's slots."""

from rapidformer.engine.engine import RapidformerEngine
from rapidformer.engine.loops import steps_of
from rapidformer.engine.validation import validate
from rapidformer.state import PlanStep, TrainState
from rapidformer.step_io import StepFunctions, StepResult

__all__ = [
    "PlanStep",
    "RapidformerEngine",
    "StepFunctions",
    "StepResult",
    "TrainState",
    "steps_of",
    "validate",
]
