"""What the device a model runs on computes fast: the facts the ``auto`` backend decides by.

torch runs fp16 and bf16 everywhere, but only some hardware runs them fast. On a CPU with AVX2
only (no AVX-512, no AMX), native bf16 training steps are many times slower than fp32, while
emulating bf16 (fp32 kernels, outputs rounded) costs far less (benchmarks/RESULTS.md, figure
F22). On such CPUs torch has no oneDNN 16-bit path and falls back to ATen's generic kernels.
The instructions that make 16-bit matmuls and convolutions fast on a CPU are:

* bf16: AVX512-BF16 (``vdpbf16ps``, Cooper Lake, Zen 4 and later) or AMX-BF16 (Sapphire
  Rapids and later: large bf16 GEMMs much faster than fp32 there, figure F23); on Arm, the
  BF16 extension (``BFMMLA``, Neoverse V1/N2, Graviton 3), which torch's oneDNN/ACL path checks for.
* fp16: none, for training. torch sends fp16 convolutions and matmuls to oneDNN where the CPU
  has AVX512-FP16 or AMX-FP16 (``mkldnn_fp16_device_check``), but fp16 convolution *backward*
  stays a reference kernel even there, many times slower than fp32 (figure F42; without
  AVX512-FP16, figure F24). So ``auto`` emulates fp16 on every CPU; ``b=native`` still runs it.

On CUDA, tensor cores run fp16 from compute capability 7.0 (Volta) and bf16 from 8.0 (Ampere).

The facts are read from torch (``torch.cpu.get_capabilities()``, cpuinfo's view of CPUID and of
Arm's HWCAPs; ``torch.backends.cpu.get_cpu_capability()``; ``torch.cuda.get_device_capability``),
never from a CPU's name, and not from a timing by default: a micro-benchmark on a loaded
machine could choose differently from one run to the next, and the backend changes a run's
bits. A caller holding a sample batch may have the choice checked by timing the model's own
steps (``Precision.setup(model, example=inputs)``, :mod:`lowprec.training.backends.probe`).
:func:`native_speed` takes the facts as data, so every rule is testable on any machine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..numerics.formats import BF16, FP16, FP32, Format

__all__ = ["DeviceFacts", "device_facts", "native_speed", "CPU_FEATURES"]

# the CPU features the rules below read (cpuinfo's names, as torch.cpu.get_capabilities gives)
CPU_FEATURES = ("avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_fp16", "bf16", "sve_bf16", "fp16_arith")

# format -> the features any one of which gives fast kernels, and how they are written
_FAST_CPU = {
    BF16: (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"), ("bf16", "Arm BF16"),
           ("sve_bf16", "Arm SVE BF16")),
}
# formats whose torch CPU kernels are slow for training whatever the CPU has, and why: with
# the features of the first entry, the first reason; without them, the second (fp16: oneDNN
# takes fp16 matmuls with AVX512-FP16 or AMX-FP16, its convolution backward never)
_SLOW_CPU = {FP16: (("avx512_fp16", "amx_fp16"),
                    "torch's CPU fp16 convolution backward is a reference kernel, even with "
                    "AVX512-FP16 (a LeNet-5 step 52x fp32's on an Intel Xeon with it)",
                    "no AVX512-FP16 or AMX-FP16: torch's fp16 matmuls and convolutions run "
                    "generic kernels (an MLP step 24x fp32's on an AMD EPYC with AVX2)")}
# format -> the CUDA compute capability from which tensor cores run it
_FAST_CUDA = {FP16: (7, 0), BF16: (8, 0)}


@dataclass(frozen=True)
class DeviceFacts:
    """What is known of a device: its type (``"cpu"``, ``"cuda"``...), its name, torch's
    capability string (CPU: ``"AVX2"``, ``"AVX512"``...; CUDA: ``"sm_80"``), the CPU features
    of :data:`CPU_FEATURES` it has, and a CUDA device's compute capability."""

    type: str
    name: str = ""
    capability: str = ""
    features: frozenset = frozenset()
    cuda_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", frozenset(self.features))

    def describe(self) -> str:
        """One line: ``"CPU AMD EPYC (AVX2)"``, ``"CUDA NVIDIA H100 (sm_90)"``."""
        kind = self.type.upper() if self.type in ("cpu", "cuda") else self.type
        parts = [kind] + ([self.name] if self.name else [])
        return " ".join(parts) + (f" ({self.capability})" if self.capability else "")

    def to_json(self) -> dict:
        return {"type": self.type, "name": self.name, "capability": self.capability,
                "features": sorted(self.features)}


def _cpu_features() -> tuple[str, frozenset]:
    """(cpu name, the features of CPU_FEATURES present), from torch's cpuinfo; from
    /proc/cpuinfo's flags where torch has no ``torch.cpu.get_capabilities``."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        c = dict(caps())
        return str(c.get("cpu_name", "")), frozenset(f for f in CPU_FEATURES if c.get(f) is True)
    flags: set[str] = set()
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "model name" and not name:
                    name = value.strip()
    except OSError:
        pass
    # /proc/cpuinfo spells a few of them differently from cpuinfo
    aliases = {"avx512f": "avx512_f", "fphp": "fp16_arith", "svebf16": "sve_bf16"}
    found = {aliases.get(f, f) for f in flags}
    return name, frozenset(f for f in CPU_FEATURES if f in found)


@functools.lru_cache(maxsize=None)
def _facts(kind: str, index: int | None) -> DeviceFacts:
    if kind == "cpu":
        name, features = _cpu_features()
        return DeviceFacts("cpu", name, torch.backends.cpu.get_cpu_capability(), features)
    if kind == "cuda":
        i = torch.cuda.current_device() if index is None else index
        major, minor = torch.cuda.get_device_capability(i)
        return DeviceFacts("cuda", torch.cuda.get_device_name(i), f"sm_{major}{minor}",
                           cuda_capability=(major, minor))
    return DeviceFacts(kind)


def device_facts(device: torch.device | str) -> DeviceFacts:
    """The facts of ``device`` (asked once per device and process, when a model is set up)."""
    device = torch.device(device)
    return _facts(device.type, device.index)


def native_speed(fmt: Format, facts: DeviceFacts) -> tuple[bool, str]:
    """Whether torch's kernels for ``fmt``'s dtype are fast on the device ``facts`` describe,
    and why, in a few words (``(False, "no AVX512-BF16 or AMX-BF16")``). fp32 always is; a
    device other than a CPU or a CUDA GPU runs its own kernels, of which nothing is known here:
    fast."""
    if fmt == FP32:
        return True, "fp32"
    if facts.type == "cpu":
        if fmt in _SLOW_CPU:
            features, with_them, without = _SLOW_CPU[fmt]
            return False, with_them if facts.features & set(features) else without
        rules = _FAST_CPU.get(fmt)
        if rules is None:
            return False, f"{fmt} has no torch kernels"
        have = [label for feature, label in rules if feature in facts.features]
        if have:
            return True, " and ".join(have)
        labels = [label for _, label in rules]
        return False, f"no {', '.join(labels[:-1])} or {labels[-1]}"
    if facts.type == "cuda":
        need = _FAST_CUDA.get(fmt)
        if need is None:
            return False, f"{fmt} has no torch kernels"
        have = facts.cuda_capability
        if have is None or tuple(have) >= need:
            return True, f"tensor cores ({facts.capability or 'CUDA'})"
        return False, f"no {fmt} tensor cores below sm_{need[0]}{need[1]} ({facts.capability})"
    return True, f"{facts.type}'s own kernels"
