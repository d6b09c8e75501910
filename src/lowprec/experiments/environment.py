"""The environment record of a run: library versions, git revision and hardware (the facts
``backend=auto`` decides by included), stored with every run in results.db."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .. import __version__
from ..training.hardware import device_facts

__all__ = ["environment"]


def environment() -> dict:
    """Library versions, git revision and hardware, recorded with every run."""
    import numpy

    from ..numerics import kernel as _kernel

    versions = {"lowprec": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
                "python": sys.version.split()[0]}
    git = None
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            git = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    hw = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
          "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
          "kernel": _kernel.available(), "platform": platform.platform(),
          "cpu": device_facts("cpu").to_json()}  # what backend=auto decides by
    if torch.cuda.is_available():
        hw["cuda"] = torch.cuda.get_device_name(0)
    return {"versions": versions, "git": git, "hardware": hw}
