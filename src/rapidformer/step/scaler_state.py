"""The few ``torch.amp.GradScaler`` internals the stepper needs, kept in one place.

torch 2.13's GradScaler has no public way to (a) hand back an optimizer's found-inf flags as
device tensors (``unscale_`` records them; the public ``step`` reads them to the host) so that
they can be summed over every rank before anyone decides, nor (b) record that gradients were
unscaled elsewhere (mixed DTensor and plain gradients, which its own kernel refuses). Each use
below is one short function; tests/test_torch_internals.py fails with a clear message if
torch renames any of them.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState


def found_inf_flags(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """The found-inf flags ``unscale_`` recorded for ``optimizer``, one device tensor per
    device (summing them into one another in place is what agreeing over ranks needs)."""
    return list(scaler._found_inf_per_device(optimizer).values())


def inverse_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """1 / the current loss scale, as a device tensor (``get_scale()`` would read it)."""
    scale = scaler._scale
    assert scale is not None, "the scaler has scaled no loss yet"
    return scale.double().reciprocal().float()


def record_unscaled(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    found_inf: dict[torch.device, torch.Tensor],
) -> None:
    """Tell the scaler that ``optimizer``'s gradients were unscaled (and checked) elsewhere,
    with these found-inf flags, as if ``unscale_`` had done it."""
    record = scaler._per_optimizer_states[id(optimizer)]
    record["found_inf_per_device"] = found_inf
    record["stage"] = OptState.UNSCALED
