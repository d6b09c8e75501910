"""The write-back rules of lowprec's optimizers: an fp32 result onto a storage format.

``nearest`` rounds to nearest even (small updates are lost: w + dw rounds back to w when
|dw| < ulp(w) / 2); ``stochastic`` rounds up with probability proportional to the distance, so
E[w'] = w + dw (Gupta et al. 2015); ``kahan`` keeps what rounding dropped in a compensation
buffer in the parameter format and adds it back at the next step (Kahan 1965; Zamirai et al.
2020). :class:`Storage` holds the formats and the mode an optimizer applies.
"""

from __future__ import annotations

import torch

from ...numerics.formats import FP32, Format, parse_format
from ...numerics.quantize import quantize, quantize_
from ...numerics.rounding import check_generator
from ...numerics.storage import NATIVE_DTYPES, format_of_dtype
from ..policy import Policy, WriteBack
from ..regimes.base import GroupKey, regimes_resolve, static_resolve

__all__ = ["Storage", "group_lr", "round_to", "write", "kahan_write"]


def group_lr(group: dict) -> float:
    """The group's learning rate times its ``lr_scale`` (BinaryNet scales the latent weights'
    rate per layer; a scheduler that sets ``lr`` keeps the scale)."""
    return group["lr"] * group.get("lr_scale", 1.0)


def round_to(x32: torch.Tensor, fmt: Format, mode: str, generator) -> torch.Tensor:
    if fmt == FP32:
        return x32
    return quantize(x32, fmt, "stochastic" if mode == "stochastic" else "nearest",
                    generator=generator)


def kahan_write(st: "Storage", p: torch.Tensor, w32: torch.Tensor, w_new: torch.Tensor,
                 comp: torch.Tensor) -> None:
    """Kahan-compensated write-back (Zamirai et al. 2020): add the update less the previous
    rounding error, round onto the parameter format, keep the new error in ``comp`` (stored in
    the parameter format too)."""
    pf = st.pformat(p)
    y = (w_new - w32) - comp.float()
    target = w32 + y
    t = round_to(target, st.now(pf, p, "param", target), "nearest", None)
    err = (t - w32) - y
    write(comp, err, st.now(pf, p, "compensation", err), "nearest", None)
    p.copy_(t)


def write(dst: torch.Tensor, x32: torch.Tensor, fmt: Format, mode: str, generator) -> None:
    """dst <- x32 rounded to fmt. When dst's own dtype is fmt, torch's cast in copy_ already
    rounds to nearest even, exactly as quantize would: one pass instead of two; when x32 is dst
    (an fp32 parameter updated in place), rounded to nearest in place: one pass, no copy."""
    if mode != "stochastic" and NATIVE_DTYPES.get(fmt) == dst.dtype:
        dst.copy_(x32)
    elif x32 is dst and mode != "stochastic":
        if fmt != FP32:
            quantize_(dst, fmt, "nearest")
    else:
        dst.copy_(round_to(x32, fmt, mode, generator))


class Storage:
    """The storage rules an optimizer applies: formats and the write-back mode."""

    def __init__(self, param_format=None, state_format=None, master_format=None,
                 update: str = "nearest", generator: torch.Generator | None = None) -> None:
        self.configure(param_format=param_format, state_format=state_format,
                       master_format=master_format, update=update, generator=generator)

    def configure(self, *, param_format=None, state_format=None, master_format=None,
                  update: str | None = None, generator=None, resolve=None,
                  names: dict | None = None, param_formats: dict | None = None) -> None:
        """Set the formats (``None`` keeps a parameter's own dtype); used by Precision.setup.
        ``resolve(fmt, key, x)`` gives the static format a group of a dynamic format (dynamic
        fixed point) rounds with now (Precision's regimes; by default, fresh instances of the
        regimes these formats need: see :func:`~lowprec.training.regimes.base.regimes_resolve`), ``names`` maps
        ``id(param)`` to the parameter's name (the key of its groups), ``param_formats`` maps
        ``id(param)`` to the storage format of a parameter that differs from ``param_format``
        (a per-module override: fp32 norm weights under a 16-bit policy)."""
        self.names = dict(names or {})
        self.param_format = None if param_format is None else parse_format(param_format)
        self.param_formats = {k: parse_format(v) for k, v in (param_formats or {}).items()}
        self.state_format = None if state_format is None else parse_format(state_format)
        self.master_format = None if master_format is None else parse_format(master_format)
        self.resolve = resolve if resolve is not None else self._own_resolve()
        if update is not None:
            self.update = WriteBack.parse(update)
        elif not hasattr(self, "update"):
            self.update = WriteBack.NEAREST
        self.generator = check_generator(generator)

    def pformat(self, p: torch.Tensor) -> Format:
        fmt = self.param_formats.get(id(p)) if self.param_formats else None
        if fmt is not None:
            return fmt
        return self.param_format if self.param_format is not None else format_of_dtype(p.dtype)

    def sformat(self, p: torch.Tensor) -> Format:
        return self.state_format if self.state_format is not None else self.pformat(p)

    def now(self, fmt: Format, p: torch.Tensor, role: str, x: torch.Tensor) -> Format:
        """``fmt``, or for dynamic fixed point the static format its group has now. ``role``:
        a :class:`~lowprec.training.regimes.base.Role` value, else a state buffer's name."""
        if not fmt.dynamic:
            return fmt
        return self.resolve(fmt, GroupKey.of(role, self.names.get(id(p), id(p))), x)

    def _own_resolve(self):
        """The resolve of an optimizer built on its own: fresh regimes for its formats (a
        dynamic fixed-point one keeps every group's range), formats with none passed as they
        are."""
        fmts = [f for f in (self.param_format, self.state_format, self.master_format,
                            *self.param_formats.values()) if f is not None and f.dynamic]
        if not fmts:
            return static_resolve
        # every dynamic format in a role a regime looks at (their classes decide by the formats)
        return regimes_resolve(Policy(params=fmts[0], compute=FP32, grads=FP32,
                                      optimizer_state=FP32, master=None))


