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

import torch

from ...numerics.quantize import emits_graph_ops

__all__ = ["COMPOSITES"]


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


COMPOSITES = {"cosine_similarity": cosine_similarity, "instance_norm": instance_norm}
