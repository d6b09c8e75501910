"""``quantize``: map a tensor onto a number format's grid, exactly, with any rounding mode.

One pure function does the numerics; modules, optimizers and analysis are thin wrappers over it.
Two paths compute it with identical bits: the compiled kernel (float32 CPU tensors, one fused
pass, several threads) and a plain-torch path (any device). ``impl=`` chooses one explicitly,
which the tests and the benchmark use to compare them.

Inside ``torch.compile`` (``torch.compiler.is_compiling()``), :func:`quantize` and
:func:`quantize_` are one node of the graph: ``lowprec::quantize_fused``, the kernel's integer
algorithm as int32 torch ops (:mod:`.fused`), which AOTAutograd expands and Inductor fuses into
the neighbouring kernels, for every format but dynamic fixed point (and tensors of 2**31
elements or more); otherwise the opaque ``lowprec::quantize`` custom op (:mod:`.ops`), whose
implementation is this eager function (compiled emulation takes it for stochastic rounding on a
CPU too: :func:`tracing_graph`). Either way compiled code gets the eager bits.
``impl="op"`` or ``impl="fused"`` picks one of them explicitly, eagerly too. The format and
rounding become constants of the graph; stochastic rounding's two keys travel as a tensor,
``seed=`` (:func:`seed_tensor` draws them from a generator, as the eager path does), because
a graph cannot hold a ``torch.Generator``: given a generator instead, the keys are drawn
outside the graph (one graph break; ``fullgraph=True`` refuses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Literal

import torch

from . import fused as _fused, kernel as _kernel, reference as _reference
from .params import (NAN_SHIFT, R_NEAREST_EVEN, R_STOCHASTIC, ROUNDING_CODES, element_params,
                     random_mask)
from .formats import BinaryFormat, BlockFormat, FixedFormat, FloatFormat, Format, parse_format
from .rounding import Rounding, check_generator, parse_rounding

__all__ = ["quantize", "quantize_", "draw_seed", "seed_tensor", "block_shifts", "tracing_graph",
           "memory_order", "batched_transpose",
           "emits_graph_ops", "prepared_params", "quantize_counting_"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# formats whose nearest-even rounding torch's casts perform exactly (the plain-torch fast path)
_NATIVE_CASTS = {
    FloatFormat(5, 10): torch.float16,
    FloatFormat(8, 7): torch.bfloat16,
    FloatFormat(5, 2): torch.float8_e5m2,
    FloatFormat(4, 3, "fn", overflow="saturate"): torch.float8_e4m3fn,
}
Impl = Literal["auto", "kernel", "torch", "fused", "op"]
_IMPLS = ("auto", "kernel", "torch", "fused", "op")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# (fmt, rounding) as given -> the kernel's parameters (kernel.prepare), for quantize's fast path:
# deterministic modes, and stochastic ones given their keys as two ints (the eager engine)
_PREPARED: dict = {}
_PREPARED_KEYED: dict = {}


_STOCHASTIC_CODE = R_STOCHASTIC


def _prepare(key, fmt, code: int, rmask: int, table: dict = _PREPARED) -> None:
    try:
        if key not in table and len(table) < 4096:
            table[key] = _kernel.prepare(element_params(fmt), code, rmask)
    except TypeError:  # an unhashable format object: no fast path for it
        pass


def _prepared(table: dict, fmt, rounding):
    """What :func:`_prepare` put in ``table`` for (fmt, rounding) as given, else None (an
    unhashable argument too: the full path's checks then say what is wrong)."""
    try:
        return table.get((fmt, rounding))
    except TypeError:
        return None


def prepared_params(fmt, rounding, seed: tuple[int, int] | None = None):
    """The kernel's parameters of rounding to ``fmt`` by ``rounding`` (as given), as
    :func:`quantize`'s fast path prepared them at a first call with these arguments; None before
    that call, without a kernel, or inside a trace (graph ops there). ``seed``: stochastic
    rounding's two keys as ints, set in a copy of the parameters a first call with keys
    prepared. For kernels fusing a rounding with other work
    (:func:`lowprec.numerics.kernel.round_sum_delta`), so that it gives quantize's bits."""
    if emits_graph_ops():
        return None
    if seed is None:
        return _prepared(_PREPARED, fmt, rounding)
    prm = _prepared(_PREPARED_KEYED, fmt, rounding)
    return None if prm is None else _kernel.with_keys(prm, *_keys_of(seed))


def _keys_given(seed, generator) -> bool:
    """Whether stochastic rounding's keys are given as values the fast path reads: two ints
    (the eager engine's) or a CPU tensor of them (compiled emulation's opaque op gets them so)."""
    return generator is None and (type(seed) is tuple or (
        type(seed) is torch.Tensor and seed.device.type == "cpu"))


_TRACING = threading.local()


@contextlib.contextmanager
def tracing_graph(stochastic_kernel: bool = False):
    """Inside this block (in this thread) :func:`quantize` and :func:`quantize_` emit graph
    ops, as inside ``torch.compile``: for code that traces outside Dynamo (compiled emulation's
    backend runs the engine under AOTAutograd), where torch before 2.13 reports
    ``is_compiling()`` False (seen with torch 2.11: the eager path then read a traced seed's
    values). ``stochastic_kernel``: stochastic rounding of a CPU tensor as the opaque op, one
    pass of the C kernel (where it is built), instead of the fused decomposition, whose
    random-word hash (some 36 int32 ops per rounding, each in a vector and a scalar variant)
    was most of compiled emulation's first step under q6.10-sr and ran slower than the kernel
    (benchmarks/RESULTS.md, "Issue 37, fourth session")."""
    old = getattr(_TRACING, "on", False), getattr(_TRACING, "sr_kernel", False)
    _TRACING.on, _TRACING.sr_kernel = True, stochastic_kernel
    try:
        yield
    finally:
        _TRACING.on, _TRACING.sr_kernel = old


def emits_graph_ops() -> bool:
    """Whether :func:`quantize` emits graph ops now (inside ``torch.compile`` or
    :func:`tracing_graph`): code that calls the kernel on a tensor's memory must not then."""
    return getattr(_TRACING, "on", False) or torch.compiler.is_compiling()


def seed_tensor(generator: torch.Generator | None = None) -> torch.Tensor:
    """Two 32-bit keys for the counter-based generator of stochastic rounding, as an int64
    tensor of shape (2,) on the generator's device: what ``quantize(..., seed=)`` takes.

    They come from ``generator`` (or torch's default CPU generator, i.e. ``torch.manual_seed``),
    so the same seed gives the same bits on any device and any number of threads;
    ``quantize(x, fmt, "stochastic", seed=seed_tensor(g))`` equals ``quantize(x, fmt,
    "stochastic", generator=g)`` from the same state of ``g``.
    """
    check_generator(generator)
    device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2**32, (2,), generator=generator, dtype=torch.int64, device=device)


def draw_seed(generator: torch.Generator | None = None) -> tuple[int, int]:
    """:func:`seed_tensor`'s two keys as Python integers."""
    k0, k1 = seed_tensor(generator).tolist()
    return int(k0), int(k1)


def _keys_of(seed) -> tuple[int, int]:
    """The two keys of a ``seed=`` tensor (or pair of ints); TypeError or ValueError naming
    what is wrong."""
    if isinstance(seed, tuple) and len(seed) == 2 and all(type(k) is int for k in seed):
        if not all(0 <= k < 2**32 for k in seed):
            raise ValueError(f"seed keys must lie in [0, 2**32), got {seed[0]}, {seed[1]}")
        return seed
    if not torch.is_tensor(seed) or seed.is_floating_point() or seed.is_complex() \
            or seed.dtype == torch.bool:
        raise TypeError(f"seed must be an integer tensor of two keys (lowprec.numerics."
                        f"quantize.seed_tensor), got {type(seed).__name__}"
                        + (f" of {seed.dtype}" if torch.is_tensor(seed) else ""))
    if seed.numel() != 2:
        raise ValueError(f"seed must hold two keys, got {seed.numel()} values")
    k0, k1 = (int(v) for v in seed.reshape(2).tolist())
    if not (0 <= k0 < 2**32 and 0 <= k1 < 2**32):
        raise ValueError(f"seed keys must lie in [0, 2**32), got {k0}, {k1}")
    return k0, k1


def _check_input(x) -> None:
    if not torch.is_tensor(x):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        accepted = ", ".join(str(d) for d in _DTYPES)
        raise TypeError(f"quantize expects a floating tensor of dtype {accepted}; got {x.dtype}")


def _use_kernel(x: torch.Tensor, impl: Impl) -> bool:
    if impl == "torch":
        return False
    ok = x.device.type == "cpu" and _kernel.available()
    if impl == "kernel" and not ok:
        raise RuntimeError("the compiled kernel is not available for this tensor "
                           f"(device {x.device}, kernel loaded: {_kernel.available()})")
    return ok


def _on_accelerator(x: torch.Tensor) -> bool:
    """Whether ``quantize`` rounds ``x`` by the fused decomposition's ops eagerly (a GPU)."""
    return x.device.type not in ("cpu", "meta")


#: elements the decomposition rounds at once on a GPU: its int32 temporaries take about 20
#: times the input's bytes (1.3 GB at this size)
_DEVICE_CHUNK = 1 << 24


def _fused_on_device(xf: torch.Tensor, fmt, mode: Rounding, rbits: int, keys) -> torch.Tensor:
    """The fused decomposition eagerly on a GPU, in slices of :data:`_DEVICE_CHUNK` elements
    (the random words of each slice drawn at their logical indices, so the bits are the whole
    tensor's); block formats in slices of whole rows along their axis (a row longer than a
    slice, or one scale for the whole tensor, takes the chunked reference path)."""
    n = xf.numel()
    if n <= _DEVICE_CHUNK:
        return _fused.quantize_fused(xf, fmt, mode, rbits, keys)
    code, rmask = ROUNDING_CODES[mode], random_mask(rbits) if mode.is_stochastic else 0
    if isinstance(fmt, BlockFormat):
        return _fused_blocks_on_device(xf, fmt, code, rmask, keys)
    flat = xf.reshape(-1)  # row-major: the logical index of each element
    out = torch.empty_like(flat)
    for start in range(0, n, _DEVICE_CHUNK):
        stop = min(start + _DEVICE_CHUNK, n)
        out[start:stop] = _fused._elementwise(flat[start:stop], fmt, code, rmask, keys, start)
    return out.reshape(xf.shape)


def _fused_blocks_on_device(xf: torch.Tensor, fmt: BlockFormat, code: int, rmask: int, keys
                            ) -> torch.Tensor:
    axis = fmt.axis if fmt.axis >= 0 else xf.dim() + fmt.axis
    row_len = xf.shape[axis] if 0 <= axis < xf.dim() else 0
    if fmt.block_size is None or fmt.block_size > _DEVICE_CHUNK or row_len == 0:
        seed = _keys_of(keys) if keys is not None else (0, 0)
        return _blocks(xf, fmt, code, rmask, seed, "torch")
    moved = xf.movedim(axis, -1)
    rows = moved.reshape(-1, row_len)  # the layout fused._blocks numbers the elements in
    last = dataclasses.replace(fmt, axis=-1)
    out = torch.empty_like(rows)
    padded = -(-row_len // fmt.block_size) * fmt.block_size  # a row as fused._blocks pads it
    if padded <= _DEVICE_CHUNK:  # slices of whole rows
        step = _DEVICE_CHUNK // padded
        for r0 in range(0, rows.shape[0], step):
            out[r0:r0 + step] = _fused._blocks(rows[r0:r0 + step], last, code, rmask, keys,
                                               r0 * row_len)
    else:  # long rows (a 1-d tensor): pieces of whole blocks
        seg = _DEVICE_CHUNK // fmt.block_size * fmt.block_size
        for r in range(rows.shape[0]):
            for c0 in range(0, row_len, seg):
                out[r, c0:c0 + seg] = _fused._blocks(rows[r:r + 1, c0:c0 + seg], last, code,
                                                     rmask, keys, r * row_len + c0)
    return out.reshape(moved.shape).movedim(-1, axis)


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``x``'s dimensions that lists them in memory order, where ``x`` is
    dense but not contiguous (channels-last, a transposed matrix): ``x.permute(p)`` is then a
    contiguous view of the same memory. None for a contiguous tensor or one with gaps or
    overlaps. A deterministic rounding is elementwise, so it may run over that view and write
    an output of ``x``'s own strides: no copy to row-major order and back (a channels-last
    convolution's output, which ``.contiguous()`` would transpose)."""
    if x.dim() < 2 or x.is_contiguous():
        return None
    perm = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    return perm if x.permute(perm).is_contiguous() else None


def batched_transpose(x: torch.Tensor, perm: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(batch, rows, cols) where ``x``'s memory order ``perm`` (:func:`memory_order`) holds
    ``x`` as (batch, rows, cols) row-major while ``x`` itself is (batch, cols, rows): the first
    dimensions in place, then the last group before a middle group (channels-last
    (N, C, H, W): batch N, rows H*W, cols C; a transposed matrix: batch 1). None otherwise."""
    d = len(perm)
    k = 0
    while k < d and perm[k] == k:
        k += 1
    for b in range(1, d - k):  # logical dims k..k+b-1 (cols) stored last
        if perm[k:] == tuple(range(k + b, d)) + tuple(range(k, k + b)):
            shape = x.shape
            return (math.prod(shape[:k]), math.prod(shape[k + b:]), math.prod(shape[k:k + b]))
    return None


def _in_layout(x: torch.Tensor, out: torch.Tensor | None, prm, stochastic: bool
               ) -> torch.Tensor | None:
    """The kernel's rounding (parameters ``prm``) of a dense float32 CPU tensor that is not
    contiguous, into ``out`` or a new tensor of ``x``'s strides, with no row-major copy; None
    where the layout needs one. A deterministic rounding runs over the memory in its order; a
    stochastic one draws each element's random bits from its row-major index, so only a
    batched transpose (channels-last, a transposed matrix) is rounded in place of its layout,
    in memory order, each element's random counter computed from its logical index (below 256
    channels in 2-D tiles of whole memory rows, the counters of a tile computed for a power of
    two, read from a table otherwise; ``lp_quantize_f32_bt``)."""
    if not stochastic and out is None and x.dim() == 4 and \
            x.is_contiguous(memory_format=torch.channels_last):
        # (the commonest case, a channels-last activation, without the general layout
        # analysis: the kernel reads the dense memory as it lies, whatever the order)
        out = torch.empty_like(x)
        _kernel.quantize_prepared(x, out, prm)
        return out
    perm = memory_order(x)
    if perm is None or (out is not None and out.stride() != x.stride()):
        return None
    bt = None
    if stochastic:
        bt = batched_transpose(x, perm) if x.numel() < 2**32 and \
            _kernel.transposed_available() else None
        if bt is None:
            return None
    out = torch.empty_like(x) if out is None else out  # x's strides: x is dense
    if bt is None:
        _kernel.quantize_prepared(x.permute(perm), out.permute(perm), prm)
    else:
        _kernel.quantize_transposed(x.permute(perm), out.permute(perm), *bt, prm)
    return out


def _elementwise(xf: torch.Tensor, fmt, code: int, rmask: int, seed, impl: Impl,
                 out: torch.Tensor | None) -> torch.Tensor:
    ep = element_params(fmt)
    if _use_kernel(xf, impl):
        if not xf.is_contiguous():
            prm = _kernel.with_keys(_kernel.prepare(ep, code, rmask), *seed)
            done = _in_layout(xf, out, prm, code == _STOCHASTIC_CODE)
            if done is not None:
                return done
        xc = xf.contiguous()
        if out is None:  # (xf's strides where it is contiguous: those of size-1 dimensions too)
            out = torch.empty_like(xc)
        _kernel.quantize_f32(xc, out, ep, code, rmask, seed)
        return out
    native = _NATIVE_CASTS.get(fmt) if code == R_NEAREST_EVEN else None
    if native is not None:
        # torch's own cast rounds to nearest-even with these exact overflow rules; NaNs keep
        # their input bits, as in the kernel. e4m3fn saturates: CPU casts do, CUDA's give NaN
        # beyond 464 (seen on an H200, torch 2.11), so clamped first (NaN passes clamp)
        src = xf.clamp(-448.0, 448.0) if native == torch.float8_e4m3fn else xf
        res = torch.where(torch.isnan(xf), xf, src.to(native).float())
    else:
        res = _reference.quantize_f32(xf, ep, code, rmask, seed)
    if out is not None:
        out.copy_(res)
        return out
    return res


def block_shifts(x_rows: torch.Tensor, fmt: BlockFormat, block: int,
                 impl: Impl = "auto") -> torch.Tensor:
    """Scale exponent of every block of ``x_rows`` (float32, shape (rows, row_len)), int32:
    by the kernel (``impl`` "auto" on a contiguous CPU tensor, or "kernel") or torch ops.

    s = floor(log2(amax)) - element.emax, clamped to [scale_min_exp, scale_max_exp]; an all-zero
    block gets scale_min_exp; a block holding NaN or Inf gets the NaN marker.
    """
    rows, row_len = x_rows.shape
    el = fmt.element
    dynamic_fixed = (fmt.block_size is None and isinstance(el, FixedFormat) and el.signed
                     and not el.symmetric)
    if (impl != "torch" and not dynamic_fixed and fmt.block_size is not None
            and type(x_rows) is torch.Tensor and x_rows.device.type == "cpu"
            and x_rows.dtype == torch.float32 and x_rows.is_contiguous()
            and not x_rows.requires_grad and x_rows.numel() and _kernel.available()
            and _kernel.block_shifts_available() and not emits_graph_ops()):
        # one pass in the kernel, faster than torch ops (benchmarks/RESULTS.md, figure F8)
        return _kernel.block_shifts(x_rows, block, fmt.element.emax, fmt.scale_min_exp,
                                    fmt.scale_max_exp)
    a = x_rows.abs()
    nfull, rem = divmod(row_len, block)
    parts = []
    if nfull:  # whole blocks as a (rows, nfull, block) view: no copy, no padding
        parts.append(a[:, :nfull * block].reshape(rows, nfull, block).amax(dim=-1))
    if rem:  # the last, shorter block of each row
        parts.append(a[:, nfull * block:].amax(dim=-1, keepdim=True))
    amax = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if dynamic_fixed:
        # dynamic fixed point: the range is the smallest holding every value in two's
        # complement, [-2**r, 2**r) (Courbariaux et al. 2014), so a most negative value of
        # exactly -2**k fits at the scale below the one its magnitude alone would give: look at
        # it just below its magnitude. Without this, -2**k rounded in one call raises the next
        # call's scale and quantize is not idempotent. (MX keeps OCP's max|V| rule.)
        neg = (-x_rows).amax(dim=-1, keepdim=True)
        pos = x_rows.amax(dim=-1, keepdim=True)
        tight = torch.maximum(pos, torch.nextafter(neg, torch.zeros_like(neg)))
        amax = torch.where(torch.isfinite(amax), torch.maximum(tight, torch.zeros_like(tight)),
                           amax)
    # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly
    _, e = torch.frexp(amax)
    s = (e.to(torch.int32) - 1 - fmt.element.emax).clamp(fmt.scale_min_exp, fmt.scale_max_exp)
    s = torch.where(amax == 0, fmt.scale_min_exp, s)
    s = torch.where(torch.isfinite(amax), s, NAN_SHIFT)
    return s.to(torch.int32).contiguous()


def _blocks(xf: torch.Tensor, fmt: BlockFormat, code: int, rmask: int, seed,
            impl: Impl) -> torch.Tensor:
    if xf.dim() == 0:
        xf = xf.reshape(1)
        return _blocks(xf, fmt, code, rmask, seed, impl).reshape(())
    axis = fmt.axis if fmt.axis >= 0 else xf.dim() + fmt.axis
    if not 0 <= axis < xf.dim():
        raise ValueError(f"block axis {fmt.axis} is out of range for a {xf.dim()}-d tensor")
    # the blocks' axis last: where it lies last in memory too (a channels-last activation's
    # channels), the kernel reads x and writes a tensor of x's layout in place, no copies
    moved = xf.movedim(axis, -1)
    in_place = moved.is_contiguous() and _use_kernel(xf, impl)
    moved = moved if in_place else moved.contiguous()
    if fmt.block_size is None:  # one exponent for the whole tensor
        rows, row_len, block = 1, moved.numel(), moved.numel()
    else:
        row_len = moved.shape[-1]
        rows, block = moved.numel() // row_len, fmt.block_size
    flat = moved.reshape(rows, row_len)
    shifts = block_shifts(flat, fmt, block, impl)
    ep = element_params(fmt.element)
    if in_place:
        full = torch.empty_like(xf)  # x's strides (x is dense): its blocks' axis last as well
        dst = full.movedim(axis, -1)
        if dst.is_contiguous():
            _kernel.quantize_blocks_f32(flat, dst.view(rows, row_len), row_len, block, shifts,
                                        ep, code, rmask, seed)
            return full
    if _use_kernel(xf, impl):
        out = torch.empty_like(flat)
        _kernel.quantize_blocks_f32(flat, out, row_len, block, shifts, ep, code, rmask, seed)
    else:
        sh = shifts.to(torch.int64).repeat_interleave(block, dim=1)[:, :row_len].reshape(-1)
        out = _reference.quantize_f32(flat, ep, code, rmask, seed, sh)
    return out.reshape(moved.shape).movedim(-1, axis).contiguous()


def _binary(xf: torch.Tensor) -> torch.Tensor:
    # sign with 0 (and -0) mapped to +1, as in BinaryNet; NaN stays NaN
    one = torch.ones_like(xf)
    return torch.where(torch.isnan(xf), xf, torch.where(xf < 0, -one, one))


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    rounding: str | Rounding = "nearest",
    *,
    generator: torch.Generator | None = None,
    random_bits: int | None = None,
    seed: torch.Tensor | tuple[int, int] | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Return ``x`` rounded onto the grid of ``fmt``: same dtype, shape and device.

    Args:
        x: a float32, float16 or bfloat16 tensor of any shape, contiguous or not. Its values are
            processed in float32 and the result cast back to ``x.dtype``.
        fmt: a format object or its string (``"fp16"``, ``"e4m3fn"``, ``"q2.14"``, ``"mxfp4"``...).
        rounding: a :class:`Rounding` or its name (``"nearest"``, ``"stochastic"``, ``"sr8"``...).
        generator: source of the stochastic-rounding seed (default: torch's global generator).
        random_bits: random bits per element for ``stochastic_limited`` (default 8).
        seed: stochastic rounding's two keys as an integer tensor (:func:`seed_tensor`), in
            place of a draw from ``generator``; what compiled code passes to stay one graph.
            Eagerly, a tuple of two ints in [0, 2**32) also does.
        impl: ``"kernel"``, ``"torch"`` or ``"auto"`` (kernel for CPU float32 when built;
            inside ``torch.compile`` the fused decomposition); ``"fused"``: the int32 torch ops
            of :mod:`.fused`; ``"op"``: the opaque ``lowprec::quantize`` custom op.

    NaN stays NaN. Inf and values beyond ``fmt.max`` follow the format's overflow rule
    (IEEE 754 section 7.4 for the directed modes: rounding toward zero gives ±max). -0 is kept
    where the format has it. The result carries no autograd history: use
    :func:`lowprec.quantize_ste` or :class:`lowprec.Quantizer` to quantize inside a model.
    Inside ``torch.compile`` it is one node, the ``lowprec::quantize`` op (module docstring).
    """
    if impl == "auto" and random_bits is None and type(x) in _PLAIN and \
            x.dtype == torch.float32 and x.device.type == "cpu":
        # the commonest calls (the engine rounds each op's output with them), whose kernel
        # arguments a first call prepared (Python's cost per call otherwise: figure F9 of
        # benchmarks/RESULTS.md): a
        # deterministic mode to a float or fixed-point format, or stochastic rounding with its
        # keys given as two ints (the eager engine's) or a CPU tensor of them (the opaque op's), put
        # into a copy of the arguments
        keyed = _keys_given(seed, generator)
        plain = seed is None and (generator is None or isinstance(generator, torch.Generator))
        prm = _prepared(_PREPARED_KEYED if keyed else _PREPARED, fmt, rounding) \
            if keyed or plain else None
        if prm is not None and x.numel() and not emits_graph_ops():
            if keyed:  # (refused as the full path refuses them: a bad pair raises here)
                prm = _kernel.with_keys(prm, *_keys_of(seed))
            if x.is_contiguous():
                out = torch.empty_like(x)
                _kernel.quantize_prepared(x, out, prm)
                return out
            out = _in_layout(x, None, prm, keyed)
            if out is not None:
                return out
    return _quantize_general(x, fmt, rounding, generator, random_bits, seed, impl)


def _quantize_general(x, fmt, rounding, generator, random_bits, seed, impl) -> torch.Tensor:
    """:func:`quantize` past its fast path: graph ops, the argument checks, then the numerics."""
    if (emits_graph_ops() and impl == "auto") or impl in ("fused", "op"):
        spelled = _spelled(fmt, rounding, random_bits)
        if spelled is not None:
            return _as_op(x, spelled, generator, seed,
                          opaque={"op": True, "fused": False}.get(impl))
        if impl in ("fused", "op"):  # the checks below name what is wrong with the arguments
            impl = "auto"
    _check_input(x)
    check_generator(generator)
    if generator is not None and seed is not None:
        raise ValueError("give a generator or a seed, not both")
    key = (fmt, rounding)
    fmt = parse_format(fmt)
    mode, rbits = parse_rounding(rounding, random_bits)
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; accepted: {', '.join(_IMPLS)}")
    if x.numel() == 0:
        return torch.empty_like(x)
    with torch.no_grad():
        xf = x.detach()
        xf = xf if xf.dtype == torch.float32 else xf.float()
        if isinstance(fmt, BinaryFormat):
            out = _binary(xf)
        else:
            out = _round_values(xf, fmt, key, mode, rbits, random_bits, generator, seed, impl)
        # (not reshaped to its own shape: a view's strides drop those of x's size-1 dimensions,
        # and a convolution given a channels-last weight of one input channel so turned
        # row-major answered in row-major order, its next layer then converting)
        out = out if out.shape == x.shape else out.reshape(x.shape)
        if out.stride() != x.stride() and memory_order(x) is not None:
            # a dense input's layout kept, as torch's elementwise ops keep it (a channels-last
            # activation rounded stochastically or in blocks: the next convolution would
            # otherwise take mixed layouts)
            return torch.empty_like(x).copy_(out)
        if out.stride() != x.stride() and x.is_contiguous() and out.is_contiguous() and \
                out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            # the same memory order, other strides on size-1 axes (the torch path's row-major
            # result of a channels-last tensor of one channel): x's strides, as its cast keeps
            # them, over the same memory (no copy; not a view)
            out = torch.empty(0, dtype=out.dtype, device=out.device).set_(
                out.untyped_storage(), out.storage_offset(), x.shape, x.stride())
        return out if out.dtype == x.dtype else out.to(x.dtype)


def _round_values(xf: torch.Tensor, fmt, key, mode: Rounding, rbits, random_bits, generator,
                  seed, impl: Impl) -> torch.Tensor:
    """Round float32 ``xf`` (non-empty, checked arguments) onto a non-binary format's grid."""
    keyed = _keys_given(seed, generator)
    if not mode.is_stochastic:
        seed = (0, 0)
    else:
        seed = draw_seed(generator) if seed is None else _keys_of(seed)
    code, rmask = ROUNDING_CODES[mode], random_mask(rbits)
    if isinstance(fmt, (FloatFormat, FixedFormat)) and random_bits is None and \
            impl == "auto" and _kernel.available():
        if not mode.is_stochastic:
            _prepare(key, fmt, code, rmask)
        elif keyed:
            _prepare(key, fmt, code, rmask, _PREPARED_KEYED)
    if impl == "auto" and _on_accelerator(xf) and \
            not (code == R_NEAREST_EVEN and fmt in _NATIVE_CASTS) and \
            xf.numel() <= _fused.max_numel(fmt):
        # on a GPU: the fused decomposition's int32 ops over the whole tensor (a few
        # dozen kernel launches; the reference path's chunk loop launched thousands)
        keys = (torch.tensor(seed, dtype=torch.int64, device=xf.device)
                if mode.is_stochastic else None)
        return _fused_on_device(xf, fmt, mode, rbits or 0, keys)
    if isinstance(fmt, BlockFormat):
        return _blocks(xf, fmt, code, rmask, seed, impl)
    if isinstance(fmt, (FloatFormat, FixedFormat)):
        return _elementwise(xf, fmt, code, rmask, seed, impl, None)
    raise TypeError(f"cannot quantize to {fmt} directly: dynamic fixed point keeps "
                    "a range per group of tensors; use Precision, or "
                    "fmt.at_range(r) for a given range")


def _written(x: torch.Tensor) -> torch.Tensor:
    """``x`` after the kernel wrote it in place of a non-contiguous layout: its version counter
    moved, as the ``copy_`` back that path once took moved it (autograd then still refuses a
    saved tensor so overwritten)."""
    if not x.is_inference():
        torch.autograd.graph.increment_version(x)
    return x


def _prepared_in_place(x: torch.Tensor, fmt, rounding, table: dict = _PREPARED):
    """The kernel's parameters for rounding ``x`` in place as a first call prepared them (a
    deterministic rounding; ``table`` :data:`_PREPARED_KEYED`: a stochastic one given its
    keys, the keys not set), where ``x`` is a non-empty float32 CPU tensor and no graph is
    traced; None else: :func:`quantize_`'s fast paths and :func:`quantize_counting_`."""
    if type(x) not in _PLAIN or x.dtype != torch.float32 or x.device.type != "cpu" or \
            not x.numel():
        return None
    prm = _prepared(table, fmt, rounding)
    return None if prm is None or emits_graph_ops() else prm


def quantize_counting_(x: torch.Tensor, fmt, rounding="nearest") -> int | None:
    """``quantize_(x, fmt, rounding)`` for a deterministic rounding that an earlier call
    prepared, counting the Inf and NaN values it leaves in ``x``, in one pass (the kernel counts
    each chunk while it is in cache): the number, or None without rounding anything where that
    pass does not apply (not a contiguous float32 CPU tensor, no kernel, inside a trace, a
    rounding no call prepared); the caller then rounds and checks as before."""
    if not x.is_contiguous() or not _kernel.nonfinite_available():
        return None
    prm = _prepared_in_place(x, fmt, rounding)
    return None if prm is None else _kernel.quantize_prepared_nonfinite(x, x, prm)


def quantize_(
    x: torch.Tensor,
    fmt: str | Format,
    rounding: str | Rounding = "nearest",
    *,
    generator: torch.Generator | None = None,
    random_bits: int | None = None,
    seed: torch.Tensor | tuple[int, int] | None = None,
) -> torch.Tensor:
    """In-place :func:`quantize`; returns ``x``. Float32 contiguous CPU tensors need no copy.
    Inside ``torch.compile``: the op's result copied into ``x``."""
    if random_bits is None and seed is None and \
            (generator is None or isinstance(generator, torch.Generator)):
        # a deterministic rounding a first call prepared (:func:`quantize`'s fast path, in
        # place: a parameter's gradient rounded at every step, a kernel's fresh output; a
        # generator, which it does not draw from, as quantize takes it); a dense tensor of
        # another layout (channels-last) over its memory as it lies
        prm = _prepared_in_place(x, fmt, rounding)
        if prm is not None:
            if x.is_contiguous():
                _kernel.quantize_prepared(x, x, prm)
                return x
            if _in_layout(x, x, prm, False) is not None:
                return _written(x)
    elif random_bits is None and _keys_given(seed, generator):
        # stochastic rounding given its keys (the eager engine's in-place roundings: an op's
        # fresh output, what an in-place op wrote), as quantize's keyed fast path: the
        # arguments a first call prepared, the keys put into a copy (the full path's checks
        # and parsing cost more than the kernel on a small tensor: q6.10 of 1,024 values 26.8
        # us a call without this path, 10.2 with it, one thread of an AMD EPYC with AVX2,
        # benchmarks/RESULTS.md, "Issue 37, nineteenth session")
        prm = _prepared_in_place(x, fmt, rounding, _PREPARED_KEYED)
        if prm is not None:
            prm = _kernel.with_keys(prm, *_keys_of(seed))  # (a bad pair raises, as below)
            if x.is_contiguous():
                _kernel.quantize_prepared(x, x, prm)
                return x
            if _in_layout(x, x, prm, True) is not None:
                return _written(x)
    key = (fmt, rounding)
    if emits_graph_ops():
        spelled = _spelled(fmt, rounding, random_bits)
        if spelled is not None:
            with torch.no_grad():
                x.copy_(_as_op(x, spelled, generator, seed))
            return x
    _check_input(x)
    check_generator(generator)
    if generator is not None and seed is not None:
        raise ValueError("give a generator or a seed, not both")
    fmt = parse_format(fmt)
    mode, rbits = parse_rounding(rounding, random_bits)
    with torch.no_grad():
        if (
            isinstance(fmt, (FloatFormat, FixedFormat))
            and x.dtype == torch.float32
            and x.numel() > 0
            and _use_kernel(x, "auto")
            and (x.is_contiguous() or memory_order(x) is not None)
        ):
            keys = ((draw_seed(generator) if seed is None else _keys_of(seed))
                    if mode.is_stochastic else (0, 0))
            code, rmask = ROUNDING_CODES[mode], random_mask(rbits)
            if random_bits is None and _kernel.available():
                if not mode.is_stochastic:
                    _prepare(key, fmt, code, rmask)
                elif _keys_given(seed, generator):
                    _prepare(key, fmt, code, rmask, _PREPARED_KEYED)
            if x.is_contiguous():
                _elementwise(x, fmt, code, rmask, keys, "kernel", x)
                return x
            # a dense layout (channels-last): in place of its memory where the kernel can
            # take it as it lies (the kernel's tiles read each value before writing it)
            prm = _kernel.with_keys(_kernel.prepare(element_params(fmt), code, rmask), *keys)
            if _in_layout(x, x, prm, code == _STOCHASTIC_CODE) is not None:
                return _written(x)
            if mode.is_stochastic:  # (the keys drawn: the copy below rounds with them)
                generator, seed = None, keys
        x.copy_(quantize(x, fmt, mode, generator=generator, random_bits=rbits or None,
                         seed=seed))
    return x



# -- inside torch.compile: one lowprec::quantize node ---------------------------------------------
_SPELLED: dict = {}


@torch.compiler.assume_constant_result  # evaluated while tracing; a constant of the graph
def _spelled(fmt, rounding, random_bits) -> tuple[str, str, int, bool, int, str] | None:
    """(format, rounding mode, random bits, stochastic?, fused limit, source digest) as the
    ops' constant arguments: the format's canonical string, which parses back to it, the random
    bits of limited stochastic rounding (0 for the other modes, which imply theirs: an eager
    quantize given stochastic rounding's 32 left its prepared fast path), the most
    elements the fused decomposition takes (0: it does not cover the format) and the digest of
    its code (lowprec.numerics.fused.source_token); None where there is no
    string (dynamic fixed point, a bad argument): the eager code is traced then, and says what
    is wrong."""
    key = (fmt, rounding, random_bits)
    try:
        if key in _SPELLED:
            return _SPELLED[key]
    except TypeError:  # an unhashable argument
        return None
    try:
        f = parse_format(fmt)
        mode, bits = parse_rounding(rounding, random_bits)
        spell = str(f)
        ok = (isinstance(f, (FloatFormat, FixedFormat, BlockFormat, BinaryFormat))
              and parse_format(spell) == f)
        bits = bits if mode is Rounding.STOCHASTIC_LIMITED else 0
        hit = ((spell, mode.value, int(bits or 0), mode.is_stochastic, _fused.max_numel(f),
                _fused.source_token()) if ok else None)
    except (TypeError, ValueError):
        hit = None
    _SPELLED[key] = hit
    return hit


@torch.compiler.disable  # a torch.Generator cannot enter a graph: drawn between graphs
def _seed_between_graphs(generator) -> torch.Tensor:
    return seed_tensor(generator)


def _as_op(x: torch.Tensor, spelled: tuple, generator, seed, opaque: bool | None = None
           ) -> torch.Tensor:
    """The rounding as a graph op: opaque (``lowprec::quantize``) or the fused decomposition;
    ``opaque=None`` chooses: the opaque op for stochastic rounding of a CPU tensor inside
    ``tracing_graph(stochastic_kernel=True)`` (where the kernel is built), else the fused one
    (for the formats and sizes it covers)."""
    fmt, mode, bits, stochastic, limit, source = spelled
    if opaque is None:
        opaque = stochastic and getattr(_TRACING, "sr_kernel", False) and \
            x.device.type == "cpu" and _kernel.available()
    _check_input(x)
    check_generator(generator)
    if generator is not None and seed is not None:
        raise ValueError("give a generator or a seed, not both")
    if not stochastic:
        seed = None
    elif seed is None:
        seed = _seed_between_graphs(generator)
    elif isinstance(seed, tuple):  # two ints: constants of the graph
        seed = torch.tensor(_keys_of(seed), dtype=torch.int64, device=x.device)
    # neither op has an autograd formula: like the eager function, the result carries no
    # history. The fused one expands into int32 torch ops that Inductor fuses (lowprec.numerics
    # .fused); the opaque one runs this module's eager code.
    if not opaque and x.numel() <= limit:
        return torch.ops.lowprec.quantize_fused.default(x.detach(), fmt, mode, bits, seed,
                                                        source)
    return torch.ops.lowprec.quantize.default(x.detach(), fmt, mode, bits, seed)
