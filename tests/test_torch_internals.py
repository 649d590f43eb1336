"""The few private torch members rapidformer relies on (each used in one function that says
why no public API serves): these tests fail with a clear message when a torch release renames
or reshapes one, instead of letting a run misbehave."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from rapidformer.step.scaler_state import found_inf_flags, inverse_scale, record_unscaled


def test_grad_scaler_internals_the_stepper_uses_still_exist() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    for name in ("_found_inf_per_device", "_per_optimizer_states", "_scale"):
        assert hasattr(scaler, name), (
            f"torch {torch.__version__}: GradScaler.{name} is gone; update "
            "rapidformer/step/scaler_state.py (the stepper's fp16 overflow agreement)"
        )
    from torch.amp.grad_scaler import OptState

    assert hasattr(OptState, "UNSCALED"), "torch.amp.grad_scaler.OptState.UNSCALED is gone"


def test_scaler_state_reads_and_records_what_unscale_would() -> None:
    """Our record of an unscale elsewhere is what the scaler's own step() then trusts: a
    recorded overflow skips the update, a clean one applies it, and the inverse scale is
    1/scale as a tensor."""
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(weight.sum()).backward()
    assert float(inverse_scale(scaler)) == pytest.approx(1 / 8)
    assert weight.grad is not None
    weight.grad.mul_(inverse_scale(scaler))  # unscaled "elsewhere"
    record_unscaled(scaler, optimizer, {weight.device: torch.ones(())})  # an overflow
    assert [float(f) for f in found_inf_flags(scaler, optimizer)] == [1.0]
    scaler.step(optimizer)
    assert torch.equal(weight.detach(), torch.ones(2)), "an overflow step must not move"
    scaler.update()
    assert scaler.get_scale() == 4.0

    optimizer.zero_grad()
    scaler.scale(weight.sum()).backward()
    weight.grad.mul_(inverse_scale(scaler))
    record_unscaled(scaler, optimizer, {weight.device: torch.zeros(())})
    scaler.step(optimizer)
    assert torch.allclose(weight.detach(), torch.zeros(2)), "1 - lr 1 x grad 1"


def test_pipeline_stage_still_infers_shapes_through_the_method_we_wrap() -> None:
    assert hasattr(PipelineStage, "_forward_metadata_inference"), (
        f"torch {torch.__version__}: PipelineStage._forward_metadata_inference is gone; "
        "update _uncounted_inference in rapidformer/accel/pipeline/schedule.py (MoE layers must "
        "not count the stage's shape-inference forward)"
    )


def test_fused_optimizer_device_list_still_exists() -> None:
    from torch.utils import _foreach_utils

    assert callable(getattr(_foreach_utils, "_get_fused_kernels_supported_devices", None)), (
        "torch.utils._foreach_utils._get_fused_kernels_supported_devices is gone; update "
        "_fused_adamw_supported in rapidformer/accel/optim/optimizers.py"
    )
    assert "cpu" in _foreach_utils._get_fused_kernels_supported_devices()


def test_dynamo_still_counts_graphs_and_reports_recompile_limits_where_we_read_them() -> None:
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    from rapidformer.accel.compile.watch import _DYNAMO_LOGGER, compiled_graphs

    assert isinstance(counters["stats"]["unique_graphs"], int), (
        "torch._dynamo.utils.counters['stats']['unique_graphs'] is gone; update "
        "compiled_graphs in rapidformer/accel/compile/watch.py"
    )
    assert compiled_graphs() == counters["stats"]["unique_graphs"]
    assert convert_frame.log.name == _DYNAMO_LOGGER, (
        "dynamo reports recompile-limit hits on another logger now; update _DYNAMO_LOGGER in "
        "rapidformer/accel/compile/watch.py"
    )
