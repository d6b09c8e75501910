"""What shell completion offers for a flag's value (argcomplete, where installed): the names of
:mod:`lowprec._names` (the registries' names, kept equal to them by tests/test_completion.py),
a comma-separated list item by item, and paths. The standard library alone: completion must
answer a TAB without importing torch."""

from __future__ import annotations

import argparse

from .. import _names

__all__ = ["listed", "offer", "offer_data", "offer_formats", "offer_models", "policy_items"]


def offer(action: argparse.Action, values) -> None:
    """What shell completion (argcomplete, where installed) offers for a flag's value; the
    value itself is still checked where it is used, with the accepted ones named. ``values``:
    the values, or a function of the word typed so far returning them (argcomplete keeps those
    that start with the word). Completion builds the parser without torch (lowprec_cmd): the
    names come from :mod:`lowprec._names`, never from the library's modules."""
    action.completer = ((lambda prefix="", **_: list(values(prefix))) if callable(values)
                        else (lambda **_: list(values)))


def _last_item(text: str) -> tuple[str, str]:
    """``text`` split before its last item: after the last comma outside <...> (dfx<10>)."""
    depth, cut = 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth <= 0:
            cut = i + 1
    return text[:cut], text[cut:]


def listed(items):
    """A completer of a comma-separated list whose every item ``items(item_typed)`` completes."""
    def complete(prefix: str) -> list[str]:
        head, last = _last_item(prefix)
        return [head + v for v in items(last)]
    return complete


def _paths(typed: str) -> list[str]:
    """The files and folders whose path starts with ``typed`` (folders end in /)."""
    import os

    cut = typed.rfind("/") + 1
    folder, start = typed[:cut], typed[cut:]
    try:
        names = sorted(n for n in os.listdir(folder or ".") if n.startswith(start))
    except OSError:
        return []
    return [folder + n + ("/" if os.path.isdir(folder + n) else "") for n in names]


def policy_items(typed: str) -> list[str]:
    """One item of --policies (or --policy): a named policy, plan:FILE, or a spec key (p=...)
    and after a format key the named formats."""
    n = _names
    key, eq, _ = typed.partition("=")
    if eq:
        return ([f"{key}={f}" for f in n.FORMAT_NAMES]
                if key.strip().lower() in n.POLICY_FORMAT_KEYS else [])
    if typed.startswith(n.PLAN_PREFIX):
        return [n.PLAN_PREFIX + f for f in _paths(typed[len(n.PLAN_PREFIX):])]
    return [*n.POLICY_NAMES, n.PLAN_PREFIX, *(k + "=" for k in n.POLICY_KEYS)]


def _data_items(typed: str) -> list[str]:
    """--data: a dataset's name, or KIND: and then a path."""
    n = _names
    kind, colon, rest = typed.partition(":")
    if colon:
        return [f"{kind}:{f}" for f in _paths(rest)] if kind in n.DATASET_KINDS else []
    return [*n.DATASET_NAMES, *(k + ":" for k in n.DATASET_KINDS)]


def offer_data(action: argparse.Action) -> None:
    offer(action, _data_items)


def offer_models(action: argparse.Action, *, several: bool) -> None:
    names = _names.MODEL_NAMES
    offer(action, listed(lambda _: names) if several else names)


def offer_formats(action: argparse.Action) -> None:
    offer(action, _names.FORMAT_NAMES)
