"""Layers whose GEMMs accumulate in an :class:`~.accumulation.Accumulator`, forward and backward.

Each is the torch function of the same name with its GEMMs replaced by
:func:`~.accumulation.matmul_acc` (whose backward runs both gradient GEMMs with the same
accumulator), and everything around them in fp32:

* ``linear``: ``x @ W^T`` (K = in_features), then ``+ bias`` in fp32, as the hardware adds the
  bias to the accumulator's result; the weight gradient is one GEMM over all rows of the batch.
* ``matmul``, ``mm``, ``bmm``, ``@``: the GEMM itself.
* ``conv2d``: im2col (``F.unfold``), one GEMM per group with K = C_in/groups * kh * kw, then the
  bias; the input gradient's col2im sum (``F.fold``) is in fp32, and so is the sum over the
  batch of a grouped convolution's weight gradient (groups=1: one GEMM over all positions).
* ``scaled_dot_product_attention``: the two GEMMs Q K^T and P V accumulate; scaling, mask and
  softmax are fp32 (as in the math reference of torch's SDPA); dropout with ``F.dropout``.

The functions take ``acc`` and ``generator`` first so that :func:`bind` can fix them; no
torch-function mode sees their inner ops (the emulation engine rounds only their result).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from .accumulation import Accumulator, matmul_acc, parse_accumulator

__all__ = ["linear", "matmul", "conv2d", "scaled_dot_product_attention", "OPS", "bind"]


def _no_mode(fn):
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


@_no_mode
def linear(acc, generator, input, weight, bias=None):
    """``F.linear`` with the GEMM accumulated in ``acc``."""
    y = matmul_acc(input, weight.t(), acc, generator=generator)
    return y if bias is None else y + bias


@_no_mode
def matmul(acc, generator, input, other=None, *, mat2=None, out=None):
    """``torch.matmul`` (mm, bmm: ``mat2=``; @) accumulated in ``acc``."""
    if out is not None:
        raise ValueError("matmul with an accumulator: out= is not supported")
    return matmul_acc(input, other if other is not None else mat2, acc, generator=generator)


@_no_mode
def conv2d(acc, generator, input, weight, bias=None, stride=1, padding=0, dilation=1,
           groups: int = 1):
    """``F.conv2d`` through im2col and one accumulated GEMM per group."""
    x = input
    squeeze = x.dim() == 3
    if squeeze:
        x = x[None]
    stride, dilation = _pair(stride), _pair(dilation)
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(f"conv2d: padding={padding!r}; accepted: 'same', 'valid' or numbers")
        if padding == "valid":
            padding = 0
        else:  # as torch resolves it: d * (k - 1) // 2 each side, an odd unit on the right
            if any(st != 1 for st in stride):
                raise ValueError(f"conv2d: padding 'same' needs stride 1, got {stride}")
            totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
            if any(t % 2 for t in totals):
                x = F.pad(x, [0, totals[1] % 2, 0, totals[0] % 2])
            padding = (totals[0] // 2, totals[1] // 2)
    padding = _pair(padding)
    n, _, h, w_ = x.shape
    co, cig, kh, kw = weight.shape
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
    length = cols.shape[-1]
    k = cig * kh * kw
    if groups == 1:
        # (n, L, K) @ (K, co): the weight's gradient is then one GEMM over all n * L positions
        y = matmul_acc(cols.transpose(1, 2), weight.reshape(co, k).t(), acc,
                       generator=generator).transpose(1, 2)
    else:  # (1, groups, co/groups, K) @ (n, groups, K, L); batch gradients summed in fp32
        wg = weight.reshape(1, groups, co // groups, k)
        y = matmul_acc(wg, cols.view(n, groups, k, length), acc, generator=generator)
    y = y.reshape(n, co, length)
    if bias is not None:
        y = y + bias.view(1, co, 1)
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w_ + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = y.view(n, co, ho, wo)
    return y[0] if squeeze else y


@_no_mode
def scaled_dot_product_attention(acc, generator, query, key, value, attn_mask=None,
                                 dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with Q K^T and P V accumulated in ``acc``."""
    lq, lk = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = matmul_acc(query, key.transpose(-2, -1), acc, generator=generator) * s
    if is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    p = torch.softmax(scores, dim=-1)
    if dropout_p:
        p = F.dropout(p, dropout_p)  # torch's RNG, not the fused kernel's stream
    return matmul_acc(p, value, acc, generator=generator)


#: op name (as the emulation engine names torch calls) -> accumulated implementation
OPS = {
    "linear": linear,
    "matmul": matmul, "mm": matmul, "bmm": matmul, "__matmul__": matmul,
    "conv2d": conv2d,
    "scaled_dot_product_attention": scaled_dot_product_attention,
}


def bind(name: str, acc: "str | Accumulator", generator: torch.Generator | None = None,
         args=(), kwargs=None):
    """The implementation of op ``name`` with ``acc`` and ``generator`` fixed, or None when the
    op has none or the call has a tensor argument that is not real floating point (an integer
    matmul): it then keeps torch's own kernel."""
    fn = OPS.get(name)
    if fn is None:
        return None
    for t in (*args, *(kwargs or {}).values()):
        if torch.is_tensor(t) and (not t.is_floating_point() or t.dtype == torch.float64):
            return None  # integers, and float64 (wider than the float32 the kernel takes)
    return partial(fn, parse_accumulator(acc), generator)
