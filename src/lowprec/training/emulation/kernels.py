"""Three ops the emulation engine computes as torch's 16-bit CPU kernels do, not as one rounding.

Their 16-bit implementations keep an intermediate in 16 bits (batch norm's statistics, the
attention probabilities, every op of an LSTM cell); computing them in fp32 and rounding once
would be more accurate than a 16-bit run really is. Each function returns the fp32 result the
engine then rounds once; ``engine.round`` rounds the 16-bit intermediates.
"""

from __future__ import annotations

import torch

__all__ = ["batch_norm", "attention", "lstm", "uses_batch_stats", "plain_attention",
           "plain_lstm", "label_kernel_nodes"]


def label_kernel_nodes(out: torch.Tensor, args, name: str) -> torch.Tensor:
    """Label the autograd nodes of a kernel the engine computes as several fp32 ops (batch
    norm, attention) with ``metadata["kernel"]``: their intermediate gradients are the kernel's
    internal fp32 values, as in the fused 16-bit kernel's backward."""
    if out.grad_fn is None:
        return out
    stop = {t.grad_fn for t in args if torch.is_tensor(t)}
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop or not node.next_functions and \
                node.name().endswith("AccumulateGrad"):
            continue
        seen.add(node)
        if node.name().endswith("AccumulateGrad"):
            continue
        node.metadata["kernel"] = name
        todo.extend(n for n, _ in node.next_functions)
    return out


def uses_batch_stats(args, kwargs) -> bool:
    """torch.batch_norm(input, weight, bias, running_mean, running_var, training, ...) normalises
    with the batch's statistics (training, or no running statistics)."""
    if kwargs or len(args) < 8 or not torch.is_tensor(args[0]) or args[0].dim() < 2:
        return False
    return bool(args[5]) or args[3] is None or args[4] is None


def plain_lstm(args, kwargs) -> bool:
    """_VF.lstm(input, (h0, c0), weights, has_biases, num_layers, dropout, train,
    bidirectional, batch_first): not packed, unidirectional, no projections."""
    if kwargs or len(args) != 9 or not isinstance(args[1], (tuple, list)) or args[7]:
        return False
    per_layer = 4 if args[3] else 2
    return len(args[2]) == per_layer * args[4] and args[1][0].shape[-1] * 4 == args[2][0].shape[0]


def plain_attention(args, kwargs) -> bool:
    """scaled_dot_product_attention without dropout or grouped heads, keys up to one block."""
    if len(args) < 3 or any(k not in ("attn_mask", "dropout_p", "is_causal", "scale")
                            for k in kwargs):
        return False
    return (not kwargs.get("dropout_p", 0.0) and len(args) <= 3 and args[0].dim() >= 2
            and args[1].shape[-2] <= 512)



def batch_norm(engine, rule, key: str, x, weight, bias, running_mean, running_var,
                training, momentum, eps, cudnn_enabled=True):
    """Batch normalisation with batch statistics as torch's 16-bit CPU kernel computes it:
    mean and 1/sqrt(var + eps) in fp32 and stored in the 16-bit format (they are the
    kernel's ``save_mean``/``save_invstd`` outputs), then y = x * a + b' with
    a = invstd * weight, b' = bias - mean * a in fp32 (``batch_norm_cpu_collect_stats`` and
    ``batch_norm_cpu_transform_input`` in aten/src/ATen/native/cpu/batch_norm_kernel.cpp);
    the caller rounds y once. Running statistics are updated from the fp32 statistics."""
    dims = [0] + list(range(2, x.dim()))
    n = x.numel() // x.shape[1]
    shape = [1, -1] + [1] * (x.dim() - 2)
    var, mean = torch.var_mean(x, dims, correction=0)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.detach() * (n / max(n - 1, 1)),
                                                alpha=momentum)
    mean_q = engine.round(mean, rule, key + ".stats", grads=False)
    inv_q = engine.round(torch.rsqrt(var + eps), rule, key + ".stats", grads=False)
    a = inv_q if weight is None else inv_q * weight
    b = -mean_q * a if bias is None else bias - mean_q * a
    return x * a.view(shape) + b.view(shape)


def attention(engine, rule, key: str, q, k, v, attn_mask=None, dropout_p=0.0,
               is_causal=False, scale=None, enable_gqa=False):
    """Attention as flash-attention kernels compute it in 16 bits (FlashAttention-2, and
    torch's CPU ``FlashAttentionKernel.cpp`` for fp16/bf16): scores and softmax statistics in
    fp32, the unnormalised probabilities exp(s - max) rounded to the 16-bit format for the
    P @ V product (accumulated in fp32), divided by the fp32 row sum; the caller rounds the
    output once. (Sequences up to the kernel's 512-key block: one block, no rescaling.)"""
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        L, S = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    if attn_mask is not None:
        s = (s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
             else s + attn_mask)
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - m)
    p = engine.round(e, rule, key + ".probs", grads=False)
    return (p @ v) / e.sum(-1, keepdim=True)


def lstm(x, hx, weights, has_biases, num_layers, dropout, train, bidirectional,
          batch_first):
    """A unidirectional LSTM as ATen's CPU implementation runs it for 16-bit dtypes
    (``FullLayer`` and ``LSTMCell`` in aten/src/ATen/native/RNN.cpp): the input projection of
    the whole sequence first, then per step gates = linear(h, W_hh, b_hh) + that step's
    projection, the four activations, c = f * c + i * g and h = o * tanh(c), each op
    producing a 16-bit tensor. Run under the mode, every one of them is rounded."""
    h0, c0 = hx
    stride = 4 if has_biases else 2
    seq = x.transpose(0, 1) if batch_first else x
    hs, cs = [], []
    for layer in range(num_layers):
        w = weights[layer * stride:(layer + 1) * stride]
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        h, c = h0[layer], c0[layer]
        proj = torch.nn.functional.linear(seq, w[0], b_ih)
        outs = []
        for t in range(proj.shape[0]):
            gates = torch.nn.functional.linear(h, w[1], b_hh) + proj[t]
            i, f, g, o = gates.chunk(4, 1)
            i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
            c = f * c + i * g
            h = o * c.tanh()
            outs.append(h)
        seq = torch.stack(outs)
        hs.append(h)
        cs.append(c)
        if dropout and train and layer < num_layers - 1:
            seq = torch.nn.functional.dropout(seq, dropout)
    return (seq.transpose(0, 1) if batch_first else seq), torch.stack(hs), torch.stack(cs)
