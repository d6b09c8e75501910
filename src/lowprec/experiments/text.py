"""Character-level text as a classification task: predict the next character of a window.

``text`` reads the licence texts every Debian system ships in ``/usr/share/common-licenses``
(package base-files: the GPL, LGPL, GFDL, Apache, MPL, Artistic, BSD and CC0 texts, about
230,000 characters of English prose once symlinked duplicates are dropped); ``text:PATH`` reads
a UTF-8 file, or the files of a directory, of your own. Nothing is downloaded.

Each file is split in two at 90% of its length: windows of ``WINDOW`` characters from the first
parts are the training examples, from the last parts the test examples (no test character is
ever a training input, and a test window whose characters and label occur word for word in the
training text, as the licences repeat one another, is left out). The label of a window is the character that follows it. Characters are
ids in order of frequency in the training text; those seen fewer than ``MIN_COUNT`` times, and
any character the training labels lack, share one id (``UNKNOWN``, 0); a test window whose next
character is no training label is dropped. ``x`` holds the ids as
float32 (the harness's feature dtype; exact in fp32, fp16 and bf16 up to 256 classes), shape
(examples, 1, WINDOW); :class:`lowprec.experiments.models.CharTransformer` embeds them.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch

__all__ = ["LICENSES_DIR", "WINDOW", "read_corpus", "text_arrays"]

LICENSES_DIR = "/usr/share/common-licenses"
WINDOW = 16
MIN_COUNT = 20
UNKNOWN = 0
MAX_TRAIN, MAX_TEST = 16_000, 4_000  # examples, taken at an even stride over the text
TRAIN_FRACTION = 0.9


def read_corpus(path: str | os.PathLike) -> list[str]:
    """The texts of a file, or of a directory's regular files (sorted by name, each read once
    however many symlinks point at it), whitespace runs folded to one space. Read as UTF-8;
    bytes that are not become U+FFFD (one rare character, mapped to UNKNOWN)."""
    p = Path(path)
    if p.is_dir():
        seen, files = set(), []
        for f in sorted(p.iterdir()):
            real = f.resolve()
            if real.is_file() and real not in seen:
                seen.add(real)
                files.append(real)
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"text corpus {path}: no such file or directory" + (
            " (Debian's base-files package ships it)" if str(path) == LICENSES_DIR else ""))
    texts = [" ".join(f.read_text(encoding="utf-8", errors="replace").split()) for f in files]
    texts = [t for t in texts if len(t) > WINDOW + 10]
    if not texts:
        raise ValueError(f"text corpus {path}: no file with more than {WINDOW + 10} characters")
    return texts


def _windows(texts: list[str], ids: dict, limit: int,
             exclude: set | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Windows and labels at an even stride, at most ``limit``; those whose characters (window
    and label) are in ``exclude`` left out."""
    coded = [np.array([ids.get(c, UNKNOWN) for c in t], dtype=np.int64) for t in texts]
    starts = [(i, s) for i, c in enumerate(coded) for s in range(len(c) - WINDOW)
              if exclude is None or texts[i][s:s + WINDOW + 1] not in exclude]
    if not starts:
        return np.zeros((0, WINDOW), dtype=np.int64), np.zeros(0, dtype=np.int64)
    stride = max(1, len(starts) // limit)
    picked = starts[::stride][:limit]
    x = np.stack([coded[i][s:s + WINDOW] for i, s in picked])
    y = np.array([coded[i][s + WINDOW] for i, s in picked], dtype=np.int64)
    return x, y


def text_arrays(path: str | os.PathLike | None = None):
    """The next-character task of the corpus at ``path`` (the licences by default): (name,
    x_train, y_train, x_test, y_test, classes), x float32 (N, 1, WINDOW), y int64."""
    path = LICENSES_DIR if path is None else path
    texts = read_corpus(path)
    cut = [int(len(t) * TRAIN_FRACTION) for t in texts]
    train = [t[:c] for t, c in zip(texts, cut) if c > WINDOW]
    test = [t[c:] for t, c in zip(texts, cut) if len(t) - c > WINDOW]
    if not train or not test:
        need = int((WINDOW + 1) / (1 - TRAIN_FRACTION)) + 1
        raise ValueError(f"text corpus {path}: too short for one training and one test window "
                         f"of {WINDOW} characters; a text needs at least {need} characters")
    # texts repeat one another (the GPL family, LGPL 2 and 2.1, GFDL 1.2 and 1.3): a test
    # window whose characters and label occur word for word in the training text is no test
    seen = {t[s:s + WINDOW + 1] for t in train for s in range(len(t) - WINDOW)}
    counts = Counter("".join(train))
    common = [c for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
              if n >= MIN_COUNT]
    ids = {c: i + 1 for i, c in enumerate(common)}
    xtr, ytr = _windows(train, ids, MAX_TRAIN)
    xte, yte = _windows(test, ids, MAX_TEST, exclude=seen)
    # classes are UNKNOWN and the labels the training windows have, renumbered densely; an
    # input character outside them becomes UNKNOWN, a test window whose label is none of them
    # is dropped (no training example could teach it)
    classes = np.unique(np.concatenate([ytr, [UNKNOWN]]))
    keep = np.isin(yte, ytr)
    xte, yte = xte[keep], yte[keep]
    if not len(yte):
        raise ValueError(f"text corpus {path}: no test window that the training text does "
                         "not hold word for word, with a next character among its labels")
    dense = np.full(len(ids) + 1, UNKNOWN, dtype=np.int64)
    dense[classes] = np.arange(len(classes))
    xtr, ytr, xte, yte = (dense[a] for a in (xtr, ytr, xte, yte))
    name = "text" if str(path) == LICENSES_DIR else f"text:{path}"
    as_x = lambda a: torch.from_numpy(a.astype(np.float32)).unsqueeze(1)  # noqa: E731
    return (name, as_x(xtr), torch.from_numpy(ytr), as_x(xte), torch.from_numpy(yte),
            int(len(classes)))
