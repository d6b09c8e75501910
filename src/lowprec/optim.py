"""Optimizers for low-precision parameters: fp32 arithmetic per parameter, low-precision storage.

Parameters, optimizer state and optional master weights live in the formats a policy gives
(real fp16/bf16 tensors, or fp32 tensors holding values on another format's grid when
emulated). Each update is computed in fp32 with the same tensor operations as torch.optim (so
with fp32 formats the results equal torch's bit for bit) and written back with:

* ``nearest``: round to nearest even. Small updates are lost: w + Δw rounds back to w when
  |Δw| < ulp(w) / 2 (the thread's "updates that should be different become equal").
* ``stochastic``: round up with probability proportional to the distance, so E[w'] = w + Δw and
  small updates survive on average (Gupta et al. 2015; torchao's bf16 stochastic rounding, for
  any format here).
* ``kahan``: compensated summation (Kahan 1965; Zamirai et al. 2020): a buffer c in the parameter
  format keeps what rounding dropped and adds it back at the next step.

All state (moments, master weights, compensation buffers, step counts) is in ``state_dict``.
:class:`FormatOptimizer` gives any torch optimizer the same storage rules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .formats import BF16, FP16, FP32, FloatFormat, Format, parse_format
from .quantize import quantize

__all__ = ["SGD", "Adam", "AdamW", "FormatOptimizer", "LowPrecisionOptimizer", "storage_dtype",
           "format_of_dtype", "format_bytes", "UPDATE_MODES"]

UPDATE_MODES = ("nearest", "stochastic", "kahan")
_NATIVE = {FP32: torch.float32, FP16: torch.float16, BF16: torch.bfloat16}


def storage_dtype(fmt: Format) -> torch.dtype:
    """The torch dtype a tensor in ``fmt`` is stored in (float32 carrier for other formats)."""
    return _NATIVE.get(fmt, torch.float32)


def format_of_dtype(dtype: torch.dtype) -> Format:
    for fmt, dt in _NATIVE.items():
        if dt == dtype:
            return fmt
    raise TypeError(f"no lowprec format for dtype {dtype}")


def format_bytes(fmt: Format, numel: int) -> int:
    """Bytes that ``numel`` values take in ``fmt`` (block formats include their scales)."""
    from .formats import BlockFormat

    if isinstance(fmt, BlockFormat):
        elem_bits = numel * fmt.element.bits
        blocks = 1 if fmt.block_size is None else math.ceil(numel / fmt.block_size)
        return math.ceil(elem_bits / 8) + blocks
    return math.ceil(numel * fmt.bits / 8)


def _lr(group: dict) -> float:
    """The group's learning rate times its ``lr_scale`` (BinaryNet scales the latent weights'
    rate per layer; a scheduler that sets ``lr`` keeps the scale)."""
    return group["lr"] * group.get("lr_scale", 1.0)


def _round(x32: torch.Tensor, fmt: Format, mode: str, generator) -> torch.Tensor:
    if fmt == FP32:
        return x32
    return quantize(x32, fmt, "stochastic" if mode == "stochastic" else "nearest",
                    generator=generator)


def _kahan_write(st: "_Storage", p: torch.Tensor, w32: torch.Tensor, w_new: torch.Tensor,
                 comp: torch.Tensor) -> None:
    """Kahan-compensated write-back (Zamirai et al. 2020): add the update less the previous
    rounding error, round onto the parameter format, keep the new error in ``comp`` (stored in
    the parameter format too)."""
    pf = st.pformat(p)
    y = (w_new - w32) - comp.float()
    target = w32 + y
    t = _round(target, st.now(pf, p, "param", target), "nearest", None)
    err = (t - w32) - y
    _write(comp, err, st.now(pf, p, "compensation", err), "nearest", None)
    p.copy_(t)


def _write(dst: torch.Tensor, x32: torch.Tensor, fmt: Format, mode: str, generator) -> None:
    """dst <- x32 rounded to fmt. When dst's own dtype is fmt, torch's cast in copy_ already
    rounds to nearest even, exactly as quantize would: one pass instead of two."""
    if mode != "stochastic" and _NATIVE.get(fmt) == dst.dtype:
        dst.copy_(x32)
    else:
        dst.copy_(_round(x32, fmt, mode, generator))


class _Storage:
    """The storage rules an optimizer applies: formats and the write-back mode."""

    def __init__(self, param_format=None, state_format=None, master_format=None,
                 update: str = "nearest", generator: torch.Generator | None = None) -> None:
        self.configure(param_format=param_format, state_format=state_format,
                       master_format=master_format, update=update, generator=generator)

    def configure(self, *, param_format=None, state_format=None, master_format=None,
                  update: str | None = None, generator=None, controller=None,
                  names: dict | None = None) -> None:
        """Set the formats (``None`` keeps a parameter's own dtype); used by Precision.setup.
        ``controller`` holds the ranges of dynamic fixed-point formats, ``names`` maps
        ``id(param)`` to the parameter's name (the key of its groups)."""
        from .dynamic_fixed import Controller

        self.controller = controller if controller is not None else Controller()
        self.names = dict(names or {})
        self.param_format = None if param_format is None else parse_format(param_format)
        self.state_format = None if state_format is None else parse_format(state_format)
        self.master_format = None if master_format is None else parse_format(master_format)
        if update is not None:
            if update not in UPDATE_MODES:
                raise ValueError(f"update={update!r}; accepted: {', '.join(UPDATE_MODES)}")
            self.update = update
        elif not hasattr(self, "update"):
            self.update = "nearest"
        self.generator = generator

    def pformat(self, p: torch.Tensor) -> Format:
        return self.param_format if self.param_format is not None else format_of_dtype(p.dtype)

    def sformat(self, p: torch.Tensor) -> Format:
        return self.state_format if self.state_format is not None else self.pformat(p)

    def now(self, fmt: Format, p: torch.Tensor, role: str, x: torch.Tensor) -> Format:
        """``fmt``, or for dynamic fixed point the static format its group has now."""
        from .dynamic_fixed import resolve

        return resolve(fmt, f"{role}:{self.names.get(id(p), id(p))}", x, self.controller)


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Base of lowprec's optimizers: subclasses give the fp32 maths in ``_new_weight``."""

    accepts_grad_scale = True

    def __init__(self, params, defaults, *, param_format=None, state_format=None,
                 master_format=None, update="nearest", generator=None) -> None:
        super().__init__(params, defaults)
        self.storage = _Storage(param_format, state_format, master_format, update, generator)

    def configure(self, **kwargs) -> None:
        if any(self.state.values()):
            raise RuntimeError("configure() must be called before the first step")
        self.storage.configure(**kwargs)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts floating state to the parameter's dtype when loading; lowprec keeps each
        tensor's own dtype (fp32 master weights of fp16 parameters must stay fp32)."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for key, val in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(val):
                    self.state[p][key] = val.to(device=p.device, copy=True)

    # -- state in a format -----------------------------------------------------------------
    def _state_tensor(self, p, like32: torch.Tensor, fmt: Format) -> torch.Tensor:
        return torch.zeros_like(like32, dtype=storage_dtype(fmt))

    def _save(self, dst: torch.Tensor, value32: torch.Tensor, fmt: Format, p=None,
              role: str = "state") -> None:
        if p is not None:
            fmt = self.storage.now(fmt, p, role, value32)
        _write(dst, value32, fmt, "nearest", None)

    def _init_common(self, p, state) -> None:
        st = self.storage
        if st.master_format is not None:
            state["master"] = p.detach().to(storage_dtype(st.master_format)).clone()
        elif st.update == "kahan":
            state["compensation"] = torch.zeros_like(p, dtype=storage_dtype(st.pformat(p)))

    def state_layout(self, p) -> dict[str, Format]:
        """Format of every state tensor this optimizer keeps for ``p`` (for the memory ledger)."""
        st = self.storage
        layout = dict(self._moment_layout(p))
        if st.master_format is not None:
            layout["master"] = st.master_format
        elif st.update == "kahan":
            layout["compensation"] = st.pformat(p)
        return layout

    def _moment_layout(self, p) -> dict[str, Format]:  # pragma: no cover - overridden
        return {}

    def state_bytes(self) -> tuple[int, int]:
        """(optimizer-state bytes, master-weight bytes) for all parameters."""
        state = master = 0
        for group in self.param_groups:
            for p in group["params"]:
                for name, fmt in self.state_layout(p).items():
                    nbytes = format_bytes(fmt, p.numel())
                    if name == "master":
                        master += nbytes
                    else:
                        state += nbytes
        return state, master

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
                    _write(p, m32, st.now(pf, p, "param", m32), st.update, st.generator)
                elif st.update == "kahan":
                    _kahan_write(st, p, w32, w_new, state["compensation"])
                else:
                    _write(p, w_new, st.now(pf, p, "param", w_new), st.update, st.generator)
        return loss


    # -- the fused CPU kernel ---------------------------------------------------------------
    def _can_fuse(self, p, state) -> bool:
        from . import _kernel
        from .formats import FixedFormat

        st = self.storage
        pf, sf = st.pformat(p), st.sformat(p)
        return (
            _kernel.available() and p.device.type == "cpu" and p.is_contiguous()
            and p.grad.is_contiguous() and "master" not in state and st.update != "kahan"
            and (pf != FP32 or sf != FP32)  # fp32 storage keeps torch's exact op sequence
            and isinstance(pf, (FloatFormat, FixedFormat)) and isinstance(sf, (FloatFormat,
                                                                               FixedFormat))
            and _kernel.opt_dtype_code(p.dtype) is not None
            and _kernel.opt_dtype_code(p.grad.dtype) is not None
            and storage_dtype(sf) in (torch.float32, torch.bfloat16, torch.float16)
        )

    def _run_fused(self, p, s1, s2, opt, grad_scale) -> None:
        from . import _kernel
        from ._params import ROUNDING_CODES, element_params
        from .quantize import draw_seed
        from .rounding import Rounding

        st = self.storage
        opt.p_dtype = _kernel.opt_dtype_code(p.dtype)
        opt.g_dtype = _kernel.opt_dtype_code(p.grad.dtype)
        opt.s_dtype = _kernel.opt_dtype_code(storage_dtype(st.sformat(p)))
        opt.grad_scale = 1.0 if grad_scale is None else float(grad_scale)
        opt.p_is_bf16 = int(st.pformat(p) == BF16)
        opt.s_is_bf16 = int(st.sformat(p) == BF16)
        mode = Rounding.STOCHASTIC if st.update == "stochastic" else Rounding.NEAREST_EVEN
        seed = draw_seed(st.generator) if st.update == "stochastic" else (0, 0)
        _kernel.opt_step(p, p.grad, s1, s2, opt, element_params(st.pformat(p)),
                         ROUNDING_CODES[mode], seed, element_params(st.sformat(p)))

    def _fused(self, p, state, group, grad_scale) -> bool:
        return False


class SGD(LowPrecisionOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD's rule)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 **storage) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, momentum={momentum}, weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov), **storage)

    def _moment_layout(self, p):
        momentum = self.param_groups[0]["momentum"] if self.param_groups else 0
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                momentum = g["momentum"]
        return {"momentum_buffer": self.storage.sformat(p)} if momentum else {}

    def _init_state(self, p, state) -> None:
        state["step"] = 0

    def _fused(self, p, state, group, grad_scale) -> bool:
        from . import _kernel

        state["step"] += 1
        mom = group["momentum"]
        first = mom and "momentum_buffer" not in state
        if first:
            state["momentum_buffer"] = torch.zeros_like(
                p, dtype=storage_dtype(self.storage.sformat(p)))
        opt = _kernel.LPOpt(kind=0, nesterov=int(group["nesterov"]), first=int(bool(first)),
                            has_momentum=int(bool(mom)), lr=_lr(group), momentum=mom,
                            dampening=group["dampening"], wd=group["weight_decay"])
        self._run_fused(p, state.get("momentum_buffer"), None, opt, grad_scale)
        return True

    def _new_weight(self, p, w32, g32, state, group):
        state["step"] += 1
        if group["weight_decay"]:
            g32 = g32.add(w32, alpha=group["weight_decay"])
        mom = group["momentum"]
        if mom:
            sf = self.storage.sformat(p)
            if "momentum_buffer" not in state:
                buf32 = torch.clone(g32).detach()
                state["momentum_buffer"] = self._state_tensor(p, buf32, sf)
            else:
                buf32 = state["momentum_buffer"].float().mul_(mom).add_(
                    g32, alpha=1 - group["dampening"])
            self._save(state["momentum_buffer"], buf32, sf, p, "momentum")
            buf32 = state["momentum_buffer"].float()
            g32 = g32.add(buf32, alpha=mom) if group["nesterov"] else buf32
        return w32.add(g32, alpha=-_lr(group))


class Adam(LowPrecisionOptimizer):
    """Adam (Kingma & Ba 2015) with torch.optim.Adam's rule; ``AdamW`` decouples weight decay.

    Why torch's Adam fails in pure fp16, and what this one does instead:

    * eps = 1e-8 is below fp16's smallest subnormal (6e-8): in fp16 arithmetic it rounds to 0,
      so sqrt(v) + eps is 0 wherever v is, and m / 0 gives Inf or NaN (keras#11860,
      pytorch#8860). Here every operation runs in fp32, where 1e-8 is an ordinary number.
    * v = E[g**2] spans twice the exponent range of g: gradients of 1e-4 give g**2 = 1e-8, which
      fp16 cannot store, so v flushes to zero while m (of the size of g) does not, and the
      update m / (sqrt(v) + eps) explodes. When the state format has a narrow exponent range
      (fewer than 8 exponent bits), this optimizer stores sqrt(v) instead of v
      (``exp_avg_sq_sqrt``): it has the magnitude of g, like m, so both fit or underflow together.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False, **storage) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} must be in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, decoupled=decoupled), **storage)

    def _sqrt_storage(self, p) -> bool:
        f = self.storage.sformat(p)
        return isinstance(f, FloatFormat) and f.exp_bits < 8

    def _moment_layout(self, p):
        sf = self.storage.sformat(p)
        second = "exp_avg_sq_sqrt" if self._sqrt_storage(p) else "exp_avg_sq"
        return {"exp_avg": sf, second: sf}

    def _init_state(self, p, state) -> None:
        sf = self.storage.sformat(p)
        state["step"] = 0
        state["exp_avg"] = self._state_tensor(p, p, sf)
        key = "exp_avg_sq_sqrt" if self._sqrt_storage(p) else "exp_avg_sq"
        state[key] = self._state_tensor(p, p, sf)

    def _fused(self, p, state, group, grad_scale) -> bool:
        from . import _kernel

        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"]
        sqrt_key = "exp_avg_sq_sqrt" in state
        opt = _kernel.LPOpt(kind=1, decoupled=int(group["decoupled"]),
                            sqrt_storage=int(sqrt_key), lr=_lr(group), wd=group["weight_decay"],
                            beta1=beta1, beta2=beta2, eps=group["eps"],
                            step_size=_lr(group) / (1 - beta1**step),
                            bc2_sqrt=math.sqrt(1 - beta2**step))
        s2 = state["exp_avg_sq_sqrt"] if sqrt_key else state["exp_avg_sq"]
        self._run_fused(p, state["exp_avg"], s2, opt, grad_scale)
        return True

    def _new_weight(self, p, w32, g32, state, group):
        sf = self.storage.sformat(p)
        beta1, beta2 = group["betas"]
        lr, eps, wd = _lr(group), group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"]
        if wd:
            if group["decoupled"]:
                w32 = w32.mul(1 - lr * wd)
            else:
                g32 = g32.add(w32, alpha=wd)
        m32 = state["exp_avg"].float().lerp_(g32, 1 - beta1)
        if "exp_avg_sq" in state:
            v32 = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            self._save(state["exp_avg_sq"], v32, sf, p, "exp_avg_sq")
            root = state["exp_avg_sq"].float().sqrt()
        else:
            v_old = state["exp_avg_sq_sqrt"].float().square()
            v32 = v_old.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            self._save(state["exp_avg_sq_sqrt"], v32.sqrt(), sf, p, "exp_avg_sq")
            root = state["exp_avg_sq_sqrt"].float()
        self._save(state["exp_avg"], m32, sf, p, "exp_avg")
        m32 = state["exp_avg"].float()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (root / math.sqrt(bias_correction2)).add_(eps)
        return w32.addcdiv(m32, denom, value=-step_size)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), torch.optim.AdamW's rule."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **storage) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled=True, **storage)


class FormatOptimizer:
    """Any torch optimizer under a policy's storage rules.

    With master weights (Apex O2), the wrapped optimizer steps fp32 copies of the parameters
    and the parameters receive the rounded result. Without, it steps the parameters themselves
    (fp32 carriers in emulation) and the result is rounded onto the parameter format with the
    write-back mode; its floating state is rounded onto the state format after each step.
    Native 16-bit parameters with a stochastic or Kahan write-back get fp32 *shadows* instead:
    copied from the parameters before each step (no precision is kept across steps, unlike
    master weights), so the update is computed in fp32 and the write-back mode sees it whole;
    a torch optimizer stepping bf16 tensors itself would have rounded it to nearest already.
    """

    accepts_grad_scale = True

    def __init__(self, optimizer: torch.optim.Optimizer, *, param_format=None, state_format=None,
                 master_format=None, update="nearest", generator=None) -> None:
        self.storage = _Storage(param_format, state_format, master_format, update, generator)
        self.model_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.shadow = master_format is None and self.storage.update != "nearest" and any(
            p.dtype != torch.float32 for p in self.model_params)
        if master_format is not None or self.shadow:
            mdt = torch.float32 if self.shadow else storage_dtype(self.storage.master_format)
            self.masters = [p.detach().to(mdt).clone().requires_grad_(True)
                            for p in self.model_params]
            it = iter(self.masters)
            groups = []
            for g in optimizer.param_groups:
                ng = {k: v for k, v in g.items() if k != "params"}
                ng["params"] = [next(it) for _ in g["params"]]
                groups.append(ng)
            self.optimizer = type(optimizer)(groups, **optimizer.defaults)
        else:
            self.masters = None
            self.optimizer = optimizer
        self.compensation: dict[int, torch.Tensor] = {}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def params_for_check(self) -> list[torch.Tensor]:
        """The model's parameters (not the masters) whose gradients Precision checks."""
        return [p for p in self.model_params if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params + (self.masters or []):
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | torch.Tensor | None = None):
        st = self.storage
        if self.masters is not None:
            for p, m in zip(self.model_params, self.masters):
                if self.shadow:
                    m.copy_(p)  # this step starts from the stored value
                if p.grad is None:
                    m.grad = None
                    continue
                g = p.grad.to(m.dtype)
                m.grad = g * grad_scale if grad_scale is not None else g
            loss = self.optimizer.step(closure)
            for p, m in zip(self.model_params, self.masters):
                m32 = m.float()
                if self.shadow and st.update == "kahan":
                    c = self.compensation.setdefault(
                        id(p), torch.zeros_like(p, dtype=storage_dtype(st.pformat(p))))
                    _kahan_write(st, p, p.float(), m32, c)
                else:
                    p.copy_(_round(m32, st.now(st.pformat(p), p, "param", m32), st.update,
                                   st.generator))
            return loss
        old = {}
        for p in self.model_params:
            if p.grad is not None and grad_scale is not None:
                p.grad.mul_(grad_scale)
            if st.update == "kahan" and p.grad is not None:
                old[p] = p.float().clone()
        loss = self.optimizer.step(closure)
        for p in self.model_params:
            if p.grad is None:
                continue
            pf = st.pformat(p)
            if st.update == "kahan":
                c = self.compensation.setdefault(
                    id(p), torch.zeros_like(p, dtype=storage_dtype(pf)))
                _kahan_write(st, p, old[p], p.float(), c)
            else:
                w32 = p.float()
                p.copy_(_round(w32, st.now(pf, p, "param", w32), st.update, st.generator))
            sf = st.sformat(p)
            if sf != FP32:
                for key, val in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(val) and val.is_floating_point() and val.dim() > 0:
                        v32 = val.float()
                        val.copy_(_round(v32, st.now(sf, p, f"state.{key}", v32), "nearest",
                                         None))
        return loss

    def state_bytes(self) -> tuple[int, int]:
        state = 0
        for p, s in self.optimizer.state.items():
            for val in s.values():
                if torch.is_tensor(val):
                    if val.is_floating_point() and val.dim() > 0:
                        state += format_bytes(self.storage.sformat(p), val.numel())
                    else:
                        state += val.numel() * val.element_size()
        if self.storage.update == "kahan" and (self.masters is None or self.shadow):
            state += sum(format_bytes(self.storage.pformat(p), p.numel())
                         for p in self.model_params)
        if self.shadow:  # fp32 copies that live between steps, though they carry nothing over
            state += sum(4 * m.numel() for m in self.masters)
            return state, 0
        master = 0 if self.masters is None else sum(
            format_bytes(self.storage.master_format, m.numel()) for m in self.masters)
        return state, master

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": None if self.masters is None else [m.detach().clone() for m in self.masters],
            "compensation": {i: self.compensation[id(p)].clone()
                             for i, p in enumerate(self.model_params) if id(p) in self.compensation},
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("masters") is not None:
            with torch.no_grad():
                for m, v in zip(self.masters, state["masters"]):
                    m.copy_(v)
        self.compensation = {id(self.model_params[int(i)]): v.clone()
                             for i, v in state.get("compensation", {}).items()}

    def __repr__(self) -> str:
        return f"FormatOptimizer({type(self.optimizer).__name__}, masters={self.masters is not None})"
