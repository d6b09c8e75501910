"""The parse registry: each format family registers its classes, its grammar (a parser of the
lower-cased spec), its names and the text the error message lists; :func:`parse_format` asks the
families in registration order. Adding a family is one module that calls
:func:`register_format_family` (imported by the package, see ``formats/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .base import is_decimal

__all__ = ["FormatFamily", "register_format_family", "families", "format_types", "parse_format",
           "as_format", "describe", "bad_format", "decimal"]


@dataclass(frozen=True)
class FormatFamily:
    """One family of formats.

    ``parse(s, spec)`` reads the lower-cased, stripped ``s`` (``spec`` as given, for messages)
    and returns a format, or None when ``s`` is not of this family's grammar. ``names``: formats
    with a name of their own, in the order ``lowprec formats`` prints them; ``aliases``: other
    names. ``accepted``: the grammar, as the error message of an unknown spec lists it.
    ``special``: the specials column of :func:`describe`.
    """

    name: str
    types: tuple[type, ...]
    parse: Callable[[str, str], object]
    accepted: str
    names: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)
    special: Callable[[object], str] | None = None


_FAMILIES: dict[str, FormatFamily] = {}
# derived from _FAMILIES at each registration: parse_format runs on hot paths
_TYPES: list[tuple[type, ...]] = [()]
_ALIASES: dict = {}


def register_format_family(family: FormatFamily) -> FormatFamily:
    """Add (or replace, by name) a family; :func:`parse_format` tries it after those before."""
    if not isinstance(family, FormatFamily):
        raise TypeError(f"register_format_family takes a FormatFamily, got {family!r}")
    _FAMILIES[family.name] = family
    _TYPES[0] = tuple(t for f in _FAMILIES.values() for t in f.types)
    _ALIASES.clear()
    for f in _FAMILIES.values():
        _ALIASES.update(f.names)
    for f in _FAMILIES.values():
        _ALIASES.update(f.aliases)
    return family


def families() -> tuple[FormatFamily, ...]:
    """The registered families, in registration order."""
    return tuple(_FAMILIES.values())


def format_types() -> tuple[type, ...]:
    """The classes of every registered family (what parse_format passes through)."""
    return _TYPES[0]


def bad_format(spec: object, why: str = "") -> ValueError:
    """The ValueError of a spec no family reads, listing every family's grammar."""
    reason = f" ({why})" if why else ""
    accepted = "; ".join(f.accepted for f in _FAMILIES.values())
    return ValueError(f"unknown number format {spec!r}{reason}; accepted: {accepted}")


def decimal(val: str, spec: str, integer: bool = False) -> str:
    """``val`` if it is a plain ASCII decimal, else :func:`bad_format`'s error."""
    if not is_decimal(val, integer):
        raise bad_format(spec, f"{val!r} is not {'an integer' if integer else 'a number'}")
    return val


def parse_format(spec):
    """Read a format from its short string (case-insensitive); formats pass through.

    >>> parse_format("e5m10") == parse_format("half")
    True
    >>> str(parse_format("fixed<16,14>"))
    'q2.14'
    """
    if isinstance(spec, _TYPES[0]):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a format spec must be a str or a format object, got {spec!r}")
    s = spec.strip().lower()
    if any(ch.isspace() for ch in s):
        raise bad_format(spec, "no spaces inside a format spec")
    if s in _ALIASES:
        return _ALIASES[s]
    try:
        for family in _FAMILIES.values():
            fmt = family.parse(s, spec)
            if fmt is not None:
                return fmt
    except (TypeError, ValueError) as err:
        if str(err).startswith("unknown number format") or str(err).startswith("number format"):
            raise
        raise ValueError(f"number format {spec!r}: {err}") from None
    raise bad_format(spec)


def as_format(spec):
    """Alias of :func:`parse_format`, for call sites that accept either form."""
    return parse_format(spec)


def describe(fmt) -> dict:
    """One row of the formats table: bits and limits, as numbers (``lowprec formats`` prints it)."""
    kind = type(fmt).__name__.replace("Format", "").lower()
    row = {"format": str(fmt), "kind": kind, "bits": fmt.bits, "max": fmt.max,
           "min_normal": fmt.min_normal, "min_subnormal": fmt.min_subnormal, "eps": fmt.eps}
    family = next((f for f in _FAMILIES.values() if isinstance(fmt, f.types)), None)
    row["special"] = family.special(fmt) if family is not None and family.special else "±1"
    return row
