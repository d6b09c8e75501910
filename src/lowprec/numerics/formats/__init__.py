"""Number formats: frozen dataclasses that validate themselves and derive their limits.

Every format answers the same questions (``max``, ``min_normal``, ``min_subnormal``, ``eps``,
``bits``) from its fields, never from a hand-kept table, and prints as the short string that
:func:`parse_format` reads back (``str(FloatFormat(5, 10)) == "fp16"``, ``parse_format("e5m10")``).

Values are always *carried* in float32 (or a wider torch dtype), so every format here must be
a subset of float32: at most 8 exponent bits, 23 mantissa bits, 24 significant bits of fixed point.

One module per family, each registering its grammar with the parse registry
(:mod:`.registry`): floats (:mod:`.floats`: IEEE, ``fn`` and ``fnuz`` styles), fixed point
(:mod:`.fixed`), shared-scale blocks (:mod:`.block`: OCP MX, ``dfx<N>``), dynamic fixed point
(:mod:`.dynamic_fixed`) and binary (:mod:`.binary`). Adding a family is one more module here
plus its import below.
"""

from __future__ import annotations

from typing import Union

# registration order is the order parse_format asks the families and lowprec formats lists them
from .floats import BF16, E4M3FN, E5M2, FP16, FP32, TF32, FloatFormat, Overflow, Style
from .fixed import FixedFormat
from .block import BlockFormat
from .dynamic_fixed import DynamicFixedFormat
from .binary import BinaryFormat
from .registry import (FormatFamily, as_format, describe, families, parse_format,
                       register_format_family)

__all__ = [
    "Style",
    "Overflow",
    "FloatFormat",
    "FixedFormat",
    "BlockFormat",
    "BinaryFormat",
    "DynamicFixedFormat",
    "Format",
    "parse_format",
    "as_format",
    "describe",
    "NAMED_FORMATS",
    "FP32",
    "FP16",
    "BF16",
    "TF32",
    "E4M3FN",
    "E5M2",
    "FormatFamily",
    "register_format_family",
    "families",
]

Format = Union[FloatFormat, FixedFormat, BlockFormat, BinaryFormat, DynamicFixedFormat]

#: The formats with a name of their own, in table order (``lowprec formats`` prints these).
NAMED_FORMATS: dict[str, Format] = {name: fmt for fam in families() for name, fmt in
                                    fam.names.items()}
