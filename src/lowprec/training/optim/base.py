"""``LowPrecisionOptimizer``: the base of lowprec's optimizers (fp32 maths, storage formats)."""

from __future__ import annotations

import torch

from ...numerics import kernel as _kernel
from ...numerics.formats import BF16, FP32, FixedFormat, FloatFormat, Format
from ...numerics.params import ROUNDING_CODES, element_params
from ...numerics.quantize import draw_seed, memory_order
from ...numerics.rounding import Rounding
from ...numerics.storage import compact, storage_dtype
from .protocol import PolicyOptimizer
from .writeback import Storage, kahan_write, write

__all__ = ["LowPrecisionOptimizer", "sqrt_rn", "run_fused"]


def sqrt_rn(x32: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of a float32 tensor.

    Taken in float64 and rounded to float32: the float64 root is correctly rounded (IEEE 754),
    and rounding it again to float32 gives the correctly rounded float32 root, because double
    rounding is innocuous for sqrt when the wider format has at least 2p + 2 bits (53 >= 50;
    Figueroa, "When is double rounding innocuous?", SIGNUM 1995). torch's own float32 ``sqrt``
    on CPU may be off by one unit (see :class:`~.adam.Adam`); the fused kernel's ``sqrtf`` is
    exact, and this is its torch twin.
    """
    return x32.double().sqrt_().float()


def run_fused(st: Storage, p, s1, s2, opt, grad_scale, sformat: Format | None = None) -> None:
    """One parameter's step by the fused kernel (``opt``: the update's :class:`LPOpt`), with
    ``st``'s formats and write-back mode; ``sformat``: the state's format if not ``st``'s. The
    state is read and written in its tensors' dtype (``s1``; without state, the format's)."""
    sf = st.sformat(p) if sformat is None else sformat
    opt.p_dtype = _kernel.opt_dtype_code(p.dtype)
    opt.g_dtype = _kernel.opt_dtype_code(p.grad.dtype)
    opt.s_dtype = _kernel.opt_dtype_code(s1.dtype if s1 is not None else storage_dtype(sf))
    opt.grad_scale = 1.0 if grad_scale is None else float(grad_scale)
    opt.p_is_bf16 = int(st.pformat(p) == BF16)
    opt.s_is_bf16 = int(sf == BF16)
    mode = Rounding.STOCHASTIC if st.update == "stochastic" else Rounding.NEAREST_EVEN
    # a seed drawn where the torch path's write-back draws one: not for an fp32 parameter
    # (round_to returns it) nor an empty one (quantize returns first), so that the parameters
    # after it get the same draws
    draws = st.update == "stochastic" and st.pformat(p) != FP32 and p.numel() > 0
    seed = draw_seed(st.generator) if draws else (0, 0)
    _kernel.opt_step(p, p.grad, s1, s2, opt, element_params(st.pformat(p)),
                     ROUNDING_CODES[mode], seed, element_params(sf))
    # written through their memory: their version counters move, as an in-place op's do (a
    # graph that saved them before the step is refused, as after torch's step)
    torch.autograd.graph.increment_version([t for t in (p, s1, s2) if t is not None])


class LowPrecisionOptimizer(torch.optim.Optimizer, PolicyOptimizer):
    """Base of lowprec's optimizers: subclasses give the fp32 maths in ``_new_weight``."""

    honours_lr_scale = True  # group_lr: BinaryNet's per-layer scales

    def __init__(self, params, defaults, *, param_format=None, state_format=None,
                 master_format=None, update="nearest", generator=None) -> None:
        super().__init__(params, defaults)
        self.storage = Storage(param_format, state_format, master_format, update, generator)

    def configure(self, **kwargs) -> None:
        if any(self.state.values()):
            raise RuntimeError("configure() must be called before the first step")
        self.storage.configure(**kwargs)

    def configure_storage(self, **kwargs) -> None:
        self.configure(**kwargs)

    def state_dict(self) -> dict:
        """torch's state_dict, each state tensor in its format's own dtype where torch has one
        narrower than the carrier (:func:`lowprec.numerics.storage.compact`: fp8 state held in
        float32 is saved as float8); 16-bit state is held in its dtype already."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for i, s in sd["state"].items():
            layout = self.state_layout(params[i])
            state[i] = {k: compact(v, layout[k]) if k in layout and torch.is_tensor(v) else v
                        for k, v in s.items()}
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts floating state to the parameter's dtype when loading; lowprec gives each
        tensor the dtype this optimizer holds it in (its format's storage dtype: fp32 master
        weights of fp16 parameters stay fp32, fp8 state saved as float8 returns to its float32
        carrier), exactly."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            layout = self.state_layout(p)
            for key, val in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(val):
                    dtype = storage_dtype(layout[key]) if key in layout else val.dtype
                    self.state[p][key] = val.to(device=p.device, dtype=dtype, copy=True)

    # -- state in a format -----------------------------------------------------------------
    def _state_tensor(self, p, like32: torch.Tensor, fmt: Format) -> torch.Tensor:
        return torch.zeros_like(like32, dtype=storage_dtype(fmt))

    def _save(self, dst: torch.Tensor, value32: torch.Tensor, fmt: Format, p=None,
              role: str = "state") -> None:
        if p is not None:
            fmt = self.storage.now(fmt, p, role, value32)
        write(dst, value32, fmt, "nearest", None)

    def _init_common(self, p, state) -> None:
        st = self.storage
        if st.master_format is not None:
            state["master"] = p.detach().to(storage_dtype(st.master_format)).clone()
        elif st.update == "kahan":
            state["compensation"] = torch.zeros_like(p, dtype=storage_dtype(st.pformat(p)))

    def state_layout(self, p) -> dict[str, Format]:
        """Format of every state tensor this optimizer keeps for ``p``, each with one value per
        element of ``p`` (``"master"``: the master weights). The memory ledger
        (:func:`lowprec.training.memory.optimizer_bytes`) counts their bytes from it."""
        st = self.storage
        layout = dict(self._moment_layout(p))
        if st.master_format is not None:
            layout["master"] = st.master_format
        elif st.update == "kahan":
            layout["compensation"] = st.pformat(p)
        return layout

    def _moment_layout(self, p) -> dict[str, Format]:  # pragma: no cover - overridden
        return {}

    def _all_fp32(self, p) -> bool:
        """Every format fp32: the torch path is then torch.optim's op sequence exactly."""
        st = self.storage
        return (st.pformat(p) == FP32 and st.sformat(p) == FP32
                and st.master_format in (None, FP32))

    def params_for_check(self) -> list[torch.Tensor]:
        """The parameters whose gradients Precision checks and rounds."""
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | torch.Tensor | None = None):
        """One update. ``grad_scale`` multiplies the gradients in fp32 (Precision passes
        1 / loss_scale here, so fp16 gradients are never unscaled in fp16)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self.storage
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_common(p, state)
                    self._init_state(p, state)
                pf = st.pformat(p)
                if self._can_fuse(p, state) and self._fused(p, state, group, grad_scale):
                    continue
                g32 = p.grad.float()
                if grad_scale is not None:
                    g32 = g32 * grad_scale
                w32 = state["master"].float() if "master" in state else p.float()
                w_new = self._new_weight(p, w32, g32, state, group)
                if "master" in state:
                    self._save(state["master"], w_new, st.master_format, p, "master")
                    m32 = state["master"].float()
                    write(p, m32, st.now(pf, p, "param", m32), st.update, st.generator)
                elif st.update == "kahan":
                    kahan_write(st, p, w32, w_new, state["compensation"])
                else:
                    write(p, w_new, st.now(pf, p, "param", w_new), st.update, st.generator)
        return loss


    # -- the fused CPU kernel ---------------------------------------------------------------
    def _can_fuse(self, p, state) -> bool:
        st = self.storage
        if torch.compiler.is_compiling() or "master" in state or st.update == "kahan" or \
                not _kernel.available() or not self._alike(p, state, st.update == "stochastic"):
            # (a ctypes call cannot enter a graph: compiled steps take the torch path (the
            # same bits), whose roundings are lowprec::quantize nodes)
            return False
        pf, sf = st.pformat(p), st.sformat(p)
        key = (pf, sf, p.dtype, p.grad.dtype, p.device.type)
        known = self.__dict__.setdefault("_fusable", {})  # id(p) -> (key, verdict)
        seen = known.get(id(p))
        if seen is None or seen[0] != key:  # (the same objects: compared by identity first)
            # (every format fp32: the torch path is torch.optim's own op sequence)
            seen = known[id(p)] = (key, (pf != FP32 or sf != FP32) and
                                   self._fusable_formats(p, pf, sf))
        return seen[1]

    @staticmethod
    def _alike(p, state, stochastic: bool) -> bool:
        """``p``, its gradient and its state tensors laid out alike over dense memory, so that
        the kernel's elementwise pass over memory pairs each value with its own: all contiguous,
        or (a deterministic write-back) one other dense layout they share, such as a
        channels-last convolution weight's, whose gradient and state torch lays out as the
        weight (stochastic rounding counts logical indices, which only contiguous memory
        follows). A state tensor of another layout or shape (loaded from a checkpoint of
        another layout or model) or a sparse gradient sends the parameter to the torch path."""
        g = p.grad
        if g.layout != torch.strided or g.shape != p.shape or g.device != p.device:
            return False
        for t in state.values():  # (state of another shape: a checkpoint of another model)
            if isinstance(t, torch.Tensor) and t.dim() and (
                    t.shape != p.shape or t.device != p.device or t.layout != torch.strided):
                return False
        if p.is_contiguous():  # (the common case, first: a few C calls a parameter)
            if not g.is_contiguous():
                return False
            for t in state.values():
                if isinstance(t, torch.Tensor) and not t.is_contiguous():
                    return False
            return True
        if stochastic or memory_order(p) is None:
            return False
        strides = p.stride()
        return g.stride() == strides and all(t.stride() == strides for t in state.values()
                                             if isinstance(t, torch.Tensor) and t.dim())

    @staticmethod
    def _fusable_formats(p, pf, sf) -> bool:
        """The kernel takes these formats and dtypes."""
        return (
            p.device.type == "cpu"
            and isinstance(pf, (FloatFormat, FixedFormat)) and isinstance(sf, (FloatFormat,
                                                                               FixedFormat))
            and _kernel.opt_dtype_code(p.dtype) is not None
            and _kernel.opt_dtype_code(p.grad.dtype) is not None
            and storage_dtype(sf) in (torch.float32, torch.bfloat16, torch.float16)
        )

    def _run_fused(self, p, s1, s2, opt, grad_scale) -> None:
        run_fused(self.storage, p, s1, s2, opt, grad_scale)

    def _fused(self, p, state, group, grad_scale) -> bool:
        return False


