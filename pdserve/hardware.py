"""What the machine computes natively, and the model dtype ``--dtype auto`` picks from it.

Design origin: vLLM's ``--dtype auto`` (on CUDA FP16 for FP32 and FP16 checkpoints, BF16 for
BF16 ones; on CPU it narrows FP32 and FP16 checkpoints to BF16: "Downcasting torch.float32 to
torch.bfloat16" in its log), with a CPU rule that looks at the machine: any checkpoint, float32
included, runs in bfloat16 where the CPU computes it natively, with AMX tiles (``amx_bf16``:
Intel Sapphire Rapids and later) or AVX-512 BF16 (``avx512_bf16``: e.g. AMD Zen 4) and the
engine's in-place paged attention kernel (whose bfloat16 path is as fast as its float32 one; the
gather + SDPA fallback's bfloat16 path is several times slower than float32's); elsewhere it runs
in float32, where bfloat16 would be emulated and slower. bfloat16 keeps float32's exponent range,
so narrowing costs precision (8 bits of mantissa), not range: tests/integration's golden test
bounds what it changes on SmolLM2. ``--dtype float32`` keeps a float32 checkpoint as it is.
Measured on the AMD EPYC development machine (Zen 4: ``avx512_bf16``, no AMX), ``pdserve up``
on SmolLM2, chat 256 in / 64 out: 49.9 / 157.8 / 206.9 output tokens/s at concurrency 1 / 8 / 32
in bfloat16 against 34.3 / 111.0 / 143.0 in float32 (docs/benchmarks.md); before the kernel, the
compiled decode step at batch 8 took 71 ms in bfloat16 against 51 ms in float32. Torch-free
unless a CUDA device is asked about.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
"""The ``/proc/cpuinfo`` flags that decide pdserve's CPU paths (what ``pdserve doctor`` prints)."""


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``"unknown CPU"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def checkpoint_dtype(model_path: Path) -> str | None:
    """The dtype a model folder's ``config.json`` declares (``dtype``, or the older
    ``torch_dtype``), e.g. ``"bfloat16"``; None when it declares none or cannot be read."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


@dataclass(frozen=True)
class DtypeChoice:
    """The model dtype to run in (``float32``, ``bfloat16`` or ``float16``) and why."""

    dtype: str
    reason: str


def choose_dtype(
    requested: str,
    model_path: Path,
    device: str,
    flags: frozenset[str] | None = None,
    *,
    in_place: bool = True,
) -> DtypeChoice:
    """Resolve ``model.dtype`` (``requested``; ``"auto"`` by the rules of the module docstring,
    anything else as given) for a model folder on ``device`` (``cpu``, ``cuda``, ``cuda:N``).
    ``flags``: the CPU's (default: this machine's); ``in_place``: whether the in-place paged
    attention kernel serves this CPU engine."""
    if requested != "auto":
        return DtypeChoice(requested, "set by model.dtype / --dtype")
    ckpt = checkpoint_dtype(model_path)
    if device.startswith("cuda"):
        if ckpt == "bfloat16" and _cuda_bf16(device):
            return DtypeChoice("bfloat16", "the checkpoint's bfloat16, native on this GPU")
        return DtypeChoice("float16", f"checkpoint {ckpt or 'dtype unknown'}: float16 on CUDA")
    declared = ckpt or "float32 (none declared)"
    flags = cpu_flags() if flags is None else flags
    if cpu_half_dtype(flags, in_place=in_place) == "bfloat16":
        unit = "AMX (amx_bf16)" if "amx_bf16" in flags else "AVX-512 BF16 (avx512_bf16)"
        narrowed = "" if ckpt == "bfloat16" else ", narrowed as vLLM does (--dtype float32: not)"
        return DtypeChoice("bfloat16", f"checkpoint {declared}{narrowed}; this CPU has {unit}")
    why = "no AMX or AVX-512 BF16" if in_place else "no in-place attention kernel"
    if ckpt not in ("bfloat16", "float16"):
        return DtypeChoice("float32", f"the checkpoint's {declared}; {why} here for bfloat16")
    return DtypeChoice(
        "float32",
        f"checkpoint {ckpt}, but {why} here: bfloat16 would decode slower than float32 (set "
        "--dtype bfloat16 to force it)",
    )


def cpu_half_dtype(flags: frozenset[str], *, in_place: bool = True) -> str:
    """What ``--dtype auto`` runs any checkpoint in on a CPU with ``flags``: ``bfloat16`` with
    AMX (``amx_bf16``), or with AVX-512 BF16 (``avx512_bf16``) when the in-place attention kernel
    serves (``in_place``); else ``float32``."""
    if "amx_bf16" in flags or ("avx512_bf16" in flags and in_place):
        return "bfloat16"
    return "float32"


def _cuda_bf16(device: str) -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
