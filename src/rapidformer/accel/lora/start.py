"""The adapters' values: their first ones (fresh, or an adapter the run continues from) and
the fingerprint of the base they are trained on."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from rapidformer.accel.lora.layer import (
    ADAPTER_PARAMETER,
    AdapterShape,
    adapted_layers,
    features,
    init_adapter,
)
from rapidformer.accel.lora.peft_format import read_base, read_tensors, tensor_shapes
from rapidformer.config.root import RapidformerConfig
from rapidformer.distributed.tensors import is_dtensor
from rapidformer.errors import ConfigError
from rapidformer.models.fingerprint import weights_fingerprint
from rapidformer.models.stages import assign_piece


def start_adapters(model: nn.Module, config: RapidformerConfig) -> None:
    """The adapters' first values: the ``--lora-adapter``'s, else fresh ones drawn from a
    generator seeded by ``--seed`` and the layer's path (the same values on any layout)."""
    for path, layer in adapted_layers(model).items():
        seed = (config.training.seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63
        init_adapter(layer, torch.Generator().manual_seed(seed))
    source = config.adapters.lora_adapter
    if source is not None:
        load_adapter_tensors(model, read_tensors(source), source)


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy an adapter's tensors into the adapted model; every adapter tensor the model has
    must come, with its shape."""
    own = dict(model.named_parameters())
    expected = {n for n in own if own[n].requires_grad}
    missing = sorted(expected - set(tensors))
    unknown = sorted(set(tensors) - expected)  # frozen base weights are not the adapter's
    wrong = [
        f"{n} is {tuple(t.shape)} there, {tuple(own[n].shape)} in the model"
        for n, t in tensors.items()
        if n in own and tuple(t.shape) != tuple(own[n].shape)
    ]
    if missing or unknown or wrong:
        problems = (
            [f"the model's {n} is not in it" for n in missing[:3]]
            + [
                f"its {n} is no adapter or trained module of {type(model).__name__}"
                for n in unknown[:3]
            ]
            + wrong[:3]
        )
        raise ConfigError.single(
            "--lora-adapter", source,
            "does not fit this model (an adapter of another base or another task?): "
            + "; ".join(problems),
            "pass the adapter made for this --pretrained-model-name-or-path",
        )  # fmt: skip
    with torch.no_grad():
        for name, tensor in tensors.items():
            assign_piece(own[name], tensor.to(own[name].dtype))


def base_fingerprint(model: nn.Module, saved: list[str]) -> str:
    """SHA-256 of the frozen base's parameters (not the modules trained in full: a new head
    starts random, and checkpoints hold it): a checkpoint of adapters refuses to resume on
    another base."""
    return weights_fingerprint(
        (name, parameter.full_tensor() if is_dtensor(parameter) else parameter)
        for name, parameter in model.named_parameters()
        if not any(name.startswith(s + ".") for s in saved) and ADAPTER_PARAMETER not in name
    )


def check_adapter_file(
    model: nn.Module, targets: list[str], shape: AdapterShape, source: str, fingerprint: str
) -> None:
    """Before any adapter is made: the file's tensors have the shapes this model's layers
    give them (an ``r`` no file holds allocates nothing), and the adapter was trained on this
    base, where it recorded its base (rapidformer's adapters do; PEFT's do not)."""
    modules = dict(model.named_modules())
    shapes = tensor_shapes(source)
    wrong = []
    for path in targets:
        inputs, outputs = features(modules[path])
        expected: dict[str, tuple[int, ...]] = {
            f"{path}.lora_A.weight": (shape.rank, inputs),
            f"{path}.lora_B.weight": (outputs, shape.rank),
        }
        if shape.variant == "dora":
            expected[f"{path}.lora_magnitude_vector"] = (outputs,)
        wrong += [
            f"{name} is {shapes[name]} there, {want} for this model"
            for name, want in expected.items()
            if name in shapes and shapes[name] != want
        ]
    if wrong:
        raise ConfigError.single(
            "--lora-adapter", source, f"does not fit this model: {'; '.join(wrong[:3])}",
            "pass the adapter made for this --pretrained-model-name-or-path",
        )  # fmt: skip
    recorded = read_base(source)
    if recorded is not None and fingerprint and recorded["sha256"] != fingerprint:
        raise ConfigError.single(
            "--lora-adapter", source,
            f"was trained on another base: {recorded.get('source')} (sha256 "
            f"{recorded['sha256'][:12]}), and this run's base is {fingerprint[:12]}",
            "pass the base it was trained on as --pretrained-model-name-or-path",
        )  # fmt: skip


def refuse_non_finite_base(model: nn.Module, source: str) -> None:
    """A frozen base holding a NaN or an infinity makes every step non-finite: the adapters
    would learn nothing, so it is refused before anything trains (``source``: where it was
    read from)."""
    for name, parameter in model.named_parameters():
        local = parameter.detach()
        local = local.to_local() if is_dtensor(local) else local
        plain = type(local) is torch.Tensor and local.is_floating_point() and local.numel()
        if plain and not bool(torch.isfinite(local).all()):
            raise ConfigError.single(
                "--pretrained-model-name-or-path", source,
                f"holds a NaN or an infinity in {name}: adapters on it would learn nothing "
                "(every step non-finite)",
                "start from a base with finite weights",
            )  # fmt: skip
