"""nn.MultiheadAttention's inference fast path, as the emulated model runs it.

In eval mode with autograd off (or nothing requiring a gradient), ``nn.MultiheadAttention``
and ``nn.TransformerEncoderLayer`` (which calls it) skip ``F.multi_head_attention_forward`` and
call ``torch._native_multi_head_attention``. The engine's mode makes the module's own check
(``has_torch_function``) fail, so an emulated model always runs the Python path. Without
weights asked for, that path runs ``scaled_dot_product_attention`` (the flash kernel's
roundings, :func:`.kernels.attention`) and a split input projection (matmul, then add: two
roundings, :func:`.kernels.split_linear`), where the native kernel
(``native_multi_head_attention_cpu`` in aten/src/ATen/native/transformers/attention.cpp, its
ops as torch's profiler lists them) computes

* ``qkv = x @ W_in^T`` on the batch-first input, no bias (one 16-bit GEMM);
* ``_transform_bias_rescale_qkv``: ``q = (qkv_q + b_q) / sqrt(head size)``, ``k = qkv_k + b_k``,
  ``v = qkv_v + b_v`` in fp32 (the scale a float32 value), each rounded once;
* ``q @ k^T`` (bmm), softmax, ``@ v`` (bmm), each a 16-bit result;
* the heads put back to [B, T, E] and ``addmm(b_out, ., W_out^T)``: one rounding.

Measured on this CPU: the emulation below is bit-exact with ``model.half()``'s fast path (fp16
and bf16, tests/training/test_fidelity.py); with weights asked for, the Python path already is
(an explicit bmm, softmax, bmm) and is left to run. Masks keep the Python path too (the native
kernel's masked softmax is not emulated). :func:`native_call` decides, from the conditions
MultiheadAttention.forward checks; :func:`run_native` computes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["sdp_branch", "run_sdp_branch"]

# F.multi_head_attention_forward's parameters, in order (torch 2.x)
_NAMES = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight",
          "in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight",
          "out_proj_bias", "training", "key_padding_mask", "need_weights", "attn_mask",
          "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
          "static_k", "static_v", "average_attn_weights", "is_causal")
_DEFAULTS = {"training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
             "use_separate_proj_weight": False, "static_k": None, "static_v": None,
             "is_causal": False}


def _bound(args, kwargs) -> dict | None:
    if len(args) > len(_NAMES) or any(k not in _NAMES for k in kwargs):
        return None
    call = dict(_DEFAULTS)
    call.update(zip(_NAMES, args))
    call.update(kwargs)
    return call if all(n in call for n in _NAMES[:13]) else None


def native_call(module, args, kwargs, dtype: torch.dtype | None) -> dict | None:
    """The arguments of ``F.multi_head_attention_forward(*args, **kwargs)`` called by
    ``module``'s forward when a native run of it (parameters and input in ``dtype``) would call
    ``torch._native_multi_head_attention`` and the Python path would round otherwise; None
    else. The checks are MultiheadAttention.forward's (eval, no gradient wanted, batch-first
    self-attention, an even number of heads, no bias_k, bias_v or zero attention, packed
    projections, fast path enabled, no autocast); no weights asked for and no mask."""
    if not isinstance(module, nn.MultiheadAttention) or dtype is None:
        return None
    call = _bound(args, kwargs)
    if call is None:
        return None
    q, k, v = call["query"], call["key"], call["value"]
    tensors = (q, k, v, call["in_proj_weight"], call["in_proj_bias"], call["out_proj_weight"],
               call["out_proj_bias"])
    if not (torch.backends.mha.get_fastpath_enabled() and module.batch_first and
            not module.training and not call["training"] and q is k and k is v and
            torch.is_tensor(q) and q.dim() == 3 and q.device.type == "cpu" and
            all(torch.is_tensor(t) for t in tensors[3:]) and
            call["bias_k"] is None and call["bias_v"] is None and not call["add_zero_attn"] and
            not call["use_separate_proj_weight"] and module.num_heads % 2 == 0 and
            call["attn_mask"] is None and call["key_padding_mask"] is None and
            not call["need_weights"] and not call["is_causal"] and
            call["static_k"] is None and call["static_v"] is None and
            not torch.is_autocast_enabled()):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if q.shape[-1] % call["num_heads"]:
        return None
    return call


def run_native(engine, rule, key: str, call: dict):
    """``native_multi_head_attention_cpu`` on ``call``'s tensors (see the module docstring),
    called from the engine's mode: GEMMs, softmax and views run under it (each rounded as the
    native op's result, ``match_cpu_kernels`` included), the fused bias-and-scale in fp32 with
    one rounding. Returned as ``F.multi_head_attention_forward`` returns: sequence-first, no
    weights."""
    x = call["query"].transpose(0, 1)  # back to the module's batch-first input, [B, T, E]
    heads = call["num_heads"]
    b, t, embed = x.shape
    dh = embed // heads
    with engine.mode():
        qkv = F.linear(x, call["in_proj_weight"])  # mm, no bias
    bias = engine.operand(call["in_proj_bias"], rule, key)
    with torch._C.DisableTorchFunction():
        # _transform_bias_rescale_qkv: fp32 sums, q times 1/sqrt(dh) (a float32), rounded once
        scale = float(torch.tensor(1.0 / dh ** 0.5, dtype=torch.float32))
        z = qkv + bias
        z = z.view(b, t, 3, heads, dh).permute(2, 0, 3, 1, 4)  # [3, B, H, T, dh]
        z = torch.cat([z[:1] * scale, z[1:]]).contiguous()
    z = engine.round(z, rule, key)
    q, k, v = z[0], z[1], z[2]
    with engine.mode():
        p = torch.softmax(torch.matmul(q, k.transpose(-2, -1)), -1)
        ctx = torch.matmul(p, v).permute(0, 2, 1, 3).contiguous().view(b * t, embed)
        out = F.linear(ctx, call["out_proj_weight"], call["out_proj_bias"]).view(b, t, embed)
    return out.transpose(0, 1), None
