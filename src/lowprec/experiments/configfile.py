"""``--config run.toml``: any flag of a command, in a TOML file (read with the standard
library's ``tomllib``), turned into the command-line tokens it stands for; the flags given on
the command line come after them and win.

A key is a flag's name without the dashes, with ``-`` or ``_`` (``batch-size`` or
``batch_size``); its value is a string, number or boolean (``true`` gives the switch, ``false``
leaves it off), or a list: joined with commas for ``policies`` and ``model``, else the flag
repeated (``quantize -f``). Keys may also sit in a table named after the command
(``[compare]``), which wins over the top level, so that one file serves several commands::

    epochs = 5
    policies = ["32-true", "bf16-true"]
    [compare]
    seeds = 3

A key that is no flag of the command, or a value of another type, is a ValueError naming the
key, the file and the accepted names.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["read_config_file", "config_tokens", "JOINED"]

#: flags whose list value is one comma-separated argument
JOINED = ("policies", "model")


def read_config_file(path: str | Path) -> tuple[dict, str]:
    """(parsed table, text) of a TOML file; ValueError with the path and the parser's reason."""
    import tomllib

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise ValueError(f"--config {str(path)[:200]}: cannot read it ({why})") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {str(path)[:200]} is not valid TOML: {err}") from None


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{name: action} of every optional flag of ``parser`` (``batch_size`` and ``batch-size``),
    --config and --help excepted."""
    out = {}
    for action in parser._actions:  # argparse has no public list of a parser's actions
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in ("help", "config", "version"):
            continue
        name = longs[0][2:]
        out[name] = action
        out[name.replace("-", "_")] = action
    return out


def config_tokens(table: dict, parser: argparse.ArgumentParser, command: str, path: str,
                  commands=()) -> list[str]:
    """The command-line tokens ``table`` (a parsed TOML file) stands for, for ``parser``, the
    sub-parser of ``command``; tables named after the other ``commands`` are left to them."""
    options = _options(parser)
    values = {k: v for k, v in table.items() if not isinstance(v, dict)}
    for key, v in table.items():
        if isinstance(v, dict) and key not in commands:
            raise ValueError(f"--config {path}: table [{key}] is not a command of lowprec "
                             f"(accepted: {', '.join(commands)})")
    values.update(table.get(command) or {})
    tokens: list[str] = []
    accepted = sorted({a.option_strings[-1].lstrip("-").replace("-", "_")
                       for a in options.values()})
    for key, value in values.items():
        action = options.get(key)
        if action is None:
            raise ValueError(f"--config {path}: {key!r} is not a flag of lowprec {command}; "
                             f"accepted: {', '.join(accepted)}")
        flag = [s for s in action.option_strings if s.startswith("--")][0]
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch:
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} = {value!r} must be true or false")
            if value:
                tokens.append(flag)
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float, list)):
            raise ValueError(f"--config {path}: {key} = {str(value)[:60]!r} must be a string, "
                             "a number or a list")
        if isinstance(value, list):
            if not value or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool)
                                    for x in value):
                raise ValueError(f"--config {path}: {key} = {str(value)[:60]} must be a "
                                 "non-empty list of strings or numbers")
            if action.dest in JOINED:
                tokens += [flag, ",".join(str(x) for x in value)]
            elif isinstance(action, argparse._AppendAction):
                for x in value:
                    tokens += [flag, str(x)]
            else:
                raise ValueError(f"--config {path}: {key} takes one value, not a list")
            continue
        tokens += [flag, str(value)]
    return tokens
