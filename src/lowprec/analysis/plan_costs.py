"""What a planning level costs one module: the widths its roles are held and moved at, the
GEMM flops it runs, the time that takes on a named hardware profile, and the block constraints
of MX and NVFP4 GEMMs.

A level is a :class:`lowprec.training.policy.Policy` (parameter, compute and gradient formats,
optionally a scope and a scaled-GEMM recipe ``sc=``). What a module holds under it:

* scope ``matmul`` (``16-mixed``, as torch.autocast): only matmul-like modules (linear,
  convolutions, recurrent layers, attention) compute in the compute format; the others (norms,
  embeddings) compute, and pass gradients, in fp32;
* a scaled recipe (``nvfp4``, ``mxfp4``): a linear layer's GEMM operands are the recipe's
  casts: e2m1 elements plus their scales, 4 + 8/16 = 4.5 bits per element for NVFP4 (an e4m3
  scale per 16 elements; the fp32 tensor scale adds 32 bits per tensor), 4 + 8/32 = 4.25 for
  MX (an E8M0 scale per 32). Their outputs and gradients are written in the compute and
  gradient formats. Other modules run in the compute format, as the recipe leaves them.

The hardware's constraints: an MX or NVFP4 block runs along the reduction axis of each GEMM
(forward: the input features K; grad_input: the output features N; grad_weight: the rows M,
tokens of the batch), so each must be a multiple of the block size; :func:`block_refusal`
says which is not. A GEMM's two operands share a format family by construction: both are cast
by the module's own level (see docs/design.md, "Planning").
"""

from __future__ import annotations

import math

from ..numerics.formats import FP32
from ..numerics.scaling import ScaleKind, ScaledCast
from ..training.policy import Policy
from .roofline import family_of, get_profile, roofline_seconds

__all__ = ["MATMUL_KINDS", "SCALED_KINDS", "covered", "cast_bits", "role_bits", "gemm_flops",
           "module_time", "block_refusal", "block_size", "bytes_of"]

#: module classes whose forward is a matmul-like op of torch.autocast's lower-precision list
MATMUL_KINDS = frozenset({"Linear", "Bilinear", "LazyLinear", "Conv1d", "Conv2d", "Conv3d",
                          "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "LSTM",
                          "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell", "MultiheadAttention",
                          "PReLU"})
#: the module classes a scaled recipe (``ops=linear``) covers
SCALED_KINDS = frozenset({"Linear", "LazyLinear"})


def covered(p, level: Policy) -> bool:
    """Whether ``level``'s scaled recipe runs module ``p``'s GEMM."""
    return level.scaled is not None and p.kind in SCALED_KINDS


def cast_bits(cast: ScaledCast, numel: int = 0) -> float:
    """Bits per element of an operand cast as ``cast``, its scales included: NVFP4 4.5 (plus
    32 bits per tensor over ``numel`` elements), MX 4 + 8/32, a per-tensor or per-row scale
    nothing measurable; ``hp``: 32."""
    if cast.is_hp:
        return 32.0
    bits = float(cast.element.bits)
    if cast.kind is ScaleKind.NVFP4:
        bits += 8 / cast.tile[1] + (32 / numel if numel else 0.0)
    elif cast.kind is ScaleKind.MX:
        bits += 8 / cast.tile[1]
    elif cast.kind is ScaleKind.TILE:
        bits += 32 / (cast.tile[0] * cast.tile[1])
    return bits


def block_size(level: Policy) -> int | None:
    """The largest block (elements along the reduction axis) of ``level``'s scaled casts."""
    if level.scaled is None:
        return None
    sizes = [c.tile[1] for c in level.scaled.casts.values()
             if not c.is_hp and c.kind in (ScaleKind.MX, ScaleKind.NVFP4)]
    return max(sizes) if sizes else None


def role_bits(p, level: Policy) -> dict:
    """Bits per element of each thing module ``p`` keeps or moves under ``level``:
    ``params`` (storage, and the weight gradient), ``act`` and ``weight_op`` (the GEMM's input
    and weight operands), ``out`` (the output written), ``grad_op`` (the output gradient the
    backward GEMMs read), ``grad_out`` (gradients written), ``saved`` (the activation kept for
    the backward: the compute format, or for a block-scaled recipe both blockings of the
    operand, one along each GEMM's reduction axis), and the GEMM ``family``."""
    c, g = level.compute, level.grads
    if level.scope == "matmul" and p.kind not in MATMUL_KINDS:
        c = g = FP32  # autocast's fp32 ops: norms, embeddings
    w = float(level.params.bits)
    cb, gb = float(c.bits), float(g.bits)
    out = {"params": w, "act": cb, "weight_op": cb, "out": cb, "grad_op": gb, "grad_out": gb,
           "saved": cb, "family": family_of(c)}
    if covered(p, level):
        sc = level.scaled
        a = cast_bits(sc.input, p.n_in)
        out.update(act=a, weight_op=cast_bits(sc.weight, p.n_params),
                   grad_op=cast_bits(sc.grad_output, p.n_out),
                   family=family_of(None, None if sc.input.is_hp else sc.input.element))
        blocked = sc.input.kind in (ScaleKind.MX, ScaleKind.NVFP4)
        out["saved"] = 2 * a if blocked else a
    return out


def gemm_flops(p) -> float:
    """Flops of module ``p``'s GEMMs in one training step: forward and both backward GEMMs,
    3 x the forward's 2 x (multiply-adds), from the profile's ``extra["fwd_flops"]`` (linear
    and convolution layers; 0 for others, which are memory-bound)."""
    return 3.0 * float(p.extra.get("fwd_flops", 0))


def module_time(p, level: Policy, profile, nbytes: float) -> dict:
    """The roofline time of module ``p``'s step under ``level`` on ``profile`` (a name or a
    :class:`~lowprec.analysis.roofline.HardwareProfile`) moving ``nbytes``: ``seconds``,
    ``runs_as`` (the family the device computes it in) and ``bound``."""
    prof = get_profile(profile)
    fam = role_bits(p, level)["family"]
    r = roofline_seconds(gemm_flops(p), nbytes, fam, prof)
    return {**r, "family": fam}


def block_refusal(p, level: Policy) -> str | None:
    """Why module ``p`` cannot run ``level``'s block-scaled GEMMs on hardware (a reduction
    dimension that is not a multiple of the block size), or None."""
    if not covered(p, level):
        return None
    n = block_size(level)
    if n is None:
        return None
    dims = {"input features (forward)": p.extra.get("in_features"),
            "output features (grad_input)": p.extra.get("out_features"),
            "rows of the batch (grad_weight)": p.extra.get("rows")}
    bad = [f"{k} {v}" for k, v in dims.items() if isinstance(v, int) and v % n]
    if bad:
        return (f"{', '.join(bad)} not a multiple of the {n}-element blocks along the reduction "
                "axis")
    return None


def bytes_of(bits: float, numel: int) -> int:
    """Whole bytes of ``numel`` elements at ``bits`` each."""
    return int(math.ceil(numel * bits / 8))
