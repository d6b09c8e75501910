"""``FormatOptimizer``: any torch optimizer under a policy's storage rules."""

from __future__ import annotations

import math
import struct

import torch
from torch.optim import optimizer as _torch_optimizer

from ...numerics import kernel as _kernel
from ...numerics.formats import FP32, Format
from ...numerics.storage import compact, format_of_dtype, storage_dtype
from .base import LowPrecisionOptimizer, run_fused
from .protocol import PolicyOptimizer
from .writeback import Storage, kahan_write, round_to, write

__all__ = ["FormatOptimizer"]


def _number(x) -> bool:
    """A Python int or float (not a bool, not a tensor, not NaN) that float32 holds as torch
    converts it (a finite value beyond float32's range: torch's step raises): what the
    kernel's float32 fields take as torch takes a Python scalar."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or math.isnan(x):
        return False
    try:
        _f32(x)
    except OverflowError:
        return False
    return True


def _f32(x: float) -> float:
    """``x`` rounded to float32, as torch hands a Python scalar to a float32 kernel
    (OverflowError for a finite value beyond float32's range; run at every step: no tensor)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


class FormatOptimizer(torch.optim.Optimizer, PolicyOptimizer):
    """Any torch optimizer under a policy's storage rules.

    With master weights (Apex O2), the wrapped optimizer steps fp32 copies of the parameters
    and the parameters receive the rounded result. Without, it steps the parameters themselves
    (fp32 carriers in emulation) and the result is rounded onto the parameter format with the
    write-back mode; its floating state is rounded onto the state format after each step.
    Native 16-bit parameters with a stochastic or Kahan write-back get fp32 *shadows* instead:
    copied from the parameters before each step (no precision is kept across steps, unlike
    master weights), so the update is computed in fp32 and the write-back mode sees it whole;
    a torch optimizer stepping bf16 tensors itself would have rounded it to nearest already.

    The user's optimizer object is kept, never rebuilt: master weights (or shadows) are swapped
    into its own parameter groups in place, so every group key survives (AdamW's
    ``decoupled_weight_decay``, ``foreach``, ``fused``...). The wrapper is a
    ``torch.optim.Optimizer`` whose ``param_groups``, ``defaults`` and ``state`` *are* the
    wrapped optimizer's: a ``torch.optim.lr_scheduler`` built on either object, before or after
    ``Precision.setup``, sets the learning rate the step actually uses.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, param_format=None, state_format=None,
                 master_format=None, update="nearest", generator=None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FormatOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        self.storage = Storage(param_format, state_format, master_format, update, generator)
        self.optimizer = optimizer
        self.model_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.shadow = master_format is None and self.storage.update != "nearest" and any(
            p.dtype != torch.float32 for p in self.model_params)
        self.masters = None
        if master_format is not None or self.shadow:
            self.masters = []
            for g in optimizer.param_groups:
                g["params"] = self._masters_for(g["params"])
        # torch's Optimizer.__init__ on the wrapped groups: add_param_group keeps the same dicts
        # (it only fills missing defaults into them), so both objects see one set of groups
        self._sharing = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._sharing = True
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.compensation: dict[int, torch.Tensor] = {}

    def _masters_for(self, params) -> list[torch.Tensor]:
        """fp32 (or master-format) copies of ``params``; any state the optimizer already holds
        for a parameter moves to its copy."""
        mdt = torch.float32 if self.shadow else storage_dtype(self.storage.master_format)
        out = []
        for p in params:
            m = p.detach().to(mdt).clone().requires_grad_(True)
            if p in self.optimizer.state:
                self.optimizer.state[m] = self.optimizer.state.pop(p)
            out.append(m)
        self.masters.extend(out)
        return out

    def add_param_group(self, param_group: dict) -> None:
        if not self._sharing:  # torch's __init__ registering the groups already shared
            return
        params = param_group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        self.model_params.extend(params)
        group = dict(param_group)
        group["params"] = self._masters_for(params) if self.masters is not None else params
        self.optimizer.add_param_group(group)

    def configure_storage(self, **kwargs) -> None:
        self.storage.configure(**kwargs)

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
                    kahan_write(st, p, p.float(), m32, c)
                else:
                    p.copy_(round_to(m32, st.now(st.pformat(p), p, "param", m32), st.update,
                                   st.generator))
            return loss
        old = {}
        for p in self.model_params:
            if p.grad is not None and grad_scale is not None:
                p.grad.mul_(grad_scale)
            if st.update == "kahan" and p.grad is not None:
                old[p] = p.float().clone()
        if closure is None and self._sgd_fuses():
            return None
        loss = self.optimizer.step(closure)
        for p in self.model_params:
            if p.grad is None:
                continue
            pf = st.pformat(p)
            if st.update == "kahan":
                c = self.compensation.setdefault(
                    id(p), torch.zeros_like(p, dtype=storage_dtype(pf)))
                kahan_write(st, p, old[p], p.float(), c)
            else:
                w32 = p.float()  # (p itself when fp32: rounded in place)
                write(p, w32, st.now(pf, p, "param", w32), st.update, st.generator)
            sf = st.sformat(p)
            if sf != FP32:
                for key, val in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(val) and val.is_floating_point() and val.dim() > 0:
                        v32 = val.float()  # (val itself when fp32: rounded in place)
                        write(val, v32, st.now(sf, p, key, v32), "nearest", None)
        return loss

    def _sgd_fuses(self) -> bool:
        """A wrapped ``torch.optim.SGD`` stepping float32 carriers: its update and the
        write-back in one pass of the fused kernel (lp_opt_step), which computes torch's
        single-tensor step as its CPU kernels do (:class:`~.sgd.SGD`'s definition: one fused
        multiply-add for each ``add`` with ``alpha``, ``buf.mul_(momentum)`` rounded to float32
        first), the update reading the momentum before it is rounded to the state format
        (``raw_state``: torch's step, then this wrapper's rounding of the state), then rounds
        parameter and state as :func:`.writeback.write` does; torch's separate passes took
        about twice as long on an Intel Xeon (benchmarks/RESULTS.md, "Issue 37, twelfth
        session"). Done (True) only where every parameter with a gradient qualifies; else
        nothing is done and torch's step runs. Kept to what makes the two identical,
        gradients after the step included: no hooks on the step (they would not run), a step
        nobody replaced, no maximize,
        differentiable, fused (torch's own kernel) or foreach groups (the for-each Nesterov
        step adds the momentum into the gradients), numbers for the hyperparameters, parameters
        this wrapper rounds, float32 state of their shape and layout and no other state. A
        learning-rate scheduler built on the wrapped optimizer is told it stepped, and torch's
        profiler sees the scope torch's step opens. fp32 parameters with fp32 state go
        through the kernel too (its arithmetic is torch's; rounding to fp32 changes nothing):
        a policy with fp32 state (``o=fp32``) whose overrides keep some layers' parameters in
        fp32 keeps the fused step (with a 16-bit state format those layers' state is 16-bit,
        and fused as before)."""
        o, st = self.optimizer, self.storage
        if type(o) is not torch.optim.SGD or st.update == "kahan" or \
                torch.compiler.is_compiling() or not _kernel.available() or \
                o._optimizer_step_pre_hooks or o._optimizer_step_post_hooks or \
                _torch_optimizer._global_optimizer_pre_hooks or \
                _torch_optimizer._global_optimizer_post_hooks:
            return False
        step = vars(o).get("step")
        # (a scheduler's wrapper of the class's step; not of a step the user put in its place)
        if step is not None and not (hasattr(step, "_wrapped_by_lr_sched") and
                                     getattr(step, "__wrapped__", None) is type(o).step):
            return False
        ours = self.__dict__.get("_model_ids")
        if ours is None or len(ours) != len(self.model_params):
            ours = self._model_ids = {id(p) for p in self.model_params}
        todo = []
        for group in o.param_groups:
            if group.get("maximize") or group.get("differentiable") or group.get("fused") or \
                    group.get("foreach") or \
                    not all(_number(group[k]) for k in ("lr", "momentum", "dampening",
                                                         "weight_decay")):
                return False
            wd = group["weight_decay"]
            if wd != 0 and _f32(wd) == 0:  # (torch adds 0 * w: NaN where w is Inf)
                return False
            for p in group["params"]:
                if p.grad is None:
                    continue
                pf, sf = st.pformat(p), st.sformat(p)
                state = o.state.get(p, {})
                buf = state.get("momentum_buffer")
                if id(p) not in ours or p.dtype != torch.float32 or \
                        p.grad.dtype != torch.float32 or \
                        any(k != "momentum_buffer" for k in state) or \
                        (buf is not None and (not group["momentum"] or
                                              not isinstance(buf, torch.Tensor) or
                                              buf.dtype != torch.float32)) or \
                        not LowPrecisionOptimizer._fusable_formats(p, pf, sf) or \
                        not LowPrecisionOptimizer._alike(p, state, st.update == "stochastic"):
                    return False
                todo.append((p, group, buf))
        with torch.autograd.profiler.record_function("Optimizer.step#SGD.step"):  # (torch's)
            for p, group, buf in todo:
                self._sgd_one(p, group, buf)
        if step is not None:
            o._opt_called = True  # what the scheduler's wrapper of o.step records
        return True

    def _sgd_one(self, p, group: dict, buf) -> None:
        """One parameter of :meth:`_sgd_fuses`'s step."""
        mom = group["momentum"]
        first = bool(mom) and buf is None
        if first:  # (torch's clone of the gradient, laid out as it)
            buf = self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        opt = _kernel.LPOpt(kind=0, nesterov=int(group["nesterov"]), first=int(first),
                            has_momentum=int(bool(mom)), neg_lr=-float(group["lr"]),
                            momentum=mom, damp_c=1 - group["dampening"],
                            wd=float(group["weight_decay"]), raw_state=1)
        run_fused(self.storage, p, buf if mom else None, None, opt, None)

    def state_layout(self, p) -> dict[str, Format]:
        """Format of every state tensor kept for the model parameter ``p``, each with one value
        per element of ``p`` (``"master"``: the master weights; ``"shadow"``: the fp32 copies
        that live between steps, though they carry nothing over). The wrapped optimizer's
        per-element state is listed once it exists (torch creates it at the first step); its
        scalar bookkeeping (0-dim step counts) is not per element and not listed here. The
        memory ledger (:func:`lowprec.training.memory.optimizer_bytes`) counts the bytes."""
        st = self.storage
        stepped = p
        if self.masters is not None:
            stepped = self.masters[next(i for i, q in enumerate(self.model_params) if q is p)]
        layout: dict[str, Format] = {}
        for name, val in self.optimizer.state.get(stepped, {}).items():
            if torch.is_tensor(val) and val.is_floating_point() and val.dim() > 0:
                # stepping masters or shadows, the wrapped optimizer keeps its state in their
                # dtype, unrounded; otherwise step() rounds it onto the state format
                layout[name] = (format_of_dtype(val.dtype) if self.masters is not None
                                else st.sformat(p))
        if st.update == "kahan" and (self.masters is None or self.shadow):
            layout["compensation"] = st.pformat(p)
        if self.shadow:
            layout["shadow"] = FP32
        elif self.masters is not None:
            layout["master"] = st.master_format
        return layout

    def state_dict(self) -> dict:
        """The wrapped optimizer's state_dict, the masters and the Kahan compensations. Without
        masters the wrapped optimizer's state lies on the state format's grid in the
        parameters' dtype (float32 carriers under emulation): it is saved in the format's own
        dtype (:func:`lowprec.numerics.storage.compact`: fp16 momentum as float16, as a native
        run holds it), and the wrapped optimizer's ``load_state_dict`` casts it back to the
        parameters' dtype, exactly."""
        inner = self.optimizer.state_dict()
        st = self.storage
        if self.masters is None:
            state = {}
            for i, s in inner["state"].items():
                fmt = st.sformat(self.model_params[i])
                state[i] = {k: compact(v, fmt) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in s.items()}
            inner = {**inner, "state": state}
        return {
            "optimizer": inner,
            "masters": None if self.masters is None else [m.detach().clone() for m in self.masters],
            "compensation": {i: compact(self.compensation[id(p)], st.pformat(p)).clone()
                             for i, p in enumerate(self.model_params) if id(p) in self.compensation},
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        # torch's load_state_dict replaces the optimizer's param_groups and state objects:
        # share the new ones (a scheduler built on this wrapper sets the rate the step uses)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        if state.get("masters") is not None:
            with torch.no_grad():
                for m, v in zip(self.masters, state["masters"]):
                    m.copy_(v)
        self.compensation = {}
        for i, v in state.get("compensation", {}).items():
            p = self.model_params[int(i)]
            self.compensation[id(p)] = v.to(dtype=storage_dtype(self.storage.pformat(p)),
                                            copy=True)

    def __repr__(self) -> str:
        return f"FormatOptimizer({type(self.optimizer).__name__}, masters={self.masters is not None})"
