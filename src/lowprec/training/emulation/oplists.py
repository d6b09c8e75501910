"""Which torch functions do what, for the emulation engine: by name, as torch reports them.

A :class:`torch.overrides.TorchFunctionMode` sees every call of the torch API: builtins
(``linear``, ``conv2d``, ``layer_norm``, ``scaled_dot_product_attention``), tensor methods
(``add``, ``add_``, ``view``, ``__getitem__``) and attribute reads (``__get__``). The tables here
classify them by ``func.__name__``.

The autocast lists follow PyTorch's ``aten/src/ATen/autocast_mode.cpp`` (torch 2.x): the union
of the CUDA and CPU "lower precision" lists (what ``torch.autocast`` runs in fp16/bf16) and of
their "fp32" lists (what it runs in fp32 whatever the input). Emulating a GPU's mixed precision on
a CPU is the point, so the CUDA list counts (``lstm_cell``, ``einsum``, ``addmv``), and so does
the CPU's (``prelu``, ``conv_tbc``, the fused ``lstm``/``gru`` of mkldnn).
"""

from __future__ import annotations

__all__ = ["LOWP_OPS", "FP32_OPS", "GRID_OPS", "NORM_OPS", "PASS_OPS", "BUFFER_OPS", "EMPTY_OPS",
           "BROADCAST_OPS", "reduction_axes", "is_inplace", "returns_its_input"]

# torch.autocast's lower-precision list (CUDA and CPU): inputs and weights are cast to the
# compute dtype, the result is produced in it (fp32 accumulation inside the kernel).
LOWP_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear", "addbmm", "baddbmm",
    "bmm", "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "bilinear",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "lstm", "gru", "rnn_tanh",
    "rnn_relu", "scaled_dot_product_attention", "_native_multi_head_attention",
    "__matmul__", "__rmatmul__",
})

# The additive operand of a matmul-like op (bias, attention mask): (position, keyword). Matmul
# hardware adds it to the fp32 accumulator, so block (MX) and fp8 formats do not round it: an MX
# block holding a -inf mask entry would make its whole block NaN, and e4m3fn has no -inf at all.
ACCUMULATOR_INPUTS: dict[str, tuple[int, str]] = {
    **{n: (0, "input") for n in ("addmm", "addmv", "addr", "addbmm", "baddbmm")},
    **{n: (2, "bias") for n in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                "conv_transpose2d", "conv_transpose3d", "convolution",
                                "_convolution")},
    "bilinear": (3, "bias"),
    "scaled_dot_product_attention": (3, "attn_mask"),
}

# torch.autocast's fp32 list: computed in fp32 from whatever comes in; the output is fp32.
FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "instance_norm", "norm", "nuclear_norm",
    "frobenius_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "nll_loss_nd", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "cross_entropy_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "grid_sampler",
    "sum", "prod", "cumprod", "cumsum", "softmax", "log_softmax", "_softmax", "_log_softmax",
    "avg_pool3d", "polar", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "stft",
    "linalg_vector_norm", "linalg_matrix_norm",
})

# Output values are a subset of (or rearrange) the input's values: on the input's grid.
GRID_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
    "transpose", "t", "permute", "movedim", "swapaxes", "contiguous", "expand", "expand_as",
    "__getitem__", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind",
    "tensor_split", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "flip", "roll",
    "repeat", "repeat_interleave", "tile", "index_select", "gather", "take", "masked_select",
    "relu", "relu_", "relu6", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "max", "min", "amax", "amin", "maximum",
    "minimum", "sort", "topk", "kthvalue", "median", "clone", "detach", "detach_", "embedding",
    "pad", "constant_pad_nd", "zero_", "fill_diagonal_", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "unfold", "diagonal", "triu", "tril", "dropout_eval", "alias",
    "as_strided", "T", "mT", "H", "mH", "requires_grad_",
})

# Elementwise ops that broadcast their operands: a native 16-bit backward computes each
# operand's gradient at the output's full size (rounded) before summing it down to the operand.
BROADCAST_OPS = frozenset({
    "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "rsub", "mul", "__mul__",
    "__rmul__", "div", "__truediv__", "__rtruediv__", "true_divide", "addcmul", "addcdiv",
    "where", "lerp", "maximum", "minimum", "hypot", "atan2",
})

# Uninitialised memory: nothing to round (or to report) until an op writes it.

# Normalisations: the output has the dtype of the input (args[0]), whatever their parameters'.
NORM_OPS = frozenset({"batch_norm", "instance_norm", "layer_norm", "group_norm",
                      "native_batch_norm", "rms_norm"})

# Ops that update buffers in place (running statistics): args 1 and 2 must not be replaced by
# rounded copies, and are rounded in place to the buffer format afterwards.
BUFFER_OPS = frozenset({"batch_norm", "instance_norm", "native_batch_norm"})

# Buffers whose memory is not initialised: they hold whatever bytes were there (a float32 view
# of stale memory can be 1e38 or NaN), not values any op computed. Neither rounded (rounding
# garbage makes it fp16 Inf) nor shown to observers (first_nonfinite reported
# ``x.new_empty(shape).bernoulli_(keep)``, timm's DropPath, as "8 Inf" in 19 of 20 runs under
# 16-true). The in-place op that writes them (bernoulli_, fill_, copy_, uniform_) is an op like
# any other: rounded, and observed with the values it wrote. ``resize_`` may grow a tensor into
# uninitialised memory the same way.
EMPTY_OPS = frozenset({
    "empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted",
    "resize_", "resize_as_",
})

# Calls that produce no floating values worth looking at (attribute reads, shape queries): run
# as they are, not rounded, not observed.
PASS_OPS = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "stride", "is_contiguous", "data_ptr",
    "element_size", "is_floating_point", "is_complex", "storage_offset", "__len__", "__bool__",
    "__format__", "__repr__", "__str__", "__hash__", "__eq__", "__ne__", "__lt__", "__le__",
    "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite",
    "argmax", "argmin", "argsort", "nonzero", "item", "tolist", "numpy", "__index__", "__int__",
    "__float__", "__contains__", "__iter__", "__reversed__", "__reduce_ex__", "__deepcopy__",
    "_is_view", "untyped_storage", "is_shared", "get_device", "has_names", "__array__",
    "backward", "register_hook", "retain_grad", "all", "any", "equal", "allclose", "isclose",
    "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not",
    "__and__", "__or__", "__invert__", "__xor__", "shape", "sign", "signbit",
})


_DROPOUTS = frozenset(f"{k}{u}" for k in ("dropout", "feature_dropout", "alpha_dropout",
                                           "feature_alpha_dropout") for u in ("", "_"))


def returns_its_input(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the op returns its input tensor itself: ATen's dropouts at p = 0 or out of
    training (``torch.dropout(x, 0.0, True) is x``). Inductor's decomposition returns a copy
    instead, which compiled emulation would round (a rounding eager emulation does not make,
    and a stochastic one shifts the keys of every later rounding); the engine returns the input
    for them in both."""
    if name not in _DROPOUTS or not args:
        return False
    p = args[1] if len(args) > 1 else kwargs.get("p")
    train = args[2] if len(args) > 2 else kwargs.get("train")
    return isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train)


def is_inplace(name: str) -> bool:
    """``add_``, ``relu_``, ``__iadd__``, ``__setitem__``: the call writes into args[0]."""
    if name.startswith("__"):
        return name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                        "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__")
    return name.endswith("_") and not name.startswith("_")


def reduction_axes(name: str, n_args: int, transposed: bool = False) -> list[int]:
    """The reduction axis of each tensor argument of a matmul-like op (MX blocks run along it).

    linear(x[..., in], W[out, in]): -1 and -1; mm/matmul/bmm(a[..., k], b[..., k, n]): -1 and -2;
    addmm(c, a, b): c elementwise (-1), then as mm; conv(x[N, C, ...], W[O, C/g, ...]): 1 and 1;
    conv_transpose's weight is [C, O/g, ...]: 0; attention (q, k, v): -1, -1 and -2 (the
    sequence axis of v is what attention sums over).
    """
    if name.startswith("conv_transpose"):
        return [1, 0] + [-1] * max(n_args - 2, 0)
    if name.startswith("conv") or name in ("convolution", "_convolution"):
        return [1, 0 if transposed else 1] + [-1] * max(n_args - 2, 0)
    if name in ("mm", "matmul", "bmm", "__matmul__", "__rmatmul__", "chain_matmul"):
        return [-1, -2] + [-1] * max(n_args - 2, 0)
    if name in ("addmm", "baddbmm", "addbmm"):
        return [-1, -1, -2]
    if name == "scaled_dot_product_attention":
        return [-1, -1, -2] + [-1] * max(n_args - 3, 0)
    return [-1] * n_args
