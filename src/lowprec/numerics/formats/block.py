"""The block family: ``BlockFormat``, elements of a float or fixed-point format sharing one
power-of-two scale per block (OCP MX v1.0; one per tensor: ``dfx<N>``), and its grammar,
``block<ELEMENT,N|tensor[,axis=N][,scale=LO..HI]>``, ``dfx<N>`` and the MX names."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from .base import check_int
from .fixed import FixedFormat
from .floats import FloatFormat, Overflow, Style
from .registry import FormatFamily, bad_format, decimal, parse_format, register_format_family

__all__ = ["BlockFormat", "BLOCK_FAMILY"]


@dataclass(frozen=True)
class BlockFormat:
    """Elements in ``element`` sharing one power-of-two scale per block.

    ``block_size`` consecutive elements along ``axis`` share the scale 2**s with
    s = floor(log2(amax)) - element.emax, clamped to the E8M0 range [-127, 127]
    (OCP Microscaling Formats v1.0, section 6.3). Elements saturate at the element's max; a block
    holding a NaN or an Inf becomes all NaN (its E8M0 scale is NaN). ``block_size=None`` shares
    one exponent across the whole tensor: the dynamic fixed point of Courbariaux et al. (2014)
    with an integer element.
    """

    #: a static grid per block scale (see DynamicFixedFormat.dynamic)
    dynamic: ClassVar[bool] = False

    element: FloatFormat | FixedFormat
    block_size: int | None = 32
    axis: int = -1
    scale_min_exp: int = -127
    scale_max_exp: int = 127

    def __post_init__(self) -> None:
        if not isinstance(self.element, (FloatFormat, FixedFormat)):
            raise TypeError(f"element must be a FloatFormat or FixedFormat, got {self.element!r}")
        if isinstance(self.element, FloatFormat) and self.element.overflow is not Overflow.SATURATE:
            object.__setattr__(self, "element", replace(self.element, overflow=Overflow.SATURATE))
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1, 2**31)
        check_int("axis", self.axis, -64, 63)
        check_int("scale_min_exp", self.scale_min_exp, -127, 127)
        check_int("scale_max_exp", self.scale_max_exp, self.scale_min_exp, 127)

    @property
    def bits(self) -> float:
        """Storage bits per element, the shared 8-bit scale included."""
        if self.block_size is None:
            return float(self.element.bits)
        return self.element.bits + 8 / self.block_size

    @property
    def max(self) -> float:
        return self.element.max * 2.0**self.scale_max_exp

    @property
    def min_normal(self) -> float:
        return self.element.min_normal * 2.0**self.scale_min_exp

    @property
    def min_subnormal(self) -> float:
        return self.element.min_subnormal * 2.0**self.scale_min_exp

    @property
    def eps(self) -> float:
        return self.element.eps

    def __str__(self) -> str:
        for name, fmt in _BLOCK_NAMES.items():
            if fmt == self:
                return name
        if (
            self.block_size is None
            and isinstance(self.element, FixedFormat)
            and self.element.frac_bits == 0
            and self.element.signed
            and not self.element.symmetric
            and (self.axis, self.scale_min_exp, self.scale_max_exp) == (-1, -127, 127)
        ):
            return f"dfx<{self.element.int_bits}>"
        size = "tensor" if self.block_size is None else str(self.block_size)
        extra = "" if self.axis == -1 else f",axis={self.axis}"
        if (self.scale_min_exp, self.scale_max_exp) != (-127, 127):
            extra += f",scale={self.scale_min_exp}..{self.scale_max_exp}"
        return f"block<{self.element},{size}{extra}>"


_MX_ELEMENTS = {
    "mxfp8_e4m3": FloatFormat(4, 3, Style.FN),
    "mxfp8_e5m2": FloatFormat(5, 2),
    "mxfp6_e2m3": FloatFormat(2, 3, Style.FN),
    "mxfp6_e3m2": FloatFormat(3, 2, Style.FN),
    "mxfp4": FloatFormat(2, 1, Style.FN),
    # MXINT8: 8-bit two's complement with an implicit 2**-6, range kept symmetric as in the
    # reference implementation (microsoft/microxcaling: max_norm 127/64 for int8, emax 0)
    "mxint8": FixedFormat(2, 6, symmetric=True),
}
_BLOCK_NAMES = {name: BlockFormat(elem, 32) for name, elem in _MX_ELEMENTS.items()}

_DFX_RE = re.compile(r"^dfx<?(\d+)>?$")
_BLOCK_RE = re.compile(r"^block<(.+),(\d+|tensor)((?:,[a-z_]+=[^,]+)*)>$")


def _parse(s: str, spec: str) -> BlockFormat | None:
    if m := _DFX_RE.match(s):
        return BlockFormat(FixedFormat(int(m.group(1)), 0), None)
    if m := _BLOCK_RE.match(s):
        elem = parse_format(m.group(1))
        if not isinstance(elem, (FloatFormat, FixedFormat)):
            raise bad_format(spec, "a block element must be a float or fixed-point format")
        size = None if m.group(2) == "tensor" else int(m.group(2))
        kwargs: dict = {}
        seen: set[str] = set()
        for item in filter(None, m.group(3).split(",")):
            key, val = item.split("=", 1)
            if key in ("axis", "scale") and key in seen:
                raise bad_format(spec, f"block option {key} given twice")
            seen.add(key)
            if key == "axis":
                kwargs["axis"] = int(decimal(val, spec, integer=True))
            elif key == "scale" and ".." in val:
                lo, hi = val.split("..")
                kwargs["scale_min_exp"], kwargs["scale_max_exp"] = (
                    int(decimal(lo, spec, integer=True)), int(decimal(hi, spec, integer=True)))
            else:
                raise bad_format(spec, f"block option {item!r} is not axis=N or scale=LO..HI")
        return BlockFormat(elem, size, **kwargs)
    return None


def _special(fmt: BlockFormat) -> str:
    size = "tensor" if fmt.block_size is None else fmt.block_size
    return f"{fmt.element} x {size}, E8M0 scale"


BLOCK_FAMILY = register_format_family(FormatFamily(
    "block", (BlockFormat,), _parse,
    accepted="mxfp8_e4m3 mxfp8_e5m2 mxfp6_e2m3 mxfp6_e3m2 mxfp4 mxint8; "
             "block<ELEMENT,N|tensor>; dfx<N> (one exponent per tensor)",
    names={**_BLOCK_NAMES, "dfx<10>": BlockFormat(FixedFormat(10, 0), None)},
    aliases={"mxfp4_e2m1": _BLOCK_NAMES["mxfp4"]},
    special=_special))
