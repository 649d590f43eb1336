"""What the device offers: its peak TFLOP/s in the run's precision (the MFU denominator) and
whether its matrix units support bf16/fp16 at all, with a hint when the chosen precision will
be slower than fp32 on it.

GPUs: a table of dense (no sparsity) tensor-core peaks by device name, from the vendors' data
sheets; fp32 counts TF32 when torch allows it (``torch.set_float32_matmul_precision``). CPUs
differ too much for a table (bf16 is several times slower than fp32 on an AVX2-only CPU and
faster on one with avx512_bf16): a short matrix-multiply probe measures this one, and its rate
stands in for the peak. ``--peak-tflops`` overrides both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense TFLOP/s per device: bf16, fp16, tf32, fp32 (0: not supported in hardware).
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("B200", {"bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 80}),
    ("H200", {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),
    ("H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    ("H100", {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),
    ("H800", {"bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),
    ("A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("A800", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("L40S", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    ("L4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    ("A10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}),
    ("V100", {"bf16": 0, "fp16": 125, "tf32": 0, "fp32": 15.7}),
    ("T4", {"bf16": 0, "fp16": 65, "tf32": 0, "fp32": 8.1}),
    ("MI300X", {"bf16": 1307, "fp16": 1307, "tf32": 654, "fp32": 163}),
)
"""Matched in order against ``torch.cuda.get_device_name()`` (first substring wins)."""

CPU_MATRIX_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
"""CPU flags that decide how fast fp32 / bf16 / fp16 matrix products run."""


@dataclass(frozen=True)
class Peak:
    tflops: float | None
    source: str
    """Where the number comes from (for the plan)."""


def gpu_peak(name: str, precision: str) -> float | None:
    """The table's dense peak of the GPU ``name`` in ``precision`` (None: not in the table,
    or no hardware support)."""
    key = precision
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    for pattern, peaks in GPU_PEAKS:
        if pattern.lower() in name.lower():
            return peaks[key] or None
    return None


def cpu_features() -> list[str]:
    """The matrix-relevant flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    present = set(flags.partition(":")[2].split())
    return [flag for flag in CPU_MATRIX_FEATURES if flag in present]


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def probe_cpu_tflops(precision: str, size: int = 1024, seconds: float = 0.15) -> float:
    """Measured TFLOP/s of ``size``^2 matrix products in ``precision`` on this CPU (about
    ``seconds`` long; the threads torch uses now)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(_DTYPES[precision])
    b = torch.randn(size, size, generator=generator).to(_DTYPES[precision])
    a @ b  # warm-up: the first product pays for allocation and kernel choice
    runs, started = 0, time.perf_counter()
    while True:
        a @ b
        runs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds or runs >= 1000:
            return 2 * size**3 * runs / elapsed / 1e12


def device_peak(device: torch.device, precision: str, override: float | None) -> Peak:
    """One device's peak TFLOP/s for MFU; see the module docstring."""
    if override is not None:
        return Peak(override, "--peak-tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        value = gpu_peak(name, precision)
        if value is None:
            return Peak(None, f"{name} is not in the table: pass --peak-tflops for MFU")
        return Peak(value, f"{name} {precision} dense peak (data sheet)")
    if device.type == "cpu":
        value = probe_cpu_tflops(precision)
        if precision != "fp32" and precision_support(device, precision)[1] is not None:
            # No matrix units for it here: its products are emulated through fp32 units,
            # while a run's autocast keeps other work in fp32, so a peak probed in it alone
            # sits too low (MFU came out above 1). The fp32 units bound both.
            fp32 = probe_cpu_tflops("fp32")
            if fp32 > value:
                return Peak(
                    fp32,
                    f"measured: fp32 1024^2 matmul probe on this CPU ({precision} has no "
                    f"matrix units here; its own probe, {value:.3g}, sits below what a run "
                    "reaches)",
                )
        return Peak(value, f"measured: {precision} 1024^2 matmul probe on this CPU")
    return Peak(None, f"no peak known for {device.type}: pass --peak-tflops for MFU")


def precision_support(device: torch.device, precision: str) -> tuple[str, str | None]:
    """What the device's matrix units support, and a hint when ``precision`` will likely be
    slower than fp32 on it (None when it should not be)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        bf16 = major >= 8
        text = f"{name} (sm_{major}{minor}): fp16 tensor cores, bf16 {'yes' if bf16 else 'no'}"
        if precision == "bf16" and not bf16:
            return text, "bf16 has no tensor-core support before sm_80: use --precision fp16"
        if precision == "fp32":
            return text, "fp32 runs without fp16/bf16 tensor cores: --precision bf16 is faster"
        return text, None
    features = cpu_features()
    text = (
        f"CPU matrix features: {', '.join(features) or 'none of ' + ', '.join(CPU_MATRIX_FEATURES)}"
    )
    if precision == "bf16" and not _fast_bf16(features):
        return text, (
            "bf16 has no hardware support on this CPU (no avx512_bf16 or AMX): expect it "
            "slower than fp32 (benchmarks/precision.py measures it)"
        )
    if precision == "fp16" and "amx_fp16" not in features:
        # avx512_fp16 alone does not make fp16 faster than fp32 (benchmarks/precision.py), so
        # only AMX-FP16 counts as a fast path.
        has = "avx512_fp16 but no AMX-FP16" if "avx512_fp16" in features else "no AMX-FP16"
        better = " (--precision bf16 is faster here)" if _fast_bf16(features) else ""
        return text, (
            f"fp16 has no fast matrix path on this CPU ({has}): expect it slower than fp32{better}"
        )
    return text, None


def _fast_bf16(features: list[str]) -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & set(features))
