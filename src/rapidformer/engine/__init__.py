"""The composition engine: applies the enabled accelerations in one canonical order."""

from rapidformer.engine.engine import RapidformerEngine, StepResult
from rapidformer.engine.state import PlanStep, TrainState

__all__ = ["PlanStep", "RapidformerEngine", "StepResult", "TrainState"]
