"""The engine's autograd functions: a rounding forward, and the gradient rounding in backward.

:class:`Round` rounds an op's output and, in backward, the gradient reaching it;
:class:`RoundInplace` does so in place, for what an in-place op wrote and for an op's fresh
output its backward does not hold (:func:`owned`); :class:`Consumed` rounds the gradient one
consumer of an activation sends back and :class:`GradSum` adds it to the other
consumers' as native 16-bit autograd adds them; :class:`Upcast` is a 16-bit value cast up to an
fp32 island; :class:`Broadcast` an operand an elementwise op broadcasts. Stochastic rounding's
keys come from a :class:`Site` of the forward's :class:`Stream` (or a generator).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ...numerics.keys import derive_keys
from ...numerics import kernel as _kernel
from ...numerics.quantize import emits_graph_ops, prepared_params, quantize, quantize_
from .gradmarks import note_rounded, rounded_already

__all__ = ["ROUNDABLE", "fresh", "Site", "Stream", "round_grad", "quantize_keyed",
           "quantize_keyed_", "Round", "GradSum", "SUM", "consumer_sum", "Upcast", "Consumed",
           "Broadcast", "RoundInplace", "OWNED_NODES", "owned", "owned_base", "fast_apply", "once"]

ROUNDABLE = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes the engine rounds


def fresh(y: torch.Tensor) -> torch.Tensor:
    # quantize returns ``out.reshape(x.shape)``, a same-shape view of its own buffer; autograd
    # forbids modifying a custom Function's view output in place (``relu_`` after it), so hand
    # back the buffer itself
    b = y._base
    if b is not None and b.shape == y.shape and b.stride() == y.stride() and \
            b.storage_offset() == y.storage_offset():
        return b
    return y if b is None else y.clone()


class Site:
    """Stochastic rounding's keys for the roundings of one site of one forward (an op's output
    rounded, its gradient rounded in backward): the ``j``-th rounding gets the keys of counter
    ``j * 2**31 + n`` under the forward's base keys. The site's number ``n`` is fixed when the
    forward meets it, so whether the forward runs eagerly (the base a pair of ints) or is traced
    into a graph (the base a graph input), every rounding gets the same keys, given the same
    roundings in the same order (a 16-bit sum of a tensor's gradients (:class:`GradSum`)
    rounds with the site of the arrival that completes each add: autograd's order, the same
    in both)."""

    __slots__ = ("base", "n", "j")

    def __init__(self, base, n: int) -> None:
        self.base, self.n, self.j = base, n, 0

    def next(self):
        self.j += 1
        return derive_keys(self.base, (self.j - 1) * 2**31 + self.n)


class Stream:
    """The sites of one forward (:class:`Site`), numbered in the order the engine meets them."""

    __slots__ = ("base", "n")

    def __init__(self, base) -> None:
        self.base, self.n = base, 0

    def site(self) -> Site:
        self.n += 1
        return Site(self.base, self.n - 1)

    def peek(self):
        """The keys the first rounding of the next site will take (the site not made)."""
        return Site(self.base, self.n).next()


def _keyword(mode, keys) -> dict:
    """quantize's keyword for stochastic rounding's keys from ``keys``: a :class:`Site`'s
    next keys, or a generator (None: torch's default) drawn from at each call."""
    if type(keys) is Site:
        return {"seed": keys.next() if mode.is_stochastic else None}
    return {"generator": keys}


def _skips(g, fmt, mode, keys) -> bool:
    """Whether rounding the gradient ``g`` to ``fmt`` can be skipped: it is on that grid
    already, unchanged (:mod:`.gradmarks`), and no generator would be drawn from; a site's
    stochastic keys advance as if it had rounded, so later roundings keep theirs."""
    if not rounded_already(g, fmt) or (mode.is_stochastic and type(keys) is not Site):
        return False
    if mode.is_stochastic:
        keys.next()
    return True


def round_grad(g, bwd, bmode, keys):
    """The gradient ``g`` rounded to ``bwd`` (a format, or a function of the tensor giving one:
    dynamic formats) and noted (:mod:`.gradmarks`); ``g`` itself where it is on that grid
    already (:func:`_skips`)."""
    if _skips(g, bwd, bmode, keys):
        return g
    out = fresh(quantize_keyed(g, bwd(g) if callable(bwd) else bwd, bmode, keys))
    note_rounded(out, bwd)
    return out


def quantize_keyed(x, fmt, mode, keys):
    """``quantize(x, fmt, mode)`` with stochastic rounding's keys from ``keys`` (a
    :class:`Site`, or a generator); every rounding of the engine goes through it."""
    return quantize(x, fmt, mode, **_keyword(mode, keys))


def quantize_keyed_(x, fmt, mode, keys):
    """In place, as :func:`quantize_keyed`."""
    return quantize_(x, fmt, mode, **_keyword(mode, keys))


def once(fn):
    """torch's ``once_differentiable`` for a backward, which returns ``fn``'s result as it is
    where grad mode is off (a backward run without ``create_graph``, the usual case), after a
    ``no_grad`` block and checks (1.7 us a call against 0.25 for this one, on an Intel Xeon):
    here ``fn`` is called directly then; with grad mode on, ``once_differentiable`` runs (a
    second order raises)."""
    wrapped = once_differentiable(fn)

    @functools.wraps(fn)
    def backward(ctx, *args):
        if torch.is_grad_enabled():
            return wrapped(ctx, *args)
        return fn(ctx, *args)

    return backward


class Round(torch.autograd.Function):
    """Values to ``fwd``; the gradient reaching the output to ``bwd`` (None: unchanged)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, mode, bmode, gen):
        ctx.spec = (bwd, bmode, gen)
        return fresh(quantize_keyed(x, fwd, mode, gen))

    @staticmethod
    @once  # (its roundings have no derivative: a second order raises)
    def backward(ctx, g):
        bwd, bmode, gen = ctx.spec
        if bwd is not None and g is not None and g.dtype in ROUNDABLE:
            # (not again: the one consumer's gradient its Consumed node rounded)
            g = round_grad(g, bwd, bmode, gen)
        return g, None, None, None, None, None


# autograd nodes whose backward saves its inputs but not its output: the output they made, no
# view, can be rounded in place (``RoundInplace``)
OWNED_NODES = frozenset({
    "ConvolutionBackward0", "AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0",
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1",
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "AddcmulBackward0",
    "NegBackward0", "SumBackward1", "MeanBackward1", "GeluBackward0", "SiluBackward0",
    "_BatchNormBackward", "_LayerNormBackward"})


def owned(t: torch.Tensor) -> bool:
    """Whether ``t`` is an op's fresh output the op's backward does not hold
    (:class:`RoundInplace` may round it in place: no second buffer): a float32 CPU tensor of
    its own memory (no view) made by a node of :data:`OWNED_NODES`; not while a graph is
    traced (compiled emulation rounds out of place, as before)."""
    fn = t.grad_fn
    return fn is not None and t._base is None and t.dtype == torch.float32 and \
        t.device.type == "cpu" and fn.name() in OWNED_NODES and not emits_graph_ops()


def owned_base(t: torch.Tensor) -> torch.Tensor | None:
    """What :class:`RoundInplace` may round for ``t``: ``t`` itself where :func:`owned`; the
    op output ``t`` views where ``t`` is all of it, in its order, and that output is owned
    (``F.linear`` on a 3-d input views its ``addmm`` output with the input's leading shape: the
    caller views the rounded output again, and ``t`` is dropped); else None. One buffer and one
    pass instead of a copy: the transformer's 16-mixed step 2.6% faster, 16-true 3.6%, on an
    Intel Xeon (benchmarks/RESULTS.md, "Issue 37, twelfth session")."""
    if owned(t):
        return t
    b = t._base
    if b is None or not owned(b) or t.grad_fn is None or t.grad_fn.name() != "ViewBackward0" \
            or not t.is_contiguous() or not b.is_contiguous() or \
            t.storage_offset() != b.storage_offset() or t.numel() != b.numel():
        return None
    return b


class GradSum:
    """The 16-bit sum native autograd forms of the gradients an activation's consumers send
    back: each arrival added to the running sum and rounded (``InputBuffer::add`` in the
    tensor's dtype), in the order the backward runs the consumers. Shared by the
    :class:`Consumed` / :class:`Upcast` nodes of one tensor; ``n`` counts them."""

    __slots__ = ("n", "seen", "task", "value")

    def __init__(self) -> None:
        self.n, self.seen, self.task, self.value = 0, 0, None, None

    def add(self, g: torch.Tensor, fmt, mode, gen) -> torch.Tensor:
        """``g`` (rounded) arrives; returns what to hand autograd instead: the change in the
        rounded running sum, so that autograd's fp32 sum of the consumers' returns is the
        rounded sum (telescoping; each difference of two 16-bit values is exact in fp32 but
        for exponents more than 13 binades apart)."""
        if self.n <= 1:
            return g
        task = torch._C._current_graph_task_id()
        if self.value is None or task != self.task or self.value.shape != g.shape:
            self.task, self.value, self.seen = task, g, 1
            return g
        new = quantize_keyed(self.value + g, fmt(g) if callable(fmt) else fmt, mode, gen)
        out = new - self.value
        self.seen += 1
        self.value = None if self.seen >= self.n else new  # every consumer in: let it go
        return out

    def add_raw(self, g: torch.Tensor, fmt, mode):
        """:func:`round_grad` then :meth:`add` of a later arrival in one kernel pass (the same
        float32 operations and roundings: ``lp_round_sum_delta``), for a deterministic mode of a
        static format on CPU tensors laid out alike; None where it does not apply (the caller
        then rounds and adds with torch ops)."""
        if self.n <= 1 or self.value is None or callable(fmt) or mode.is_stochastic or \
                self.value.shape != g.shape or \
                torch._C._current_graph_task_id() != self.task:
            return None
        prm = prepared_params(fmt, mode)
        if prm is None:
            return None
        done = _kernel.round_sum_delta(g, self.value, prm, keep=self.seen + 1 < self.n)
        if done is None:
            return None
        out, new = done
        self.seen += 1
        self.value = new  # None once every consumer is in
        return out


SUM = "_lowprec_sum"  # attribute of an activation: its consumers' GradSum


def new_version(t: torch.Tensor) -> None:
    """``t`` was written in place: its later consumers read a new version, whose gradients
    native autograd sums at the in-place op's node, apart from the old version's (which the
    old consumers' :class:`GradSum` keeps summing)."""
    for u in (t, t._base):  # (a view written in place writes its base too)
        if u is not None and getattr(u, SUM, None) is not None:
            try:
                delattr(u, SUM)
            except (AttributeError, RuntimeError):
                pass


def consumer_sum(t: torch.Tensor) -> GradSum:
    acc = getattr(t, SUM, None)
    if acc is None:
        acc = GradSum()
        try:
            setattr(t, SUM, acc)
        except (AttributeError, RuntimeError):
            pass
    acc.n += 1
    return acc


def _arrival(g, bwd, bmode, gen, acc):
    """One consumer's gradient ``g`` rounded to ``bwd`` (not again where a replayed kernel
    rounded it) and added to the tensor's other consumers' (``acc``: :class:`GradSum`, or
    None): what autograd gets from a :class:`Consumed` or :class:`Upcast` node."""
    if acc is not None:
        out = acc.add_raw(g, bwd, bmode)
        if out is not None:
            return out
    g = round_grad(g, bwd, bmode, gen)
    return g if acc is None else acc.add(g, bwd, bmode, gen)


class Upcast(torch.autograd.Function):
    """A 16-bit value cast up (``h.to(torch.float32)``): a copy, exact; the gradient reaching
    it is cast back to the 16-bit format, as the cast's backward does natively, and added to
    the tensor's other consumers' (``acc``: :class:`GradSum`, or None)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, mode, bmode, gen, acc=None):
        ctx.spec = (bwd, bmode, gen, acc)
        return x.clone()

    @staticmethod
    @once  # (its roundings have no derivative: a second order raises)
    def backward(ctx, g):
        bwd, bmode, gen, acc = ctx.spec
        if bwd is not None and g is not None and g.dtype in ROUNDABLE:
            g = _arrival(g, bwd, bmode, gen, acc)
        return g, None, None, None, None, None, None


class Consumed(torch.autograd.Function):
    """An activation an op reads: unchanged forward; the gradient this one op sends back to it
    is rounded, then added to the other consumers' as a native 16-bit run adds them (one
    16-bit sum per arrival, in the tensor's dtype: :class:`GradSum`)."""

    @staticmethod
    def forward(ctx, x, bwd, bmode, gen, acc=None):
        ctx.spec = (bwd, bmode, gen, acc)
        return x.view_as(x)

    @staticmethod
    @once  # (its roundings have no derivative: a second order raises)
    def backward(ctx, g):
        bwd, bmode, gen, acc = ctx.spec
        if g is not None and g.dtype in ROUNDABLE:
            g = _arrival(g, bwd, bmode, gen, acc)
        return g, None, None, None, None


class Broadcast(torch.autograd.Function):
    """An operand broadcast by an elementwise op (``weight * h``): expanded here, so that its
    gradient arrives at the output's size and is rounded there before being summed down, as a
    native 16-bit backward computes it (the full-size product in 16 bits, then the sum)."""

    @staticmethod
    def forward(ctx, x, shape, bwd, bmode, gen):
        ctx.spec = (bwd, bmode, gen, x.shape)
        return x.expand(shape)

    @staticmethod
    @once  # (its roundings have no derivative: a second order raises)
    def backward(ctx, g):
        bwd, bmode, gen, shape = ctx.spec
        if g is not None and g.dtype in ROUNDABLE:
            g = quantize_keyed(g, bwd(g) if callable(bwd) else bwd, bmode, gen)
            g = g.sum_to_size(shape)
        return g, None, None, None, None


class RoundInplace(torch.autograd.Function):
    """In-place form for what an in-place op wrote (``x += y``)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, mode, bmode, gen):
        ctx.spec = (bwd, bmode, gen)
        if not _skips(x, fwd, mode, gen):  # (not where a kernel rounded x as it wrote it)
            quantize_keyed_(x, fwd, mode, gen)
        ctx.mark_dirty(x)
        return x

    backward = Round.backward


def fast_apply(cls):
    """``cls.apply`` for the engine's functions, whose first argument is their one tensor:
    where no functorch transform is active, torch's ``Function.apply`` unwraps dead functorch
    wrappers from every argument and calls the C ``apply``; this does the same for the tensor
    and calls it directly (``Consumed`` on a (32, 64) tensor: 3.6 us a call against 5.8, three
    calls for an ``add`` of two activations, on an Intel Xeon: benchmarks/RESULTS.md, "Issue
    37, thirteenth session").
    Under a transform, ``cls.apply`` itself."""
    c_apply = super(torch.autograd.Function, cls).apply
    unwrap = torch._C._functorch.unwrap_if_dead
    active = torch._C._are_functorch_transforms_active
    slow = cls.apply

    def apply(x, *rest):
        if active():
            return slow(x, *rest)
        return c_apply(unwrap(x), *rest)

    return apply


round_apply = fast_apply(Round)
round_inplace_apply = fast_apply(RoundInplace)
consumed_apply = fast_apply(Consumed)
upcast_apply = fast_apply(Upcast)
broadcast_apply = fast_apply(Broadcast)
