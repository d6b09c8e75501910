"""The memory ledger: exact bytes of one training step, by role.

Parameters and gradients are counted at the parameter format's width; optimizer state and master
weights from the layout the optimizer describes (``state_layout(p)``: a format per state tensor,
one value per element of ``p``; the optimizers count no bytes themselves), a plain torch
optimizer from its state tensors; activations are the tensors autograd saves for backward
during one forward pass and loss, caught with ``torch.autograd.graph.saved_tensors_hooks`` and
counted once per storage (a tensor saved by two layers is stored once), parameters excluded.

Under emulation values are carried in fp32, but a tensor whose values all lie on the compute
format's grid would be stored in that format: it is counted at that width (a block format's grid
along any of the tensor's axes: an emulated MX convolution saves its input quantized along the
channels). That is what the regime costs on hardware that has the format.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace

import torch

from ..numerics.formats import FP32, BlockFormat, Format
from ..numerics.storage import format_bytes
from ..numerics.quantize import quantize
from .optim import FormatOptimizer, LowPrecisionOptimizer

__all__ = ["MemoryLedger", "measure_memory", "optimizer_bytes", "saved_activation_bytes"]


@dataclass(frozen=True)
class MemoryLedger:
    params: int
    grads: int
    optimizer_state: int
    master: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.master + self.activations

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d

    def ratio_to(self, other: "MemoryLedger") -> float:
        return self.total / other.total if other.total else float("nan")


def _on_grid(t: torch.Tensor, fmt: Format) -> bool:
    """Whether every value of ``t`` is representable in ``fmt`` (for dynamic fixed point: at
    the range its largest value needs, or one or two above)."""
    if fmt.dynamic:
        amax = float(t.abs().max()) if t.numel() else 0.0
        if not amax or amax != amax or amax == float("inf"):
            return amax == 0.0
        r0 = math.floor(math.log2(amax)) + 1
        return any(_on_grid(t, fmt.at_range(r)) for r in (r0, r0 + 1, r0 + 2)
                   if fmt.bits - 150 <= r <= fmt.bits - 1)
    return torch.equal(torch.nan_to_num(quantize(t, fmt)), torch.nan_to_num(t))


def _grid_bytes(t: torch.Tensor, fmt: Format) -> int | None:
    """The bytes ``t`` takes stored in ``fmt`` where every value of it lies on ``fmt``'s grid,
    else None. A block format of fixed-size blocks (MX): on its grid in blocks along one of
    ``t``'s axes, as an op quantized it (an emulated convolution's input along its channels),
    with a scale per block of that axis's rows (an axis shorter than a block: one per row); of
    the axes it lies on the grid along, the one with the fewest blocks (values quantized along
    one axis often lie on the grid along another: each element keeps its own exponent)."""
    if not (isinstance(fmt, BlockFormat) and fmt.block_size is not None and t.dim()):
        return format_bytes(fmt, t.numel()) if _on_grid(t, fmt) else None

    def scales(a: int) -> int:  # blocks along axis a: a scale byte each
        return t.numel() // t.shape[a] * math.ceil(t.shape[a] / fmt.block_size)

    axes = [fmt.axis % t.dim()] if fmt.axis != -1 else \
        [a for a in range(t.dim()) if t.shape[a] > 1] or [t.dim() - 1]
    for a in sorted(axes, key=scales):  # the cheapest layout that holds the values
        if _on_grid(t, replace(fmt, axis=a)):
            return math.ceil(t.numel() * fmt.element.bits / 8) + scales(a)
    return None


def saved_activation_bytes(run, *, exclude: list[torch.Tensor], compute: Format | None = None
                           ) -> int:
    """Bytes of the tensors autograd saves while ``run()`` executes.

    ``exclude``: tensors (parameters) whose storage is not counted. ``compute``: with emulation,
    float32 tensors lying on this format's grid are counted at its width.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    # per storage: the byte span its saved views cover, whether all of them lie on the compute
    # grid, and the bytes and size of the largest in that format (a slice of a large tensor
    # counts only the slice)
    spans: dict[int, list] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in skip or t.numel() == 0:
            return t
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * size
        grid = None
        if compute is not None and compute != FP32 and t.dtype == torch.float32:
            with torch.no_grad():
                grid = _grid_bytes(t, compute)
        if key in spans:
            s_ = spans[key]
            s_[0], s_[1], s_[2] = min(s_[0], lo), max(s_[1], hi), s_[2] and grid is not None
            if grid is not None and t.numel() > s_[4]:
                s_[3], s_[4] = grid, t.numel()
        else:
            spans[key] = [lo, hi, grid is not None, grid, t.numel()]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    total = 0
    for lo, hi, on_grid, grid, numel in spans.values():
        nbytes = hi - lo
        if not on_grid:
            total += nbytes
        else:  # the largest saved view's bytes where it covers the span, else by size
            total += grid if numel == nbytes // 4 else format_bytes(compute, nbytes // 4)
    return total


def measure_memory(model: torch.nn.Module, batch, loss_fn, *, param_format: Format,
                   optimizer=None, compute: Format | None = None,
                   autocast=contextlib.nullcontext,
                   param_formats: dict | None = None) -> MemoryLedger:
    """The ledger of one training step of ``model`` on ``batch`` (inputs, targets).
    ``param_formats`` (id(parameter) -> format): parameters stored in a format of their own
    (per-module overrides, a plan); the others, and their gradients, in ``param_format``."""
    params = [p for p in model.parameters()]
    own = param_formats or {}
    pbytes = sum(format_bytes(own.get(id(p), param_format), p.numel()) for p in params)
    gbytes = sum(format_bytes(own.get(id(p), param_format), p.numel()) for p in params
                 if p.requires_grad)
    state, master = (0, 0) if optimizer is None else optimizer_bytes(optimizer)
    inputs, targets = batch
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    try:
        def run():
            with autocast():
                return loss_fn(model(inputs), targets)

        act = saved_activation_bytes(run, exclude=params, compute=compute)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])  # the forward pass must not move BatchNorm statistics
    return MemoryLedger(pbytes, gbytes, state, master, act)


def optimizer_bytes(optimizer) -> tuple[int, int]:
    """(optimizer-state bytes, master-weight bytes) of ``optimizer``.

    lowprec's optimizers describe their state with ``state_layout(p)``; each entry costs
    ``format_bytes(fmt, p.numel())``. The scalar bookkeeping of a torch optimizer wrapped in a
    :class:`~lowprec.training.optim.FormatOptimizer` (0-dim step counts) is counted at its
    dtype's width. A plain torch optimizer is counted from its state tensors.
    """
    if isinstance(optimizer, FormatOptimizer):
        params = optimizer.model_params
    elif isinstance(optimizer, LowPrecisionOptimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
    else:
        return _torch_optimizer_state_bytes(optimizer), 0
    state = master = 0
    for p in params:
        for name, fmt in optimizer.state_layout(p).items():
            nbytes = format_bytes(fmt, p.numel())
            if name == "master":
                master += nbytes
            else:
                state += nbytes
    if isinstance(optimizer, FormatOptimizer):
        state += sum(v.numel() * v.element_size() for s in optimizer.optimizer.state.values()
                     for v in s.values() if torch.is_tensor(v)
                     and not (v.is_floating_point() and v.dim() > 0))
    return state, master


def _torch_optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """State of a torch optimizer: counted if it exists, else from its known layout."""
    if any(opt.state.values()):
        total = 0
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total
    per_param = 0
    if isinstance(opt, torch.optim.SGD):
        per_param = 1 if opt.defaults.get("momentum", 0) else 0
    elif isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        per_param = 3 if opt.defaults.get("amsgrad") else 2
    total = 0
    for g in opt.param_groups:
        for p in g["params"]:
            total += per_param * p.numel() * p.element_size()
            if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                total += 4  # the 0-dim float32 step counter
    return total
