"""Where lowprec's warnings point: the first frame of the call stack outside lowprec and torch,
the line of the user's that led there, whichever of lowprec's functions warns and however deep
(``setup()`` called by lowprec's own runner, certify or Hugging Face callback; ``step()`` from
the GradScaler facade; a forward hook run by torch's module call). A fixed ``stacklevel``
named a file of lowprec's whenever lowprec's own code made the call."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn"]

_SKIPPED = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
            os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _user_level(frame) -> int:
    """``warnings.warn``'s stacklevel, called from ``frame`` (level 1), of the first frame
    outside lowprec and torch (the outermost frame where every one is inside)."""
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line (module docstring);
    while torch.compile traces, attributed to the caller (Dynamo cannot trace the frame walk,
    and would warn of that too)."""
    if torch.compiler.is_compiling():
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn(message, category, stacklevel=_user_level(sys._getframe(0)))
