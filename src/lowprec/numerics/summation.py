"""Convolution summed in the order of torch's reference CPU kernel for 16-bit types.

Where oneDNN has no 16-bit convolution (float16 on CPUs without AVX512-FP16, for one),
``model.half()`` on CPU runs ATen's ``slow_conv2d``: im2col, then a gemm whose dot products are
the ``sum`` of ``aten/src/ATen/native/cpu/BlasKernel.cpp``: four fp32 partial sums, term ``l``
going to partial ``l % 4`` while four terms remain and the rest to partial 0, combined as
``((s0 + s1) + s2) + s3``; the bias, if any, is added after, and the result rounded once to the
16-bit format. Any fp32 convolution rounded once agrees with it except on the few outputs whose
fp32 sum lies within a few fp32 units of a 16-bit rounding boundary (0.01-0.1% of them), but
those units spread through batch norm: emulating the kernel's order is what makes an emulated
ResNet bit-exact with the native one (tests/training/test_fidelity.py).

``conv2d`` computes that order in fp32 (the compiled kernel, or plain torch with the same bits);
its gradients are fp32 convolution gradients, as the emulation engine rounds them afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.utils import _pair

from . import kernel

__all__ = ["conv2d", "dot4"]


def dot4(cols: torch.Tensor, w: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Dot products of ``w`` ((groups*Cog) x K) with the columns of ``cols`` (N x (groups*K) x
    L) in the reference kernel's order: N x (groups*Cog) x L, float32."""
    cols, w = cols.float().contiguous(), w.float().contiguous()
    n, gk, length = cols.shape
    co, k = w.shape
    if gk != groups * k or co % groups:
        raise ValueError(f"dot4: cols {tuple(cols.shape)} and w {tuple(w.shape)} do not match "
                         f"groups={groups}")
    out = cols.new_empty(n, co, length)
    if cols.device.type == "cpu" and kernel.available():
        kernel.dot4(cols, w, out, groups)
        return out
    cg = cols.view(n, groups, 1, k, length)
    wg = w.view(1, groups, co // groups, k, 1)
    parts = [cols.new_zeros(n, groups, co // groups, length) for _ in range(4)]
    for i in range(k):
        # the product of two 16-bit values is exact in fp32: one rounding, the add's
        parts[i % 4 if i < k - k % 4 else 0] += wg[:, :, :, i] * cg[:, :, :, i]
    return (((parts[0] + parts[1]) + parts[2]) + parts[3]).view(n, co, length)


def _resolve_padding(x, weight, padding, stride, dilation):
    """(input, numeric padding) as torch's convolution resolves ``padding``: "valid" is 0;
    "same" pads dilation * (k - 1) // 2 on both sides through the convolution, and an odd unit
    left over on the right/bottom explicitly (``_convolution_mode`` does the same)."""
    if not isinstance(padding, str):
        return x, _pair(padding)
    if padding not in ("same", "valid"):
        raise ValueError(f"conv2d: padding {padding!r} is not one of 'same', 'valid'")
    if padding == "valid":
        return x, (0, 0)
    if any(s != 1 for s in stride):
        raise ValueError(f"conv2d: padding 'same' needs stride 1, got stride {stride}")
    totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
    odd = [t % 2 for t in totals]
    if any(odd):
        x = F.pad(x, [0, odd[1], 0, odd[0]])
    return x, tuple(t // 2 for t in totals)


def _forward(x, weight, bias, stride, padding, dilation, groups):
    n, _, h, w_ = x.shape
    co, _, kh, kw = weight.shape
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
    y = dot4(cols, weight.reshape(co, -1), groups)
    if bias is not None:
        y = bias.view(1, co, 1) + y
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w_ + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return y.view(n, co, ho, wo)


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        ctx.save_for_backward(x, weight)
        ctx.args = (bias is not None, stride, padding, dilation, groups)
        with torch._C.DisableTorchFunction():
            return _forward(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        has_bias, stride, padding, dilation, groups = ctx.args
        with torch._C.DisableTorchFunction():
            gx, gw, gb = torch.ops.aten.convolution_backward(
                g, x, weight, [weight.shape[0]] if has_bias else None, list(stride),
                list(padding), list(dilation), False, [0, 0], groups,
                [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias])
        return gx, gw, gb if has_bias else None, None, None, None, None


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride=1, padding=0, dilation=1, groups: int = 1) -> torch.Tensor:
    """``F.conv2d`` (same arguments) on float32 carriers of 16-bit values, summed as torch's
    reference CPU 16-bit kernel sums (see the module docstring); other dtypes go to
    ``F.conv2d``."""
    x = input
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() not in (3, 4):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if x.dim() == 3:
        return conv2d(x[None], weight, bias, stride, padding, dilation, groups)[0]
    stride, dilation = _pair(stride), _pair(dilation)
    x, padding = _resolve_padding(x, weight, padding, stride, dilation)
    return _Conv2d.apply(x, weight, bias, stride, padding, dilation, groups)
