"""ATen's composite ops, op by op, as a 16-bit run computes them.

Some torch functions have no kernel of their own: ATen implements them with other ops
(``CompositeImplicitAutograd``), each of which writes a 16-bit tensor in a native 16-bit run
(and autograd differentiates those ops, not the composite). The engine would run such a
function as one float32 op rounded once; under a pure rule the mode runs it as the composite
below instead, so that each of its ops is emulated (rounded, its gradient rounded) as the
native run's is. Each function follows its ATen source in torch 2.13, named in its docstring;
tests/training/test_fidelity.py compares them with ``model.half()`` and ``model.bfloat16()``.
"""

from __future__ import annotations

import contextvars
import threading

import numpy as np
import torch

from ...numerics.quantize import emits_graph_ops
from .dtypes import MARK

__all__ = ["COMPOSITES", "COMPUTE_DTYPE", "CPU_KERNELS"]

# the torch dtype of the rule a composite runs under, and whether its op follows the CPU's
# kernels (not CUDA's: target "cuda" or CUDA tensors); the engine sets both around the call
COMPUTE_DTYPE: contextvars.ContextVar = contextvars.ContextVar("lowprec_composite_dtype",
                                                               default=None)
CPU_KERNELS: contextvars.ContextVar = contextvars.ContextVar("lowprec_composite_cpu",
                                                            default=True)


class _Value(torch.autograd.Function):
    """``value`` in the forward, the gradient passed to ``out`` unchanged: a 16-bit kernel's
    value swapped in for the emulated op's (whose gradient was already the kernel's)."""

    @staticmethod
    def forward(ctx, out, value):
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def _swap_value(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """:class:`_Value` outside the mode, the result marked as ``out`` is (its grid: the
    logical dtype model code sees)."""
    with torch._C.DisableTorchFunction():
        res = _Value.apply(out, value.to(out.dtype))
    mark = getattr(out, MARK, None)
    if mark is not None:
        setattr(res, MARK, mark)
    return res


def cosine_similarity(x1, x2, dim: int = 1, eps: float = 1e-8):
    """aten/src/ATen/native/Distance.cpp ``cosine_similarity``: each input divided by its norm
    (clamped to ``eps`` in place, outside autograd), the products summed."""
    if not x1.is_floating_point() and not x2.is_floating_point():
        raise RuntimeError("expected common dtype to be floating point, yet common dtype is "
                           f"{torch.promote_types(x1.dtype, x2.dtype)}")
    # an integer input cast to the other's (logical) dtype, the common one
    x1 = x1 if x1.is_floating_point() else x1.to(x2.dtype)
    x2 = x2 if x2.is_floating_point() else x2.to(x1.dtype)
    x1, x2 = torch.broadcast_tensors(x1, x2)
    n1 = torch.linalg.vector_norm(x1, 2, dim=dim, keepdim=True).clone()
    n2 = torch.linalg.vector_norm(x2, 2, dim=dim, keepdim=True).clone()
    with torch.no_grad():
        n1.clamp_min_(eps)
        n2.clamp_min_(eps)
    return ((x1 / n1) * (x2 / n2)).sum(dim)


def instance_norm(input, weight, bias, running_mean, running_var, use_input_stats: bool,
                  momentum: float, eps: float, cudnn_enabled: bool):
    """aten/src/ATen/native/Normalization.cpp ``instance_norm``: a batch norm of the input
    viewed as one example of batch x channels channels, the weights repeated per example; the
    running statistics updated with the examples' mean. Declined (``NotImplemented``: the op
    runs whole) where a graph is traced and running statistics are updated: the traced batch
    norm does not write the repeated copies it is given, and the statistics stayed as they
    were."""
    if not use_input_stats and (running_mean is None or running_var is None):
        raise RuntimeError("Expected running_mean and running_var to be defined when "
                           "use_input_stats is false")  # (ATen's check)
    if emits_graph_ops() and use_input_stats and running_mean is not None:
        return NotImplemented
    b, c = input.shape[0], input.shape[1]
    shape = (1, b * c, *input.shape[2:])

    def repeat(t):
        return t.repeat(b) if t is not None else None

    mean, var = repeat(running_mean), repeat(running_var)
    out = torch.batch_norm(input.contiguous().view(shape), repeat(weight), repeat(bias), mean,
                           var, use_input_stats, momentum, eps, cudnn_enabled)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.copy_(mean.view(b, c).mean(0))
        if running_var is not None:
            running_var.copy_(var.view(b, c).mean(0))
    return out.view(input.shape)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index: int = -100,
                  reduce=None, reduction: str = "mean", label_smoothing: float = 0.0):
    """aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss``: ``nll_loss_nd`` of the 16-bit
    ``log_softmax``; with label smoothing also the smoothing term, ``-log_softmax.sum(class
    dim)`` reduced and mixed in (``cross_entropy_loss_label_smoothing``: in float16 its sum
    over a batch overflows where float32's does not); class probabilities as targets:
    ``-(log_softmax * target).sum()`` (``cross_entropy_loss_prob_target``). Arguments ATen
    rejects are left to the op itself (``NotImplemented``), which raises its own error."""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if not (torch.is_tensor(input) and torch.is_tensor(target)) or input.dim() < 1 or \
            input.dtype != COMPUTE_DTYPE.get() or reduction not in ("mean", "sum", "none") or \
            not 0.0 <= label_smoothing <= 1.0 or weight is not None:
        # (input.dtype: the logical one, an fp32 island runs whole; class weights too: their
        # 16-bit gradient is not the composite's either)
        return NotImplemented
    class_dim = 0 if input.dim() == 1 else 1
    n_classes = input.shape[class_dim]
    logp = torch.log_softmax(input, class_dim)
    if input.shape == target.shape:  # class probabilities
        if not target.is_floating_point() or ignore_index >= 0:
            return NotImplemented
        if label_smoothing > 0.0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        prod = logp * target
        if reduction == "mean":
            if input.numel() == 0:
                return NotImplemented
            return -prod.sum() / (input.numel() // n_classes)
        return -prod.sum() if reduction == "sum" else -prod.sum(class_dim)
    nll = torch.nn.functional.nll_loss(logp, target, weight, ignore_index=ignore_index,
                                       reduction=reduction)
    if label_smoothing <= 0.0:
        return nll
    smooth = -logp.sum(class_dim)
    ignored = target == ignore_index
    smooth = smooth.masked_fill(ignored, 0.0)
    if reduction == "mean":
        ret = smooth.sum() / (~ignored).sum()
    else:
        ret = smooth.sum() if reduction == "sum" else smooth
    return (1 - label_smoothing) * nll + ret * (label_smoothing / n_classes)


def cross_entropy_loss(input, target, weight=None, reduction: int = 1,
                       ignore_index: int = -100, label_smoothing: float = 0.0):
    """``torch._C._nn.cross_entropy_loss`` (what ``F.cross_entropy`` calls): the reduction as
    ATen's enum (0 none, 1 mean, 2 sum)."""
    if reduction not in (0, 1, 2):
        return NotImplemented
    return cross_entropy(input, target, weight, ignore_index=ignore_index,
                         reduction=("none", "mean", "sum")[reduction],
                         label_smoothing=label_smoothing)


_INSIDE = threading.local()


def _as_before(builtin, *args):
    """``builtin(*args)`` emulated as the engine runs any op (the mode sees the call again:
    this guard sends it past the composite), or ``NotImplemented`` for that inner call."""
    if getattr(_INSIDE, builtin.__name__, False):
        return NotImplemented
    setattr(_INSIDE, builtin.__name__, True)
    try:
        return builtin(*args)
    finally:
        setattr(_INSIDE, builtin.__name__, False)


def _round16(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values rounded to float16 or bfloat16 (nearest even), as float32."""
    if dtype == torch.float16:
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) &
         np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, r)


def _cascade_sum(terms: np.ndarray, dtype: torch.dtype) -> np.float32:
    """``nll_loss_out_frame``'s sum of ``terms`` (aten/src/ATen/native/LossNLL.cpp) in its
    16-bit ``dtype``, each addition rounded: eight levels of partial sums; term b is subtracted
    at level 0, which (with each level above whose count is full) is carried up when b is a
    multiple of 16 (level j: of 16**j), term 0 thus at once to the top; the levels then summed
    from the lowest. A level at a time, its groups of 16 side by side (16 rounded additions;
    the last group, if short, padded with zeros: it stays at its level)."""
    # float16 in numpy's own float16 (each operation in float32, then rounded: c10::Half's
    # arithmetic); bfloat16 in float32, rounded by _round16
    half = dtype == torch.float16
    ft = np.float16 if half else np.float32

    def add(a, b):
        return a + b if half else _round16(a + b, dtype)

    with np.errstate(over="ignore", invalid="ignore"):
        parts = [ft(0)] * 8
        if terms.size == 0:
            return np.float32(0)
        parts[7] = ft(-terms[0])  # (0 - t0, carried up through 0 + x: exact)
        vals = terms[1:].astype(ft)
        vals = -vals  # (level 0 subtracts each term: adds its negation, exactly)
        for level in range(7):
            if vals.size == 0:
                break
            groups = -(-vals.size // 16)
            padded = np.zeros(groups * 16, ft)
            padded[:vals.size] = vals
            chunks, acc = padded.reshape(groups, 16), np.zeros(groups, ft)
            for i in range(16):
                acc = add(acc, chunks[:, i])
            if vals.size % 16:
                parts[level], vals = acc[-1], acc[:-1]
            else:
                vals = acc
        total = np.zeros(1, ft)
        for p in parts:
            total = add(total, ft(p))
        return np.float32(total[0])


def nll_loss_nd(input, target, weight=None, reduction: int = 1, ignore_index: int = -100):
    """``torch._C._nn.nll_loss_nd`` (``F.nll_loss``) as emulated before (its gradient the
    16-bit kernel's), its reduced value replaced by the 16-bit kernel's own
    (``nll_loss_out_frame``: the picked values summed in the input's dtype by
    :func:`_cascade_sum`, divided by the count in that dtype) for a 2-D input (batch x
    classes) of class indices without weights or ignored targets; else as before."""
    dtype = COMPUTE_DTYPE.get()
    if not torch.is_tensor(input) or input.dtype != dtype:  # (the logical dtype: an fp32
        return NotImplemented  # island runs as it did)
    out = _as_before(torch._C._nn.nll_loss_nd, input, target, weight, reduction, ignore_index)
    if out is NotImplemented or reduction not in (1, 2) or weight is not None or \
            input.dim() != 2 or target.dim() != 1 or emits_graph_ops() or \
            not CPU_KERNELS.get() or input.device.type != "cpu":
        return out  # (CUDA's kernel sums in float32, rounded once: the engine's value)
    with torch._C.DisableTorchFunction():  # (real dtypes here: the mode reports 16-bit ones)
        with torch.no_grad():
            if input.dtype != torch.float32 or bool((target == ignore_index).any()):
                return out
            picked = input.gather(1, target.long().view(-1, 1)).view(-1).numpy()
            total = _cascade_sum(picked, dtype)
            if reduction == 1:
                n = _round16(np.array([target.numel()], np.float32), dtype)
                with np.errstate(all="ignore"):
                    total = _round16(np.array([total], np.float32) / n, dtype)[0]
    return _swap_value(out, torch.tensor(float(total)))


def upsample_linear1d(input, output_size, align_corners, scale_factors=None):
    """``torch._C._nn.upsample_linear1d`` (``F.interpolate(mode="linear")``) as emulated
    before (its gradient was the 16-bit kernel's), its value the 16-bit kernel's:
    ``compute_indices_weights_linear`` (aten/src/ATen/native/cpu/UpSampleKernel.cpp) holds
    the interpolation weights in the input's dtype (lambda1 rounded, lambda0 = 1 - lambda1
    rounded), then ``x0 * lambda0 + x1 * lambda1`` in float32, rounded once (one fp32 op:
    73% of float16 outputs equal native at scale 1.5)."""
    dtype = COMPUTE_DTYPE.get()
    if not torch.is_tensor(input) or input.dtype != dtype:
        return NotImplemented
    out = _as_before(torch._C._nn.upsample_linear1d, input, output_size, align_corners,
                     scale_factors)
    if out is NotImplemented or emits_graph_ops() or input.dim() != 3 or \
            not CPU_KERNELS.get() or input.device.type != "cpu":
        return out
    with torch._C.DisableTorchFunction():
        with torch.no_grad():
            if input.dtype != torch.float32:
                return out
            n_in, n_out = input.shape[-1], out.shape[-1]
            scale = scale_factors[0] if scale_factors else None
            i = torch.arange(n_out, dtype=torch.float32)
            if align_corners:
                src = i * (float((n_in - 1) / (n_out - 1)) if n_out > 1 else 0.0)
            else:
                step = float(1.0 / scale) if scale is not None and scale > 0 else n_in / n_out
                src = ((i + 0.5) * step - 0.5).clamp(min=0)
            i0 = src.floor().long().clamp(max=n_in - 1)
            i1 = torch.where(i0 < n_in - 1, i0 + 1, i0)
            lam1 = (src - i0.float()).clamp(0, 1).to(dtype)
            lam0 = (1 - lam1.float()).to(dtype)
            value = (input[..., i0] * lam0.float() + input[..., i1] * lam1.float()).to(dtype)
    return _swap_value(out, value.float())


COMPOSITES = {"cosine_similarity": cosine_similarity, "instance_norm": instance_norm,
              "cross_entropy": cross_entropy, "cross_entropy_loss": cross_entropy_loss,
              "nll_loss_nd": nll_loss_nd, "upsample_linear1d": upsample_linear1d}
