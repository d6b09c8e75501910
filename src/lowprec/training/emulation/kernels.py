"""Ops the emulation engine computes as torch's 16-bit CPU kernels do, not as one rounding.

Their 16-bit implementations keep an intermediate in 16 bits (batch norm's statistics, the
attention probabilities); computing them in fp32 and rounding once would be more accurate than a
16-bit run really is (layer norm: its backward keeps 16-bit buffers). Each function returns the
fp32 result the engine then rounds once; ``engine.round`` rounds the 16-bit intermediates.
Recurrent layers, every op of their cells a 16-bit tensor, are in :mod:`.recurrent_kernels`.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ...numerics import kernel as _kernel
from ...numerics.formats import BF16, BlockFormat, FixedFormat, FloatFormat
from ...numerics.ops import channel_sums_op
from ...numerics.quantize import emits_graph_ops, prepared_params, quantize
from ...numerics.rounding import Rounding
from ...numerics.storage import NATIVE_DTYPES
from .gradmarks import note_rounded, rounded_grad_

__all__ = ["batch_norm", "attention", "fexp_u20", "layer_norm", "plain_layer_norm", "plain_formats",
           "uses_batch_stats", "plain_attention", "label_kernel_nodes",
           "embedding", "plain_embedding", "SEQUENTIAL_LIMIT", "flash_possible",
           "attention_math", "split_linear", "sdpa_arguments"]

# Above this many uses of one row in a batch, the embedding's backward sums in fp32 and rounds
# once (as CUDA's kernel does) instead of replaying the CPU kernel's rounded additions.
SEQUENTIAL_LIMIT = 1024


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


_SDPA_NAMES = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(args, kwargs):
    """(q, k, v) and the keywords of a scaled_dot_product_attention call, positional ones
    (``F.multi_head_attention_forward`` passes the mask, dropout and causality by position)
    named; None when the call has arguments this module does not know."""
    if len(args) < 3 or len(args) > 3 + len(_SDPA_NAMES):
        return None
    kw = dict(zip(_SDPA_NAMES, args[3:]))
    for k, v in kwargs.items():
        if k not in _SDPA_NAMES or k in kw:
            return None
        kw[k] = v
    return tuple(args[:3]), kw


def plain_attention(args, kwargs) -> bool:
    """scaled_dot_product_attention without dropout, keys up to one block (grouped heads:
    ``enable_gqa``, as Hugging Face's sdpa attention passes it)."""
    norm = sdpa_arguments(args, kwargs)
    if norm is None:
        return False
    (q, k, _), kw = norm
    return not kw.get("dropout_p", 0.0) and q.dim() >= 2 and k.shape[-2] <= 512


class _BatchNorm(torch.autograd.Function):
    """Forward: y = x * a + b' in fp32, one fused multiply-add (the caller rounds it once).
    Backward as ``batch_norm_cpu_backward_contiguous_internal`` in
    aten/src/ATen/native/cpu/batch_norm_kernel.cpp runs for 16-bit tensors in training: with the
    statistics the forward saved (16-bit), per channel sum = sum(dy), dotp = sum((x - mean) dy)
    in fp32, k = dotp * invstd * invstd / N, and dx = (dy - sum / N - (x - mean) * k) * invstd
    * w computed in fp32 and rounded once; dweight = dotp * invstd and dbias = sum, in the
    weight's format. The statistics are constants of the backward, as in the fused kernel.
    Computed by that kernel's fp32 instantiation (``native_batch_norm_backward``) given the
    16-bit statistics: 1,345 of 40.7 M dx elements off the fp16 kernel's by one unit, against
    2,708 for the same formula in torch ops, and faster than those ops (benchmarks/RESULTS.md,
    figure F1)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, grad, stat, cuda=False, out_fmt=None,
                out_mode=None, out_keys=None):
        shape = [1, -1] + [1] * (x.dim() - 2)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.spec = (grad, stat, bias is not None)
        if cuda:  # batch_norm_elementwise (Normalization.cu): ((x - mean) * invstd) * w + b
            y = (x - mean.view(shape)) * invstd.view(shape)
            y = y if weight is None else y * weight.view(shape)
            return y if bias is None else y + bias.view(shape)
        a = invstd if weight is None else invstd * weight
        b = -mean * a if bias is None else bias - mean * a
        # the kernel's x * a + b' is contracted to a fused multiply-add (one rounding), as
        # addcmul computes it; two roundings put 1 of 300 fp16 outputs one unit off
        # (prepared_params first: None while a graph is traced, where the probe's comparison
        # would be a data-dependent guard on fake tensors: compiled emulation fell back to
        # eager where no eager step had run the probe before)
        if out_fmt is not None and (prm := prepared_params(
                out_fmt, Rounding.NEAREST_EVEN if out_mode is None else out_mode, out_keys)) \
                and _addcmul_contracts():
            # the output rounded to ``out_fmt`` (what the engine rounds it to next: to nearest,
            # or stochastically with the keys that rounding will take, ``out_keys``) in the
            # same pass, and noted so that that rounding skips it (:mod:`.gradmarks`): one pass
            # over a large activation less (benchmarks/RESULTS.md, "Issue 37, thirteenth
            # session"; stochastic: "fourteenth session")
            y = _kernel.affine_round(x, a.contiguous(), b.contiguous(), prm,
                                     out_keys is not None)
            if y is not None:
                note_rounded(y, out_fmt)
                return y
        return torch.addcmul(b.view(shape), x, a.view(shape))

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        grad, stat, has_bias = ctx.spec
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = has_bias and ctx.needs_input_grad[2]
        # the fp32 instantiation of the same kernel template, given the 16-bit statistics:
        # its formula and per-channel passes; its fp32 sums run in the float path's order,
        # which the 16-bit path's loads (two fp32 vectors per 16-bit one) may not follow
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean, invstd, True, 0.0,
            [ctx.needs_input_grad[0], want_dw, want_db])
        dx = grad(dx) if dx is not None else None
        dw = stat(dw) if want_dw else None
        db = stat(db) if want_db else None
        return dx, dw, db, None, None, None, None, None, None, None, None


def _same(t):
    return t


@functools.lru_cache(maxsize=1)
def _addcmul_contracts() -> bool:
    """Whether ATen's CPU ``addcmul(b, x, a)`` rounds ``b + x * a`` once, its multiply and add
    contracted to a fused multiply-add (as its AVX2 and AVX-512 builds are compiled), in its
    vector lanes and its scalar tail: what ``lp_affine_round`` computes. Torch's DEFAULT build
    (``ATEN_CPU_CAPABILITY=default``) rounds the product first; the batch-norm replay then keeps
    ``addcmul`` and the engine's rounding. Probed once: (1 + 2^-23)(1 - 2^-23) - 1 is -2^-46
    with one rounding, 0 with two."""
    n = 67  # whole vectors and a tail
    out = torch.addcmul(torch.full((n,), -1.0), torch.full((n,), 1 + 2.0 ** -23),
                        torch.full((n,), 1 - 2.0 ** -23))
    return bool((out == -2.0 ** -46).all())


def _batch_stats(x, running_mean, running_var, momentum, eps):
    """(mean, 1/std) of a batch as torch's fp32 CPU kernel computes them in training, the running
    statistics updated as it updates them: ``native_batch_norm``'s ``save_mean`` and
    ``save_invstd``. On a CPU tensor by ``batch_norm_update_stats``, which runs the same
    template with the variance for 1/std (var = var_sum / N in fp32), then 1 / sqrt(var + eps)
    in float64 as the template's accumulate type computes it, stored in fp32: the same bits,
    without the normalised output native_batch_norm also writes (2.2-2.6x faster on MobileNet's
    channels-last activations, AMD EPYC with AVX512-BF16: benchmarks/RESULTS.md, figure F38)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        _, mean, invstd = torch.ops.aten.native_batch_norm(
            x, None, None, running_mean, running_var, True, momentum, eps)
        return mean, invstd
    mean, var = torch.ops.aten.batch_norm_update_stats(x, running_mean, running_var, momentum)
    return mean, (1 / torch.sqrt(var.double() + eps)).float()


def _kernel_roundings(rule):
    """(stat, grad) of a 16-bit CPU kernel the engine replays: ``stat`` rounds what the kernel
    keeps in the weight's dtype (statistics, weight and bias gradients: 16 bits when the
    parameters are in the compute format), ``grad`` the input gradient it writes."""
    def stat(t):
        return quantize(t, rule.params) if rule.params == rule.compute else t

    def grad(t):  # (in place: each caller's fresh result)
        return rounded_grad_(t, rule.grads)

    return stat, grad


def batch_norm(engine, rule, key: str, x, weight, bias, running_mean, running_var,
               training, momentum, eps, cudnn_enabled=True, *, cuda=False):
    """Batch normalisation with batch statistics as torch's 16-bit CPU kernel computes it
    (``batch_norm_cpu_update_stats_template``, ``batch_norm_cpu_collect_stats`` and
    ``batch_norm_cpu_transform_input`` in aten/src/ATen/native/cpu/batch_norm_kernel.cpp and
    Normalization.cpp), then y = x * a + b' with a = invstd * weight, b' = bias - mean * a in
    fp32; the caller rounds y once. Backward: :class:`_BatchNorm`.

    Pure bf16 (the kernel's ``param_t`` is BFloat16): its statistics are 16-bit values and so
    is their arithmetic: the mean (fp32 sum / N) and the sum of squared deviations (from the
    fp32 mean) are stored in 16 bits, var = var_sum / N in 16-bit arithmetic, invstd =
    1 / sqrt(var + eps) in double, stored in 16 bits; the running statistics are updated with a
    16-bit momentum, each product and sum rounded as c10::BFloat16 arithmetic rounds it.
    Float16 (measured against torch 2.13's kernel: it keeps fp32 statistics) and other element
    formats: fp32 statistics, the mean and 1/std rounded once to the compute format, the running
    statistics updated in fp32 and stored in the parameter format. Dynamic fixed point, block
    formats and stochastic rounding (no 16-bit kernel stands for them): the same fp32
    statistics rounded to the compute format, differentiated as the fp32 kernel's backward
    given them; the input and parameter gradients are rounded where the engine rounds any
    op's.

    ``cuda``: as ATen's CUDA kernel computes it (``batch_norm_cuda`` in Normalization.cu, and
    cuDNN's where torch takes it: fp32 weights), for fp16 and bf16 alike: the statistics in
    fp32 (``save_mean`` and ``save_invstd`` of the accumulate type, never rounded), the
    running statistics updated in fp32 and stored in the buffer's format, y = ((x - mean) *
    invstd) * weight + bias in fp32 (``batch_norm_elementwise``) rounded once by the caller;
    backward as ``batch_norm_backward_elemt``: dx = (dy - mean(dy) - (x - mean) invstd^2
    mean(dy (x - mean))) invstd weight in fp32 from the 16-bit dy and x and the fp32
    statistics, rounded once; dweight and dbias fp32 sums rounded once to the weight's
    format."""
    if cuda and plain_formats(rule):
        with torch.no_grad():
            mean, invstd = _batch_stats(x, running_mean, running_var, momentum, eps)
        stat, grad = _kernel_roundings(rule)
        return _BatchNorm.apply(x, weight, bias, mean, invstd, grad, stat, True)
    if not plain_formats(rule):  # dynamic fixed point, blocks, stochastic rounding
        # fp32 statistics from torch's fp32 kernel (which also updates the running ones; one
        # pass, faster than var_mean: benchmarks/RESULTS.md, figure F2), rounded to the
        # format; y = x * a + b' and the backward through the statistics as the fp32 kernel
        # computes them given the rounded statistics (:class:`_BatchNorm`), its gradients
        # left to the roundings around the op
        with torch.no_grad():
            mean, invstd = _batch_stats(x, running_mean, running_var, momentum, eps)
        mean_q = engine.round(mean, rule, key + ".stats", grads=False)
        inv_q = engine.round(invstd, rule, key + ".stats", grads=False)
        out = (None, None, None)
        fmt = rule.compute
        if rule.rounding.is_stochastic and isinstance(fmt, (FloatFormat, FixedFormat)) and \
                not fmt.dynamic and (keys := engine.next_site_keys()) is not None:
            # the output rounded stochastically as it is computed, with the keys of the
            # rounding the engine makes next (the same bits: it then skips)
            out = (fmt, rule.rounding, keys)
        return _BatchNorm.apply(x, weight, bias, mean_q, inv_q, _same, _same, False, *out)
    with torch.no_grad():
        if rule.params == rule.compute == BF16:
            mean_q, inv_q = _bf16_stats(rule, x, running_mean, running_var, momentum, eps)
        else:
            # torch's fp32 CPU kernel: the same template the 16-bit one instantiates with fp32
            # arithmetic (two passes: the mean, then the squared deviations), so its mean and
            # 1/std round to the 16-bit kernel's (22,800 of 22,800 equal, fp16), and its running
            # statistics are the kernel's update (one pass, faster than var_mean:
            # benchmarks/RESULTS.md, figure F3; without the normalised output: :func:`_batch_stats`)
            mean, invstd = _batch_stats(x, running_mean, running_var, momentum, eps)
            mean_q = engine.round(mean, rule, key + ".stats", grads=False)
            inv_q = engine.round(invstd, rule, key + ".stats", grads=False)

    stat, grad = _kernel_roundings(rule)
    return _BatchNorm.apply(x, weight, bias, mean_q, inv_q, grad, stat, False, rule.compute)


def _channels_last_stats(x: torch.Tensor) -> bool:
    """Whether torch's CPU kernel collects ``x``'s batch statistics on its channels-last path
    (``batch_norm_cpu_collect_stats_kernel``): a channels-last (3-d too) tensor that is not
    contiguous, or a contiguous one of one value a channel and sample (N x C, N x C x 1 x 1)."""
    if x.is_contiguous():
        return x.numel() == x.shape[0] * x.shape[1]
    return (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or \
        (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))


def _plane_sums(x: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per-channel sums of a contiguous (N, C, ...) tensor (squared deviations from ``mean``)
    in the order of torch's contiguous 16-bit batch-norm statistics: 8 float32 lanes, the
    squares added by a product and a sum. Measured against torch 2.13's kernel on an AMD EPYC
    whose torch reports AVX-512 (its mixed-type instantiation, fp32 statistics): 8 lanes gave
    704 of 704 means and 1/std exactly, 16 lanes 11-25 of 64 means, fused squares 641 of 704
    1/std."""
    return _sums("plane", x.reshape(x.shape[0], x.shape[1], -1), 8, mean)


def _sums(kind: str, x: torch.Tensor, arg: int, mean: torch.Tensor | None = None):
    """The kernel's per-channel sums (``kind`` "channel": :func:`lowprec.numerics.kernel.
    channel_sums` with ``arg`` parts, "plane": ``plane_sums`` with ``arg`` lanes), or None where
    it does not take the tensors; while a graph is traced (compiled emulation), the same kernel
    as its opaque op (``lowprec::channel_sums``)."""
    if emits_graph_ops():
        return channel_sums_op()(x, kind, arg, mean) if _kernel.sums_take(kind, x, arg, mean) \
            else None
    return _kernel.sums(kind, x, arg, mean)


def _bf16_stats(rule, x, running_mean, running_var, momentum, eps):
    """Pure bf16 batch statistics as the 16-bit CPU kernel computes them (:func:`batch_norm`):
    the mean and 1/std in 16 bits, the running statistics updated in 16-bit arithmetic.

    The kernel's channels-last path (:func:`_channels_last_stats`) sums each channel over
    its threads' chunks of rows, in their order (``lowprec.numerics.kernel.channel_sums``),
    and takes the squared deviations (fp32) from the mean **stored in bf16**; with no more
    rows than threads it sums row by row (measured against torch 2.13's bf16 kernel on an
    AMD EPYC with AVX512-BF16: the bf16 mean matched 3,200 of 3,200 1/std values at N = 2,
    the fp32 mean 1,598). The contiguous path takes them from the fp32 mean, each channel's
    sum in vector lanes (:func:`_plane_sums`). Without the C kernel: torch's reductions, in
    their order."""
    dims = [0] + list(range(2, x.dim()))
    n = x.numel() // max(x.shape[1], 1)
    shape = [1, -1] + [1] * (x.dim() - 2)

    def q(t):
        return quantize(t, rule.params)

    def c(v):  # a C++ scalar converted to the 16-bit type
        return q(torch.tensor(float(v)))

    if _channels_last_stats(x) and x.device.type == "cpu" and x.numel():
        rows = x.movedim(1, -1).reshape(n, x.shape[1])  # the memory as it lies: no copy
        # no more rows than threads: one chunk, row by row
        parts = torch.get_num_threads() if n > torch.get_num_threads() else 1
        if (sums := _sums("channel", rows, parts)) is not None:
            mean = sums / n
            mean_q = q(mean)
            var_sum = q(_sums("channel", rows, parts, mean_q))
        else:  # (no kernel: torch's reductions, in their order)
            mean = rows.sum(0) / n
            mean_q = q(mean)
            var_sum = q((rows - mean_q).square_().sum(0))
    elif x.is_contiguous() and x.device.type == "cpu" and x.numel() and \
            (sums := _plane_sums(x)) is not None:
        mean = sums / n
        mean_q = q(mean)
        var_sum = q(_plane_sums(x, mean))
    else:
        mean = x.mean(dims)
        # (squared in place: the same values, a buffer fewer; 2.4 -> 1.4 ms at
        # 256 x 96 x 14 x 14, channels-last, AMD EPYC with AVX512-BF16)
        var_sum = q((x - mean.view(shape)).square_().sum(dims))
        mean_q = q(mean)
    inv_q = q((1 / torch.sqrt(q(var_sum / c(n)).double() + eps)).float())
    if running_mean is not None and running_var is not None:
        fmt = str(rule.params)
        if emits_graph_ops():  # (one opaque node: the eager ops' bits, see _running_16)
            new_mean, new_var = torch.ops.lowprec_emulation.running_16(
                mean_q, var_sum, running_mean, running_var, float(momentum), n, fmt)
        else:
            new_mean, new_var = _running_16(mean_q, var_sum, running_mean, running_var,
                                            float(momentum), n, fmt)
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return mean_q, inv_q


@torch.library.custom_op("lowprec_emulation::running_16", mutates_args=())
def _running_16(mean_q: torch.Tensor, var_sum: torch.Tensor, running_mean: torch.Tensor,
                running_var: torch.Tensor, momentum: float, n: int, fmt: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The running statistics pure bf16 batch norm keeps (:func:`_bf16_stats`): updated with a
    16-bit momentum, each product and sum rounded to ``fmt`` as c10::BFloat16 arithmetic
    rounds it. A custom op, so that compiled emulation holds it as one node running these
    ops: Inductor's code for them put a running mean one bf16 unit off eager's (a batch-norm
    CNN, bf16-true, one step)."""
    def q(t):
        return quantize(t, fmt)

    m = q(torch.tensor(momentum))
    keep = q(1 - m)
    new_mean = q(q(m * mean_q) + q(keep * running_mean))
    unbiased = q(var_sum / q(torch.tensor(float(max(n - 1, 1)))))
    return new_mean, q(m * unbiased + q(keep * running_var))


@_running_16.register_fake
def _(mean_q, var_sum, running_mean, running_var, momentum, n, fmt):
    return torch.empty_like(running_mean), torch.empty_like(running_var)


# fexp_u20 (ATen's vec512_float.h / vec256_float.h, after Malossi et al., "Fast Exponential
# Computation on SIMD Architectures"): exp(x) = 2^(x log2 e), the fraction's 2^f by a cubic
# (Horner, fused multiply-adds), the result assembled in the exponent field by an integer
# truncation. About 1e-5 relative error: enough to move fp16 roundings of exp.
_FEXP_C = (0.00010703434948458272, 0.30354260500649682, -0.22433836478672356,
           -0.079204240219773236)


def _bits(i: int) -> torch.Tensor:
    return torch.tensor([i - (1 << 32) if i >= 1 << 31 else i], dtype=torch.int32).view(
        torch.float32)[0]


def _fma(a, b, c) -> torch.Tensor:
    # fp32 fused multiply-add: the product of two fp32 values is exact in fp64
    return (a.double() * b.double() + c.double()).float()


def fexp_u20(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """ATen's vectorised ``fexp_u20`` of fp32 ``x``, bit for bit (the fp16/bf16 CPU flash
    attention's exp for whole vectors of keys). ``impl``: "kernel" (lp_fexp_u20 of the C
    kernel: a plain CPU tensor, outside a trace), "torch" (the ops below, its FMAs through
    float64) or "auto" (the kernel where it can)."""
    if impl != "torch" and type(x) is torch.Tensor and x.dtype == torch.float32 and \
            x.device.type == "cpu" and not x.requires_grad and _kernel.fexp_available():
        x = x.contiguous()
        out = torch.empty_like(x)
        _kernel.fexp_u20(x, out)
        return out
    if impl == "kernel":
        raise ValueError(f"fexp_u20(impl='kernel'): needs a float32 CPU tensor without grad "
                         f"and a kernel build with lp_fexp_u20 (available: "
                         f"{_kernel.fexp_available()}); got {x.dtype} on {x.device}")
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    c0, c1, c2, c3 = (f32(v) for v in _FEXP_C)
    lo, hi, log2e = _bits(0xC2AEAC50), _bits(0x42B17218), _bits(0x3FB8AA3B)
    src = x * log2e
    frac = src - torch.floor(src)
    poly = _fma(frac, _fma(frac, _fma(frac, c3, c2), c1), c0)
    t = _fma(f32(2.0 ** 23), src - poly, f32(2.0 ** 23 * 127))
    t = torch.nan_to_num(t, nan=0.0, posinf=2.0 ** 31 - 128, neginf=0.0).clamp(0, 2.0 ** 31 - 128)
    i = t.to(torch.int32)  # _mm512_cvttps_epi32: truncation
    i = torch.where(x < lo, torch.zeros_like(i), i)
    i = torch.where(x > hi, torch.full_like(i, 0x7F800000), i)
    return i.view(torch.float32)


def _vector_lanes() -> int:
    """fp32 lanes of the CPU kernels' vectors: ``exp`` runs as fexp_u20 on whole vectors, as
    std::exp on the remainder (``_exp_reduce_sum_fusion_kernel``)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return 16 if cap.startswith("AVX512") else 8 if cap == "AVX2" else 0


def _kernel_exp(d: torch.Tensor) -> torch.Tensor:
    e = torch.exp(d)
    if not (_vector_lanes() and d.shape[-1] >= _vector_lanes()):
        return e
    with torch.no_grad():
        fast = _fexp_values(d.detach())
    return e + (fast - e).detach()  # the kernel's values; the gradient of exp


def _whole_vectors(keys: int) -> int:
    """How many of a row's ``keys`` the kernels' exp takes as whole vectors (fexp_u20)."""
    lanes = _vector_lanes()
    return keys // lanes * lanes if lanes else 0


def _fexp_values(d: torch.Tensor) -> torch.Tensor:
    """``_kernel_exp``'s values without autograd: fexp_u20 on whole vectors, exp on the rest."""
    n = _whole_vectors(d.shape[-1])
    if not n:
        return torch.exp(d)
    if n == d.shape[-1]:
        return fexp_u20(d)
    return torch.cat([fexp_u20(d[..., :n]), torch.exp(d[..., n:])], -1)


def _flash_scores(q, k, sc, attn_mask, is_causal):
    """scale * q @ k^T, causal positions -inf, plus the mask (-inf where a bool mask is
    False): the fp32 scores both directions of the flash kernel compute."""
    return _masked_scores((q @ k.transpose(-2, -1)) * sc, attn_mask, is_causal)


def _masked_scores(s, attn_mask, is_causal, in_place: bool = False):
    """Scores with the causal positions -inf and the mask applied (-inf where a bool mask is
    False, added otherwise), as both SDPA paths do; ``in_place``: in ``s``'s own buffer (the
    same operations on the same values, so the same bits; a mask wider than the scores
    still makes a new tensor), for passes autograd does not record."""
    if is_causal:
        L, S = s.shape[-2], s.shape[-1]
        causal = torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill_(causal, float("-inf")) if in_place else \
            s.masked_fill(causal, float("-inf"))
    if attn_mask is not None:
        own = in_place and torch.broadcast_shapes(s.shape, attn_mask.shape) == s.shape and \
            torch.result_type(s, attn_mask) == s.dtype
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill_(~attn_mask, float("-inf")) if own else \
                s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s.add_(attn_mask) if own else s + attn_mask
    return s


def _scores_in_place(q, k, sc, attn_mask, is_causal):
    """:func:`_flash_scores`' values, scaled and masked in the product's own buffer (two
    passes' buffers fewer): for :class:`_FlashAttention`."""
    return _masked_scores((q @ k.transpose(-2, -1)).mul_(sc), attn_mask, is_causal, True)


def _q_split(length: int) -> int:
    # the kernels' query block (q_split_size) for a sequence of ``length`` queries
    return 256 if length >= 768 else 64 if length >= 192 else 32


def _grouped(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=-3)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """``t`` where ``torch.matmul`` can fold its batch dimensions into one by a view, else the
    contiguous copy matmul's reshape would make of it, once (a head-split view (B, H, L, D) of
    a (B, L, H * D) projection is copied at every product otherwise). The same operand, laid
    out as matmul would lay it out: the same bits, for an operand matmul gets as it is. Not for
    one it gets transposed (``k.transpose(-2, -1)``): matmul copies the transpose row-major, a
    copy of ``k`` transposed is column-major, another GEMM, other bits for one or two queries."""
    if t.dim() < 3:
        return t
    try:
        t.view(-1, t.shape[-2], t.shape[-1])
        return t
    except RuntimeError:
        return t.contiguous()


class _FlashAttention(torch.autograd.Function):
    """Forward: :func:`attention`'s values, the output rounded to ``act`` here (its backward
    reads the rounded output, as the kernel reads the 16-bit ``out``). Backward as
    ``cpu_flash_attention_backward`` (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) runs
    in 16 bits, measured against torch 2.13 on this CPU:

    * P recomputed in fp32 as exp(s - logsumexp) (ATen's vectorised exp: torch.exp's), with
      logsumexp = max + log(sum of the forward's fexp_u20 values);
    * dV += P16^T @ dO and dK += scale * dS16^T @ Q, one 16-bit rounding per query block of
      32/64/256 rows (``q_split_size``) and per query head of a key/value group (grouped
      heads: each query head's product is added to the 16-bit dK/dV buffer in turn, the
      buffer rounded after each add);
    * dP = dO @ V^T in fp32, dsum = rowsum(dO * O16) in fp32, dS = P * (dP - dsum) with the
      fp32 P, rounded to 16 bits; dQ = scale * dS16 @ K rounded once (one key block: up to 512
      keys).

    Without a mask, on plain CPU tensors, the passes over rows of scores between the products
    run fused in the kernel (``lp_attn_*`` in csrc/fexp.c; ``fuse=False``: the torch ops), the
    same fp32 operations in the same order, so the same bits (tests/numerics/test_kernel_paths,
    tests/training/test_fidelity); the masked keys' exp(-inf), which ATen computes slowly, is
    not computed."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, sc, act, grad, fuse=True):
        rep = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.shape[-3] != q.shape[-3] else 1
        K, V = _grouped(k, rep), _grouped(v, rep)
        fused = fuse and type(q) is torch.Tensor and attn_mask is None and \
            q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and \
            not torch.is_autocast_enabled("cpu") and _kernel.attention_rows_available()
        if fused:  # the passes below in one (fexp.c): the same operations, the same bits
            e = q @ K.transpose(-2, -1)
            nvec = _whole_vectors(e.shape[-1])
            m = _kernel.attn_fwd_rows(e, float(sc), is_causal, nvec)
            if nvec < e.shape[-1]:  # std::exp on the rest: _fexp_values' very call
                e[..., nvec:] = torch.exp(e[..., nvec:])
        else:
            s = _scores_in_place(q, K, sc, attn_mask, is_causal)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: zeros
            e = _fexp_values(s.sub_(m))
        total = e.sum(-1, keepdim=True)
        total = torch.where(total == 0, torch.ones_like(total), total)
        out = act((act(e) @ V).mul_(1 / total))
        ctx.save_for_backward(q, k, v, attn_mask, out, m + torch.log(total))
        ctx.spec = (is_causal, sc, act, grad, rep, fused)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, attn_mask, out, lse = ctx.saved_tensors
        is_causal, sc, act, grad, rep, fused = ctx.spec
        # (the query and the output's gradient serve two products each here, as they are:
        # copied once, if at all; the forward's one product copies as matmul would)
        q, do = _batched(q), _batched(do)
        K, V = _grouped(k, rep), _grouped(v, rep)
        dsum = (do * out).sum(-1, keepdim=True)
        if fused:  # as below, the masked keys' exp(-inf) not computed (slow in ATen: F44)
            p = q @ K.transpose(-2, -1)
            _kernel.attn_bwd_p(p, lse, float(sc), is_causal)
            ds = do @ V.transpose(-2, -1)
            _kernel.attn_bwd_ds(ds, p.exp_(), dsum, is_causal)
            ds = grad(ds)
        else:
            p = _scores_in_place(q, K, sc, attn_mask, is_causal).sub_(lse).exp_()
            ds = grad((do @ V.transpose(-2, -1)).sub_(dsum).mul_(p))  # p * (dP - dsum)
        dq = grad((ds @ K).mul_(sc)) if ctx.needs_input_grad[0] else None
        dk = dv = None
        L, split = q.shape[-2], _q_split(q.shape[-2])
        blocks = [slice(i, min(i + split, L)) for i in range(0, L, split)]

        def accumulate(parts):  # [..., H, S, D] per query block -> the 16-bit buffer's sums
            if rep > 1:
                parts = [t.unflatten(-3, (-1, rep)) for t in parts]
                parts = [t.select(-3, r) for r in range(rep) for t in parts]
            acc = grad(parts[0])
            for t in parts[1:]:
                acc = grad(acc + t)
            return acc

        if ctx.needs_input_grad[1]:
            dst = ds.transpose(-2, -1)
            dk = accumulate([(dst[..., b] @ q[..., b, :]).mul_(sc) for b in blocks])
        if ctx.needs_input_grad[2]:
            pt = act(p).transpose(-2, -1)
            dv = accumulate([pt[..., b] @ do[..., b, :] for b in blocks])
        return dq, dk, dv, None, None, None, None, None, None


def attention(engine, rule, key: str, q, k, v, attn_mask=None, dropout_p=0.0,
               is_causal=False, scale=None, enable_gqa=False):
    """Attention as torch's CPU flash kernel computes it in 16 bits (``cpu_flash_attention`` in
    aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, FlashAttention-2's algorithm): scores
    q @ k^T in fp32, scaled, masked; exp(s - max) in fp32 by the vectorised ``fexp_u20`` (whole
    vectors of keys; std::exp on the remainder), rounded to the 16-bit format for the P @ V
    product (accumulated in fp32), times 1 / (fp32 row sum of the unrounded exps); the caller
    rounds the output once. Sequences up to the kernel's 512-key block: one block, no
    rescaling. Measured: bit-exact with native fp16 on this CPU (tests/training/test_fidelity).
    Formats a 16-bit kernel stands for (:func:`plain_formats`) take the kernel's backward too
    (:class:`_FlashAttention`); others differentiate these fp32 ops."""
    sc = torch.tensor(scale if scale is not None else q.shape[-1] ** -0.5, dtype=torch.float32)
    if plain_formats(rule) and torch.is_grad_enabled() and \
            not (torch.is_tensor(attn_mask) and attn_mask.requires_grad):
        def act(t):
            return quantize(t, rule.compute)

        def grad(t):  # (in place: each a product the backward has just computed)
            return rounded_grad_(t, rule.grads)

        return _FlashAttention.apply(q, k, v, attn_mask, bool(is_causal), sc, act, grad)
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped keys and values
        k, v = _grouped(k, q.shape[-3] // k.shape[-3]), _grouped(v, q.shape[-3] // v.shape[-3])
    s = _flash_scores(q, k, sc, attn_mask, is_causal)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: zeros
    e = _kernel_exp(s - m)
    p = engine.round(e, rule, key + ".probs", grads=False)
    total = e.sum(-1, keepdim=True)
    total = torch.where(total == 0, torch.ones_like(total), total)
    return (p @ v) * (1 / total)


def split_linear(args, kwargs) -> bool:
    """F.linear(x, W, b) that aten computes as ``matmul`` then ``add`` (``at::linear`` in
    aten/src/ATen/native/Linear.cpp: a bias, an input of more than 2 dimensions that is not
    contiguous), not as one addmm."""
    if not args or not torch.is_tensor(args[0]) or args[0].dim() <= 2:
        return False
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    return torch.is_tensor(b) and not args[0].is_contiguous()


def flash_possible(args, kwargs) -> bool:
    """Whether torch's CPU SDPA would take its flash kernel: not with a mask that needs a
    gradient (T5's learned position bias) nor for 3-D inputs, where ``sdp_utils_cpp`` falls
    back to the math path."""
    (q, k, v), kw = sdpa_arguments(args, kwargs)
    mask = kw.get("attn_mask")
    if torch.is_tensor(mask) and mask.requires_grad and torch.is_grad_enabled():
        return False
    # sdp_utils_cpp's other checks: 4-D inputs, one head size, unit stride along it
    return (all(t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)) and
            q.shape[-1] == k.shape[-1] == v.shape[-1])


def attention_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """Attention as torch's math path (``_scaled_dot_product_attention_math``) computes it for
    16-bit inputs on CPU: upcast to fp32, q and k each scaled by sqrt(scale), scores, mask
    added, a safe softmax, P @ V, all in fp32; the caller rounds the output once."""
    sf = torch.tensor(scale if scale is not None else q.shape[-1] ** -0.5,
                      dtype=torch.float32).sqrt()
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k, v = _grouped(k, q.shape[-3] // k.shape[-3]), _grouped(v, q.shape[-3] // v.shape[-3])
    s = _masked_scores((q * sf) @ (k.transpose(-2, -1) * sf), attn_mask, is_causal)
    p = torch.softmax(s, -1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)  # _safe_softmax: masked rows 0
    return p @ v


def plain_layer_norm(engine, rule, args, kwargs) -> bool:
    """torch.layer_norm(input, normalized_shape, weight, bias, eps, ...) on a format the CPU
    kernel's 16-bit path stands for (IEEE-style, round to nearest)."""
    if kwargs or len(args) < 2 or not torch.is_tensor(args[0]) or not torch.is_grad_enabled():
        return False
    return plain_formats(rule)


def plain_formats(rule) -> bool:
    """IEEE-style element formats rounded to nearest: what a 16-bit CPU kernel stands for."""
    nearest = all(getattr(r, "mode", r) == Rounding.NEAREST_EVEN
                  for r in (rule.rounding, rule.grad_rounding))
    return (nearest and
            not any(isinstance(f, BlockFormat) or f.dynamic
                    for f in (rule.compute, rule.grads, rule.params)))


# Rows per thread up to which layer norm's backward replays the kernel's sequential 16-bit
# dgamma/dbeta accumulation (a Python loop, its cost per row); beyond, the weight and bias
# gradients are fp32 sums rounded once: more accurate than the kernel, a departure kept for
# speed (the benchmark transformer's 1024 rows per thread; benchmarks/RESULTS.md, figures F4
# and F5).
_MAX_SEQUENTIAL_ROWS = 256


class _LayerNorm(torch.autograd.Function):
    """Forward: fp32 layer norm (the caller rounds it once: the 16-bit kernel computes in fp32
    and rounds once, bit-exact). Backward as ``LayerNormBackwardKernelImplInternal`` in
    aten/src/ATen/native/cpu/layer_norm_kernel.cpp runs for 16-bit tensors: mean and rstd as the
    forward stored them (16 bits when the weight is 16-bit); dX = a*dy*gamma + b*x + c with
    ds, db summed in fp32, rounded once; dgamma and dbeta accumulated row by row in a 16-bit
    buffer per thread (each add rounded), the threads' buffers summed in fp32 and rounded."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, act, stat, grad, cuda=False):
        # the output and the statistics of one fp32 kernel call, the template the 16-bit
        # kernel instantiates (its statistics round to the 16-bit kernel's more often than
        # var_mean's: 102 against 164 of 420,800 off, and one pass fewer)
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, list(shape), weight, bias, eps)
        if not cuda:  # CUDA's layer_norm_cuda keeps them in fp32 (the accumulate type)
            mean, rstd = stat(mean), stat(rstd)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.spec = (len(shape), act, grad, stat, bias is not None, cuda)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        nshape, act, grad, stat, has_bias, cuda = ctx.spec
        shape = list(x.shape[x.dim() - nshape:])
        n = 1
        for s in shape:
            n *= s
        m = x.numel() // n if n else 0
        want_w = weight is not None and ctx.needs_input_grad[1]
        want_b = has_bias and ctx.needs_input_grad[2]
        # at::parallel_for(0, M, 1): thread t takes rows [t*chunk, (t+1)*chunk)
        threads = max(1, min(torch.get_num_threads(), m))
        chunk = -(-m // threads)
        # speed: fp32 sums, rounded once; CUDA's GammaBetaBackward sums them so
        summed = cuda or chunk > _MAX_SEQUENTIAL_ROWS
        # dX (and, beyond the sequential limit, dgamma and dbeta as fp32 sums) from the fp32
        # instantiation of the kernel template, given the 16-bit statistics: its formula and
        # per-row passes in one call (faster than the same formula in torch ops:
        # benchmarks/RESULTS.md, figure F6; 58 against 63 of 458,752 fp16 dX elements off the 16-bit
        # kernel's, 5 against 13 bf16)
        dx, dw, dbias = torch.ops.aten.native_layer_norm_backward(
            dy, x, shape, mean, rstd, weight, None,
            [ctx.needs_input_grad[0], summed and want_w, False])
        dx = grad(dx) if dx is not None else None  # the noted tensor returned
        if not (want_w or want_b):
            return dx, None, None, None, None, None, None, None, None
        if summed:
            # dbeta = sum(dy) over rows (the kernel is asked for dgamma alone: no bias here)
            dgamma = dw.reshape(-1) if want_w else torch.zeros(n, device=x.device)
            tot = stat(torch.cat([dgamma, dy.reshape(-1, n).sum(0)]))
        else:
            X, dY = x.reshape(-1, n), dy.reshape(-1, n)
            a, mu = rstd.reshape(-1, 1), mean.reshape(-1, 1)
            pad = threads * chunk - m
            xh = (a * X + (-a * mu)) * dY  # dy * (a*x + b'), fp32, per row
            rows = torch.nn.functional.pad(torch.cat([xh, dY], 1), (0, 0, 0, pad))
            rows = rows.reshape(threads, chunk, 2 * n).transpose(0, 1).contiguous()
            buf = torch.zeros(threads, 2 * n, device=x.device)  # [dgamma | dbeta], a row a thread
            for r in range(chunk):  # sequential: each add rounded to the 16-bit buffer
                buf = act(buf + rows[r])
            tot = stat(buf.sum(0))
        dw = tot[:n].reshape(shape) if want_w else None
        dbias = tot[n:].reshape(shape) if want_b else None
        return dx, dw, dbias, None, None, None, None, None, None


class _NativeLayerNorm(torch.autograd.Function):
    """``match_cpu_kernels=True``: layer norm run by torch's own CPU 16-bit kernel, forward and
    backward, on 16-bit copies of operands already on the 16-bit grid (exact casts).

    The fp32 template (:class:`_LayerNorm`) rounds to the 16-bit kernel's output on all but a
    few elements: the 16-bit kernel's ``RowwiseMoments`` loads 16-bit vectors (32 lanes with
    AVX-512, 16 with AVX2) into two fp32 registers each, so its Welford cascade combines other
    partial moments than the fp32 kernel's, and its mean and rstd differ in the last fp32 bit
    now and then (fp16, width 768: 3 of 49,152 outputs one unit off; width 32: 0-1 of 4096).
    Its backward's dX sums ds and db in its own order too. Calling the kernel is its order on
    every CPU, whatever the vector width."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, dtype, fmt):
        x16, w16, b16 = (None if t is None else t.to(dtype) for t in (x, weight, bias))
        y, mean, rstd = torch.ops.aten.native_layer_norm(x16, list(shape), w16, b16, eps)
        ctx.save_for_backward(x16, w16, b16, mean, rstd)
        ctx.shape, ctx.dtype, ctx.fmt = list(shape), dtype, fmt
        return y.float()

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x16, w16, b16, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], w16 is not None and ctx.needs_input_grad[1],
                b16 is not None and ctx.needs_input_grad[2]]
        grads = torch.ops.aten.native_layer_norm_backward(
            dy.to(ctx.dtype), x16, ctx.shape, mean, rstd, w16, b16, mask)
        dx, dw, db = (g.float() if g is not None and want else None
                      for g, want in zip(grads, mask))
        if dx is not None:
            note_rounded(dx, ctx.fmt)  # the kernel's 16-bit dX: on the gradient grid
        return dx, dw, db, None, None, None, None


def native_layer_norm_dtype(engine, rule, x, weight, bias):
    """The torch dtype whose CPU kernel ``match_cpu_kernels`` runs layer norm on, or None: a
    pure 16-bit rule rounded to nearest (parameters, compute and gradients one float16 or
    bfloat16 format: what ``model.half()`` / ``model.bfloat16()`` runs), fp32 CPU tensors."""
    dtype = NATIVE_DTYPES.get(rule.compute)
    if not engine.match_cpu_kernels or dtype is None or \
            not rule.params == rule.grads == rule.compute:
        return None
    tensors = [t for t in (x, weight, bias) if t is not None]
    if not all(torch.is_tensor(t) and t.device.type == "cpu" and t.dtype == torch.float32
               for t in tensors):
        return None
    return dtype


def layer_norm(engine, rule, key: str, x, shape, weight=None, bias=None, eps=1e-5,
               cudnn_enable=True, *, cuda=False):
    """Layer norm with the CPU 16-bit kernel's backward (:class:`_LayerNorm`); with
    ``match_cpu_kernels`` on a pure 16-bit rule, the kernel itself (:class:`_NativeLayerNorm`).

    ``cuda``: as ``layer_norm_cuda`` and ``LayerNormBackwardKernelImpl``
    (aten/src/ATen/native/cuda/layer_norm_kernel.cu) compute it: the same fp32 forward rounded
    once, mean and rstd kept in fp32 (the accumulate type), dX in fp32 from the 16-bit dY, X
    and gamma and the fp32 statistics, rounded once; dgamma and dbeta fp32 sums over the rows
    (``GammaBetaBackward``), rounded once to gamma's format."""

    if not cuda and (native := native_layer_norm_dtype(engine, rule, x, weight, bias)) is not None:
        return _NativeLayerNorm.apply(x, weight, bias, tuple(shape), eps, native, rule.grads)
    dtype = NATIVE_DTYPES.get(rule.compute)
    if dtype is not None:  # torch's cast rounds to nearest even, as quantize does: faster
        def act(t):
            return t.to(dtype).float()
    else:
        def act(t):
            return quantize(t, rule.compute)

    stat, grad = _kernel_roundings(rule)
    return _LayerNorm.apply(x, weight, bias, tuple(shape), eps, act, stat, grad, cuda)


def plain_embedding(args, kwargs) -> bool:
    """torch.embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse) with a
    dense gradient and no frequency scaling."""
    a = list(args) + [None] * (5 - len(args))
    scale = kwargs.get("scale_grad_by_freq", a[3])
    sparse = kwargs.get("sparse", a[4])
    return (len(args) >= 2 and torch.is_tensor(args[0]) and args[0].requires_grad
            and args[0].dim() == 2 and not scale and not sparse)


@torch.library.custom_op("lowprec_emulation::embedding_backward", mutates_args=())
def _embedding_backward(g: torch.Tensor, indices: torch.Tensor, rows: int, padding_idx: int,
                        fmt: str, rounding: str) -> torch.Tensor:
    """An embedding's 16-bit weight gradient as ``embedding_dense_backward_cpu`` computes it
    for 16-bit weights: ``index_add_`` into a 16-bit gradient, each addition rounded, in the
    order of the indices (fp32 once above ``SEQUENTIAL_LIMIT`` uses of a row). A custom op, so
    that a compiled graph holds it as one node: how many additions a row takes depends on the
    indices' values, which a trace cannot follow. ``padding_idx`` -1: none."""
    ids = indices.reshape(-1)
    g = g.reshape(-1, g.shape[-1])
    if padding_idx >= 0:
        keep = ids != padding_idx
        ids, g = ids[keep], g[keep]
    acc = torch.zeros((rows, g.shape[1]), dtype=g.dtype, device=g.device)
    if ids.numel() == 0:
        return acc
    if int(torch.bincount(ids).max()) > SEQUENTIAL_LIMIT:
        return quantize(acc.index_add_(0, ids, g), fmt, rounding)
    # the compiled kernel: every addition in turn, one pass (the same bits as the loop below;
    # 2,048 uses of 256 rows of 128 values: 0.2 ms for the loop's 1.6-4.2 ms, AMD EPYC
    # AVX512-BF16); quantize's own parameters for (fmt, rounding), prepared by one call
    prm = prepared_params(fmt, rounding)
    if prm is None and acc.device.type == "cpu":
        quantize(g[:1], fmt, rounding)
        prm = prepared_params(fmt, rounding)
    if prm is not None and _kernel.index_add_rounded(acc, ids.to(torch.int64).contiguous(),
                                                     g.contiguous(), prm):
        return acc
    # the rank of each use among the uses of its row, in index order: additions of equal
    # rank touch distinct rows and run together; ranks run in order
    order = torch.argsort(ids, stable=True)
    srt = ids[order]
    pos = torch.arange(srt.numel(), device=ids.device)
    first = torch.ones_like(srt, dtype=torch.bool)
    first[1:] = srt[1:] != srt[:-1]
    rank_sorted = pos - torch.where(first, pos, 0).cummax(0).values
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    for k in range(int(rank_sorted.max()) + 1):
        sel = (rank == k).nonzero().squeeze(1)
        rows_k = ids[sel]
        acc[rows_k] = quantize(acc[rows_k] + g[sel], fmt, rounding)
    return acc


@_embedding_backward.register_fake
def _(g, indices, rows, padding_idx, fmt, rounding):
    return g.new_empty((rows, g.shape[-1]))


class _Embedding(torch.autograd.Function):
    """Forward: the rows (a selection). Backward: :func:`_embedding_backward`."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx, fmt, mode, cuda=False):
        ctx.save_for_backward(indices)
        ctx.spec = (weight.shape[0], padding_idx, str(fmt), Rounding(mode).value, cuda)
        return torch.embedding(weight, indices, -1 if padding_idx is None else padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (indices,) = ctx.saved_tensors
        rows, padding_idx, fmt, mode, cuda = ctx.spec
        pad = -1 if padding_idx is None or padding_idx < 0 else padding_idx
        if cuda:
            # embedding_dense_backward_cuda: each row's uses summed in fp32 (the accumulate
            # type), the 16-bit gradient written once
            ids, g2 = indices.reshape(-1), g.reshape(-1, g.shape[-1])
            if pad >= 0:
                keep = ids != pad
                ids, g2 = ids[keep], g2[keep]
            acc = torch.zeros((rows, g2.shape[1]), dtype=g2.dtype, device=g2.device)
            return quantize(acc.index_add_(0, ids, g2), fmt, mode), None, None, None, None, None
        grad = torch.ops.lowprec_emulation.embedding_backward(g, indices, rows, pad, fmt, mode)
        return grad, None, None, None, None, None


def embedding(engine, rule, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
              sparse=False, *, cuda=False):
    fmt = rule.params
    if fmt not in NATIVE_DTYPES or NATIVE_DTYPES[fmt] == torch.float32:
        return torch.embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    pad = None if padding_idx is None or padding_idx < 0 else padding_idx
    return _Embedding.apply(weight, indices, pad, fmt, Rounding.NEAREST_EVEN, cuda)
