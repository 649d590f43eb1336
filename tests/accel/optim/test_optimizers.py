"""LAMB matches a reference LAMB and Adam; fused and multi-tensor AdamW match torch's default
AdamW; the plan names the implementation; the factory serves sharded optimizers."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rapidformer import RapidformerConfig
from rapidformer.accel.optim.lamb import Lamb
from rapidformer.accel.optim.optimizers import build_optimizer, optimizer_factory, parameter_groups
from rapidformer.testing import MarkovLMDataset, TinyTransformerLM, lm_loss, pad_collate
from tests.helpers.trainers import read_losses, tiny_trainer

STEPS = 20


def _model() -> TinyTransformerLM:
    torch.manual_seed(0)
    model = TinyTransformerLM(hidden=64, layers=2, heads=4, max_positions=32, dropout=0.0)
    with torch.no_grad():  # non-trivial norm parameters, so their trust ratios are not all 1
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


_GRADIENTS: list[list[torch.Tensor]] = []


def _gradients() -> list[list[torch.Tensor]]:
    """STEPS gradients of the model's loss on different batches, taken at the initial weights:
    every optimizer sees the same sequence, so parameters differ only by the optimizers'
    arithmetic (with training feedback, Adam amplifies rounding differences where |g| ~ eps)."""
    if not _GRADIENTS:
        model = _model()
        data = MarkovLMDataset(8 * STEPS, min_length=16, max_length=16, seed=3)
        for step in range(STEPS):
            batch = pad_collate([data[8 * step + i] for i in range(8)])
            model.zero_grad(set_to_none=True)
            lm_loss(model, batch)["loss"].backward()
            _GRADIENTS.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    return _GRADIENTS


def _train(
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
) -> dict[str, torch.Tensor]:
    """Parameters after STEPS optimizer steps with the recorded gradients."""
    model = _model()
    optimizer = make_optimizer(model)
    for grads in _gradients():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _moved(a: dict[str, torch.Tensor]) -> float:
    start = dict(_model().named_parameters())
    return max((a[k] - start[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("decoupled", [False, True], ids=["decay-in-update", "decoupled-decay"])
def test_lamb_matches_pytorch_optimizer_lamb(decoupled: bool) -> None:
    """pytorch-optimizer's Lamb corrects neither moment inside the update but, by default,
    divides the final step by 1 - beta1^t (``adam_debias=True`` turns that off); it clamps
    ||w|| at 10 (lifted here) and divides by ||u|| + eps (changes steps by ~lr * eps relative,
    far below the tolerance). Ours runs with ``bias_correction=False``. Its
    ``weight_decouple=False`` adds wd * w to the update (our "update" mode); True shrinks w
    first (our "decoupled" mode). Every tensor gets a trust ratio on both sides."""
    reference_lamb = pytest.importorskip("pytorch_optimizer").Lamb
    lr, decay = 1e-2, 0.1

    def reference(model: nn.Module) -> torch.optim.Optimizer:
        groups = [{k: v for k, v in g.items() if k != "trust_ratio"} for g in _groups(model)]
        opt = reference_lamb(
            groups, lr=lr, weight_decay=decay, weight_decouple=decoupled, eps=1e-6, adam_debias=True
        )
        opt.clamp = math.inf
        return opt

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        groups = [{**g, "trust_ratio": True} for g in _groups(model)]
        mode = "decoupled" if decoupled else "update"
        return Lamb(
            groups, lr=lr, weight_decay=decay, eps=1e-6, bias_correction=False,
            weight_decay_mode=mode,
        )  # fmt: skip

    theirs, mine = _train(reference), _train(ours)
    assert _moved(mine) > 1e-2  # the comparison is not trivially between unchanged weights
    assert _max_diff(mine, theirs) <= 1e-6


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return parameter_groups(model, 0.1)


def test_lamb_without_trust_ratio_and_decay_is_adam_with_bias_correction() -> None:
    """Checks the bias correction (which the reference above does not have) against Adam."""
    lr = 1e-2

    def adam(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=lr, eps=1e-6, foreach=False)

    def lamb(model: nn.Module) -> torch.optim.Optimizer:
        return Lamb(model.parameters(), lr=lr, eps=1e-6, weight_decay=0.0, trust_ratio=False)

    assert _max_diff(_train(lamb), _train(adam)) <= 1e-6


@pytest.mark.parametrize("variant", ["fused", "foreach"])
def test_fast_adamw_matches_the_default_for_loop_adamw(variant: str) -> None:
    def make(**kwargs: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
        return lambda model: torch.optim.AdamW(_groups(model), lr=1e-2, **kwargs)

    default = _train(make(foreach=False))
    fast = _train(make(**{variant: True}))
    assert _moved(default) > 1e-2
    assert _max_diff(fast, default) <= 1e-6


def test_lamb_is_built_and_named_in_the_plan() -> None:
    trainer = tiny_trainer("--train-iters", "1", "--optimizers", "apex_lamb")
    state = trainer.engine.compose(trainer.build_model())
    assert isinstance(state.optimizer, Lamb)
    no_decay = state.optimizer.param_groups[1]
    assert no_decay["weight_decay"] == 0.0 and no_decay["trust_ratio"] is False
    plan = [str(step) for step in state.plan]
    assert any("rapidformer Lamb (torch._foreach multi-tensor)" in p for p in plan), plan


def test_lamb_trains_the_demo_model(tmp_path: Path) -> None:
    # LAMB steps are relative to each tensor's norm, so its learning rates run higher than
    # AdamW's. Measured: mean loss of steps 1-5 4.21 -> steps 31-40 2.88 (AdamW at 3e-3: 3.37).
    trainer = tiny_trainer(
        "--train-iters", "40", "--optimizers", "apex_lamb", "--lr", "2e-2", "--save", str(tmp_path)
    )  # fmt: skip
    trainer.fit()
    losses = read_losses(tmp_path)
    first = sum(losses[i] for i in range(1, 6)) / 5
    last = sum(losses[i] for i in range(31, 41)) / 10
    assert last < first - 0.8, losses


def test_factory_gives_a_class_and_kwargs_for_sharded_optimizers() -> None:
    config = RapidformerConfig.from_dict({"lr": 1e-3, "optimizers": "apex_lamb"})
    cls, kwargs, description = optimizer_factory(config, torch.device("cpu"))
    assert cls is Lamb and kwargs == {"lr": 1e-3, "weight_decay": config.training.weight_decay}
    assert "Lamb" in description
    config = RapidformerConfig.from_dict({"lr": 1e-3})
    cls, kwargs, description = optimizer_factory(config, torch.device("cpu"))
    assert cls is torch.optim.AdamW and kwargs["fused"] is True
    # float64 has a fused CPU kernel too; a dtype without one falls back to foreach.
    _, kwargs, description = optimizer_factory(config, torch.device("cpu"), torch.int64)
    assert kwargs.get("foreach") is True and "foreach" in description
    optimizer, _ = build_optimizer(nn.Linear(3, 3), config, torch.device("cpu"))
    assert all("trust_ratio" not in g for g in optimizer.param_groups)


def _sharded_lamb(kind: str, out: str) -> None:
    """One rank of a 2-rank run: 5 LAMB steps with FSDP2 or ZeroRedundancyOptimizer, each
    rank on half of the batch; rank 0 saves the full parameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = RapidformerConfig.from_dict({"lr": 1e-2, "optimizers": "apex_lamb"})
    cls, kwargs, _ = optimizer_factory(config, torch.device("cpu"))
    decay = config.training.weight_decay
    model = _model()
    if kind == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # replaces the parameters: take the groups afterwards
        optimizer: torch.optim.Optimizer = cls(parameter_groups(model, decay), **kwargs)
    else:
        groups = parameter_groups(model, decay)
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, **kwargs)
        optimizer.add_param_group(groups[1])
    batch = _sharded_batch()
    for _ in range(5):
        optimizer.zero_grad()
        model(batch[2 * rank : 2 * rank + 2]).float().pow(2).mean().backward()
        optimizer.step()
    full = {n: getattr(p, "full_tensor", p.detach)().detach() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({n.removeprefix("module."): t for n, t in full.items()}, out)
    dist.destroy_process_group()


def _sharded_batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["fsdp2", "zero"])
def test_lamb_as_the_inner_optimizer_of_sharding_equals_one_process(
    kind: str, tmp_path: Path
) -> None:
    from rapidformer.testing import run_distributed

    out = tmp_path / "params.pt"
    run_distributed(_sharded_lamb, 2, kind, str(out))
    sharded = torch.load(out)
    model = _model()
    config = RapidformerConfig.from_dict({"lr": 1e-2, "optimizers": "apex_lamb"})
    optimizer, _ = build_optimizer(model, config, torch.device("cpu"))
    for _ in range(5):
        optimizer.zero_grad()
        model(_sharded_batch()).float().pow(2).mean().backward()
        optimizer.step()
    single = {n: p.detach() for n, p in model.named_parameters()}
    assert _moved(single) > 1e-3
    assert _max_diff(sharded, single) <= 1e-5


def test_lamb_state_resumes_exactly(tmp_path: Path) -> None:
    flags = ("--train-iters", "10", "--save-interval", "5", "--optimizers", "apex_lamb")
    first, second = tmp_path / "first", tmp_path / "second"
    tiny_trainer(*flags, "--save", str(first)).fit()
    tiny_trainer(*flags, "--save", str(second), "--load", str(first / "iter_0000005")).fit()
    assert sorted(read_losses(second)) == [6, 7, 8, 9, 10]
    assert all(read_losses(second)[s] == read_losses(first)[s] for s in range(6, 11))


def test_compiled_lamb_equals_the_multi_tensor_lamb() -> None:
    """torch.compile of the same update (what runs on CUDA): within 1e-6 over steps with a
    changing float LR, a device-tensor LR and a skipped step; once those cases have compiled,
    later steps compile nothing new."""
    from torch._dynamo.utils import counters

    def build(compiled: bool) -> tuple[nn.Module, Lamb]:
        torch.manual_seed(0)
        model = TinyTransformerLM(hidden=32, layers=2, heads=4, max_positions=32)
        return model, Lamb(parameter_groups(model, 0.01), lr=1e-2, compiled=compiled)

    torch._dynamo.reset()
    counters.clear()
    (plain_model, plain), (fast_model, fast) = build(False), build(True)
    generator = torch.Generator().manual_seed(3)
    graphs_before_last_steps = 0
    for step in range(8):
        if step == 6:
            graphs_before_last_steps = counters["stats"]["unique_graphs"]
        grads = [torch.randn(p.shape, generator=generator) for p in plain_model.parameters()]
        for model, optimizer in ((plain_model, plain), (fast_model, fast)):
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad.clone()
            for group in optimizer.param_groups:
                # floats, then device tensors (rapidformer's schedule), as a run would
                group["lr"] = 1e-2 / (step + 1) if step < 3 else torch.tensor(1e-3)
            if step == 4:
                optimizer.found_inf = torch.ones(())  # type: ignore[attr-defined]
            optimizer.step()
            if step == 4:
                del optimizer.found_inf  # type: ignore[attr-defined]
    gap = max(
        (a - b).abs().max().item()
        for a, b in zip(plain_model.parameters(), fast_model.parameters(), strict=True)
    )
    assert gap <= 1e-6, gap
    assert counters["stats"]["unique_graphs"] == graphs_before_last_steps > 0, counters["stats"]
    torch._dynamo.reset()
