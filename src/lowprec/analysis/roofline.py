"""Named hardware profiles and a roofline estimate of a module's time per training step.

A profile is the dense (not sparse: NVIDIA's datasheets quote 2:4 sparsity figures twice as
high; those are halved here) peak GEMM throughput of each compute format family and the memory
bandwidth of one device. The plan's ``minimise="time"`` budget estimates each module's time per
step as a roofline (Williams, Waterman and Patterson, CACM 2009):

    time = max(GEMM flops / peak[family of the level's compute format],
               bytes moved / bandwidth)

with the flops of the forward GEMM and both backward GEMMs (3 x 2MKN for a linear layer) and
the bytes of :func:`lowprec.analysis.plan_scores.module_cost`'s ``bits`` budget. A format the
device has no GEMM for is timed as the next wider format it runs (:data:`FALLBACK`): fp8 on an
A100 runs at its bf16 rate, since that is what a kernel there would compute in (the emulated
rounding buys accuracy evidence, not speed). A roofline is an upper bound on speed: it ignores
kernel launch costs, the non-GEMM elementwise flops, and caches; it ranks levels, it does not
predict wall time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..numerics.formats import BF16, FP16, FP32, BlockFormat, FloatFormat, Format

__all__ = ["HardwareProfile", "PROFILES", "get_profile", "FAMILIES", "FALLBACK", "family_of",
           "runs_as", "roofline_seconds"]

#: the compute format families a profile gives a peak for
FAMILIES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8")
#: the next wider family a format is computed in where the device has no GEMM for it
FALLBACK = {"fp4": "fp8", "fp8": "bf16", "int8": "bf16", "bf16": "fp32", "fp16": "fp32",
            "tf32": "fp32"}

_T = 1e12  # TFLOP/s
_GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """One device: ``peak`` family -> dense FLOP/s (int8: OP/s), ``bandwidth`` bytes/s of its
    main memory, and where the figures come from."""

    name: str
    description: str
    peak: dict = field(default_factory=dict)
    bandwidth: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for fam, v in self.peak.items():
            if fam not in FAMILIES:
                raise ValueError(f"HardwareProfile.peak family {fam!r}; accepted: "
                                 f"{', '.join(FAMILIES)}")
            if not v > 0:
                raise ValueError(f"HardwareProfile.peak[{fam!r}]={v!r}; accepted: > 0")
        if "fp32" not in self.peak:
            raise ValueError(f"HardwareProfile {self.name!r} needs an fp32 peak (the fallback)")
        if not self.bandwidth > 0:
            raise ValueError(f"HardwareProfile.bandwidth={self.bandwidth!r}; accepted: > 0")

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "peak": dict(self.peak),
                "bandwidth": self.bandwidth, "source": self.source}


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; sparse figures halved):
    # FP32 67 TF, TF32 989 sparse, BF16/FP16 1979 sparse, FP8 3958 sparse, INT8 3958 sparse
    # TOPS; GPU memory bandwidth 3.35 TB/s
    HardwareProfile("h100-sxm", "NVIDIA H100 SXM5 80GB",
                    {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T,
                     "fp16": 989.5 * _T, "fp8": 1979 * _T, "int8": 1979 * _T},
                    3350 * _GB, "NVIDIA H100 datasheet, SXM, dense"),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM; dense): FP32 19.5 TF, TF32 156,
    # BF16/FP16 312, INT8 624 TOPS; 2039 GB/s. No fp8 or fp4 tensor cores.
    HardwareProfile("a100", "NVIDIA A100 SXM4 80GB",
                    {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T,
                     "int8": 624 * _T},
                    2039 * _GB, "NVIDIA A100 datasheet, 80GB SXM, dense"),
    # NVIDIA HGX B200 datasheet (8 GPUs; per GPU, sparse figures halved): FP4 144 PF / 8 / 2
    # = 9 PF, FP8 72 / 8 / 2 = 4.5 PF, BF16/FP16 36 / 8 / 2 = 2.25 PF, TF32 18 / 8 / 2 =
    # 1.125 PF, INT8 72 / 8 / 2 = 4.5 POPS, FP32 600 / 8 = 75 TF; 64 TB/s / 8 = 8 TB/s.
    # NVFP4 and MXFP4 both run as FP4 there.
    HardwareProfile("b200", "NVIDIA B200 (HGX B200, one GPU)",
                    {"fp32": 75 * _T, "tf32": 1125 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T,
                     "fp8": 4500 * _T, "fp4": 9000 * _T, "int8": 4500 * _T},
                    8000 * _GB, "NVIDIA HGX B200 datasheet, per GPU, dense"),
    # NVIDIA Ada GPU architecture whitepaper, appendix (GeForce RTX 4090, dense, tensor core
    # rates with FP32 accumulate, as training uses): FP32 82.6 TF, TF32 82.6, FP16/BF16 165.2,
    # FP8 330.3, INT8 660.6 TOPS; 1008 GB/s
    HardwareProfile("rtx4090", "NVIDIA GeForce RTX 4090",
                    {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "bf16": 165.2 * _T,
                     "fp16": 165.2 * _T, "fp8": 330.3 * _T, "int8": 660.6 * _T},
                    1008 * _GB, "NVIDIA Ada architecture whitepaper, RTX 4090, FP32 accumulate"),
    # this machine's class: 2 cores of an AMD EPYC (Zen 3, family 25, 2.45 GHz), AVX2 only:
    # two 256-bit FMA pipes per core = 32 fp32 flop/cycle (AMD Zen 3 software optimization
    # guide), 2 x 32 x 2.45e9 = 156.8 GFLOP/s; no bf16/fp16 GEMM instructions (torch's native
    # 16-bit matmul is far below that: emulated formats run as fp32; benchmarks/RESULTS.md,
    # figure F30). Bandwidth: a 256 MiB torch copy (read + write) on a 2-vCPU KVM guest while
    # it was shared, a lower bound (figure F31).
    HardwareProfile("cpu-avx2", "2 cores of an AMD EPYC (Zen 3), AVX2",
                    {"fp32": 156.8e9}, 7.1 * _GB,
                    "Zen 3 FMA throughput x 2 cores x 2.45 GHz; copy bandwidth measured"),
    # Intel Xeon Platinum 8480+ (Sapphire Rapids, 56 cores, 2.0 GHz base): per core and cycle
    # AMX-BF16 1024 flop and AMX-INT8 2048 op (Intel 64 and IA-32 Architectures Optimization
    # Reference Manual, AMX chapter), AVX-512 two FMA units = 64 fp32 flop, AVX512-FP16 128
    # flop; 8 channels of DDR5-4800 = 307.2 GB/s (Intel ARK)
    HardwareProfile("cpu-amx", "Intel Xeon Platinum 8480+ (56 cores, AMX)",
                    {"fp32": 64 * 56 * 2.0e9, "bf16": 1024 * 56 * 2.0e9,
                     "fp16": 128 * 56 * 2.0e9, "int8": 2048 * 56 * 2.0e9},
                    307.2 * _GB, "Intel optimization manual (AMX, AVX-512) x 56 cores x 2.0 GHz"),
)}


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """The profile named ``name``; ValueError naming the accepted ones."""
    if isinstance(name, HardwareProfile):
        return name
    key = str(name).strip().lower()
    if key not in PROFILES:
        raise ValueError(f"hardware={name!r}; accepted: {', '.join(PROFILES)}")
    return PROFILES[key]


def family_of(fmt: Format | None, scaled_element: FloatFormat | None = None) -> str:
    """The GEMM family a compute format (or a scaled recipe's element) runs in: fp32, bf16,
    fp16, fp8 (8-bit floats, MX fp8), fp4 (4-bit floats: NVFP4, MXFP4), int8 (fixed point and
    integers of up to 8 bits); anything else wider than 16 bits, or an unknown format, fp32."""
    f = scaled_element if scaled_element is not None else fmt
    if isinstance(f, BlockFormat):
        f = f.element
    if f is None or f == FP32:
        return "fp32"
    if f == BF16:
        return "bf16"
    if f == FP16:
        return "fp16"
    bits = getattr(f, "bits", 32)
    if isinstance(f, FloatFormat):
        if bits <= 4:
            return "fp4"
        if bits <= 8:
            return "fp8"
        if bits <= 16:
            # other 16-bit floats (e6m9...) run as the 16-bit float that holds their range
            return "bf16" if f.exp_bits > 5 else "fp16"
        return "fp32"
    return "int8" if bits <= 8 else "fp32"


def runs_as(profile: HardwareProfile, family: str) -> str:
    """The family ``profile`` computes ``family``'s GEMMs in: itself if it has a peak for it,
    else the next wider one of :data:`FALLBACK` it has."""
    fam = family
    while fam not in profile.peak:
        fam = FALLBACK.get(fam, "fp32")
    return fam


def roofline_seconds(flops: float, nbytes: float, family: str,
                     profile: HardwareProfile) -> dict:
    """The roofline time of ``flops`` GEMM flops in ``family`` and ``nbytes`` moved on
    ``profile``: ``seconds``, the family it ``runs_as``, and which bound holds (``compute``
    or ``memory``)."""
    fam = runs_as(profile, family)
    t_c = flops / profile.peak[fam]
    t_m = nbytes / profile.bandwidth
    return {"seconds": max(t_c, t_m), "runs_as": fam,
            "bound": "compute" if t_c >= t_m else "memory"}
