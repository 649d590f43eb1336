"""CUDA paths of one process: precision, optimizers, compile, checkpointing, MoE kernels.

Each test compares numbers against a reference computed in the same test (fp32 eager, the
per-expert loop, a float64 CPU reference) within a stated tolerance: CUDA kernels differ from
the CPU's and between shapes, so nothing here is bitwise except a skipped step, which must not
move anything at all."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from rapidformer.accel.optim.lamb import Lamb
from rapidformer.step_io import StepFunctions
from tests.helpers.gpu import batches, engine_for, lm_loss, max_difference, tiny_gpt, train

LOW_PRECISION = 5e-2
"""Max |loss - fp32 loss| over 5 steps of the tiny GPT under bf16/fp16 autocast."""


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_tracks_fp32(precision: str) -> None:
    reference, engine, _ = train({})
    engine.close()
    losses, engine, state = train({"precision": precision})
    assert max_difference(losses, reference) <= LOW_PRECISION
    assert (state.precision.grad_scaler is not None) == (precision == "fp16")
    assert any("on the device, no host sync" in str(p) for p in state.plan)
    engine.close()


def test_fp16_overflow_skips_the_step_and_halves_the_scale() -> None:
    _, engine, state = train({"precision": "fp16"}, steps=2)
    assert state.precision.grad_scaler is not None
    scale = state.precision.grad_scaler.get_scale()
    before = [p.detach().clone() for p in state.model.parameters()]
    moments = [v.clone() for s in state.optimizer.state.values() for v in s.values()]  # type: ignore[union-attr]
    engine.backward(lm_loss(state.model, batches(1)[0]) * 1e30)  # overflows in backward
    result = engine.step()
    assert result is not None and result.skipped
    assert state.precision.grad_scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters(), strict=True))
    after = [v for s in state.optimizer.state.values() for v in s.values()]  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(moments, after, strict=True))
    engine.close()


def test_fused_adamw_matches_the_for_loop_adamw() -> None:
    models = [tiny_gpt().cuda() for _ in range(2)]
    fused = torch.optim.AdamW(models[0].parameters(), lr=1e-3, fused=True)
    loop = torch.optim.AdamW(models[1].parameters(), lr=1e-3, foreach=False)
    for ids in batches(5):
        for model, optimizer in zip(models, (fused, loop), strict=True):
            lm_loss(model, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert (a - b).abs().max() <= 1e-5


def test_lamb_on_cuda_matches_lamb_on_the_cpu_and_skips_exactly() -> None:
    gpu_model, cpu_model = tiny_gpt().cuda(), tiny_gpt()
    gpu, cpu = Lamb(gpu_model.parameters(), lr=1e-3), Lamb(cpu_model.parameters(), lr=1e-3)
    for ids in batches(4):
        for model, optimizer, data in ((gpu_model, gpu, ids), (cpu_model, cpu, ids.cpu())):
            lm_loss(model, data).backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(gpu_model.parameters(), cpu_model.parameters(), strict=True):
        assert (a.cpu() - b).abs().max() <= 1e-4  # TF32 off by default: fp32 both sides
    before = [p.detach().clone() for p in gpu_model.parameters()]
    lm_loss(gpu_model, batches(1)[0]).backward()
    gpu.found_inf = torch.ones((), device="cuda")  # type: ignore[attr-defined]
    gpu.step()
    assert all(torch.equal(a, b) for a, b in zip(before, gpu_model.parameters(), strict=True))


def test_activation_checkpointing_keeps_the_losses() -> None:
    reference, engine, _ = train({})
    engine.close()
    losses, engine, state = train({"checkpoint_activations": True})
    assert any("activation checkpointing" in str(p) for p in state.plan)
    assert max_difference(losses, reference) <= 1e-5
    engine.close()


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_gpt_trains_like_eager_without_fallbacks(scope: str) -> None:
    reference, engine, _ = train({})
    engine.close()
    losses, engine, _ = train({"torch_compile": True, "torch_compile_scope": scope})
    assert max_difference(losses, reference) <= 1e-3  # inductor fuses: not bitwise
    metrics = engine.step_metrics()
    assert metrics["compile_graphs"] >= 1 and metrics["compile_fallbacks"] == 0, metrics
    engine.close()


def test_a_hugging_face_llama_compiles_one_block_graph() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=10,  # more than dynamo's recompile limit (8)
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    engine = engine_for(torch_compile=True, precision="bf16")
    state = engine.compose(model)
    functions = StepFunctions(
        train_step=lambda ids: state.model(input_ids=ids, labels=ids).loss,
        weight=lambda ids: ids.numel(),
    )
    for ids in batches(3):
        engine.run_step([ids[:, :-1]], functions)
    assert engine.step_metrics() == {"compile_graphs": 1, "compile_fallbacks": 0}
    assert model.config.use_cache is False
    engine.close()


def test_moe_layer_on_grouped_mm_matches_the_reference() -> None:
    from rapidformer.models.moe import grouped_mm_supported
    from tests.helpers.moe import BATCH, HIDDEN, LENGTH, make_layer, reference

    cuda = torch.device("cuda")
    supported = [
        d for d in (torch.float32, torch.bfloat16) if grouped_mm_supported(d, cuda, (16, 24))
    ]
    dtype = supported[0] if supported else None
    if dtype is None:
        pytest.skip("torch._grouped_mm does not run on this GPU")
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    layer = make_layer(aux_loss_coeff=0.0, topk=2)
    exact = copy.deepcopy(layer).double()  # the float64 reference runs on the CPU
    on_gpu = layer.cuda().to(dtype)
    assert on_gpu.experts.kernel(dtype, torch.device("cuda")) == "grouped_mm"
    x = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(BATCH, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(2))
    x_gpu = x.cuda().to(dtype).requires_grad_()
    out = on_gpu(x_gpu)
    (out.float() * probe.cuda()).sum().backward()
    x_ref = x.double().requires_grad_()
    expected, _, _ = reference(exact, x_ref)
    (expected * probe.double()).sum().backward()
    assert (out.double().cpu() - expected).abs().max() <= tolerance
    assert (x_gpu.grad.double().cpu() - x_ref.grad).abs().max() <= tolerance
    for (name, param), (_, ref) in zip(
        on_gpu.named_parameters(), exact.named_parameters(), strict=True
    ):
        assert (param.grad.double().cpu() - ref.grad).abs().max() <= tolerance, name


def test_packed_rows_keep_each_sample_apart_on_cuda() -> None:
    """A Hugging Face Llama (sdpa) on CUDA, fp32 without TF32: each sample's per-token losses
    in packed rows (the block-diagonal mask built on the device from the collate's sample ids)
    against the sample run alone and unpadded. Within 1e-4: the masked rows take another
    attention kernel than the unmasked samples."""
    pytest.importorskip("transformers")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        assert packed_against_alone("cuda") <= 1e-4
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def packed_against_alone(device: str) -> float:
    """The largest gap between a sample's per-token losses in packed rows and alone."""
    import torch.nn.functional as F
    import transformers

    from rapidformer.data.packing import collate_packed, pack_rows, packed_mask
    from rapidformer.labels import IGNORE_INDEX

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    model.config._attn_implementation = "sdpa"
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 256, (n,), generator=generator).tolist()
               for n in (40, 17, 63, 9, 28, 50)]  # fmt: skip
    rows = pack_rows([{"input_ids": ids} for ids in samples], 64)
    batch = {k: v.to(device) for k, v in collate_packed(rows, 64, pad_id=0).items()}
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"],
            attention_mask=packed_mask(batch["packed_samples"]),
        ).logits[:, :-1].float()  # fmt: skip
        targets = batch["labels"][:, 1:]
        packed = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        alone = {}
        for sample in samples:
            ids = torch.tensor([sample], device=device)
            out = model(input_ids=ids).logits[0, :-1].float()
            alone[tuple(sample)] = F.cross_entropy(out, ids[0, 1:], reduction="none")
    laid_out = []  # each sample's losses, in the order the rows hold the samples
    for row in rows:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["sample"])]
        for start, end in itertools.pairwise(starts):
            laid_out.append(alone[tuple(row["input_ids"][start:end])])
    expected = torch.cat(laid_out)
    learned = packed[targets != IGNORE_INDEX]
    assert learned.shape == expected.shape
    return float((learned - expected).abs().max())
