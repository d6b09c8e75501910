"""A comparison's configuration assembled from what a command line gives: a preset's settings,
or on ``--resume`` the stored comparison's, then every setting given explicitly. Policies are
parsed here, once (:class:`CompareConfig` holds the parsed objects)."""

from __future__ import annotations

import json
from pathlib import Path

from .config import PRESETS, CompareConfig, split_policies
from .results import CorruptDatabase, read_stored_config
from .runfolder import MODELS_FILE

__all__ = ["assemble_config", "SETTINGS"]

#: the settings a flag may give (None: not given)
SETTINGS = ("data", "model", "epochs", "batch_size", "lr", "optimizer", "momentum",
            "weight_decay", "train_subset", "schedule", "threads", "compile")


def _short(text: str, limit: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= limit else f"{s[:limit // 2]}...{s[-limit // 2:]} ({len(text)} chars)"


def _stored_config(out: Path) -> dict | None:
    """The configuration stored in the run folder ``out``; for a comparison over several
    models (``models.json``), its first stored model's, with the stored list of models."""
    try:
        if (out / "results.db").exists():
            return read_stored_config(out / "results.db")
        listing = out / MODELS_FILE
        if not listing.is_file():
            return None
        try:
            models = [str(m) for m in json.loads(listing.read_text())["models"]]
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{listing} is damaged ({type(err).__name__}: {err}); the file "
                             "was left untouched") from None
        for m in models:
            stored = read_stored_config(out / m / "results.db") \
                if (out / m / "results.db").exists() else None
            if stored is not None:
                return {**stored, "model": ",".join(models)}
        return None
    except CorruptDatabase as err:
        raise ValueError(str(err)) from None
    except OSError as err:
        raise ValueError(f"cannot read the run folder {out}: {err.strerror or err}") from None


def assemble_config(*, out: str, resume: bool = False, quiet: bool = False,
                    preset: str | None = None, policies: str | None = None,
                    seeds: int | None = None, overrides: dict | None = None,
                    **settings) -> CompareConfig:
    """CompareConfig from flags: the preset's settings (``default`` when none), or with
    ``resume`` and a stored comparison in ``out`` its stored values (a preset given is applied
    over them), then each of :data:`SETTINGS` given (not None), ``policies`` (comma-separated),
    ``seeds`` (a count) and finally ``overrides`` (field -> value). ValueError for an unknown
    preset, an unknown setting or a damaged database."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"setting {unknown[0]!r} is not one of {', '.join(SETTINGS)}")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset={_short(preset)}; accepted: {', '.join(PRESETS)}")
    stored = _stored_config(Path(out)) if resume and out.strip() else None
    if stored is not None:
        # --resume continues the stored comparison: flags not given take the stored values,
        # flags given must agree with them (the runner refuses a difference)
        values = {k: stored[k] for k in SETTINGS if k in stored}
        values["policies"] = tuple(stored.get("policies") or ())
        values["seeds"] = tuple(stored.get("seeds") or ())
        if preset is not None:
            values.update(PRESETS[preset])
    else:
        values = dict(PRESETS[preset or "default"])
    for key in SETTINGS:
        v = settings.get(key)
        if v is not None:
            values[key] = v
    if policies is not None:
        values["policies"] = tuple(split_policies(policies))
    if seeds is not None:
        values["seeds"] = tuple(range(seeds))
    values.update(overrides or {})
    return CompareConfig(out=out, resume=resume, quiet=quiet, **values)
