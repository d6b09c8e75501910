"""Datasets (real ones that ship offline; loaders on files written here in the real formats)
and models (one definition, every policy)."""

import gzip
import pickle
import struct
import sys

import numpy as np
import pytest
import torch
from torch import nn

from lowprec import Precision
from lowprec.experiments.data import (DatasetNotFound, load_checked_dataset, load_dataset,
                                      read_idx)
from lowprec.experiments.models import (MODELS, build_checked_model, build_model, channels_last,
                                       layout_of)


def _idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file written by hand from the format's description (yann.lecun.com/exdb/mnist):
    two zero bytes, type 0x08 (unsigned byte), the number of dimensions, big-endian sizes."""
    out = bytearray([0, 0, 0x08, array.ndim])
    for n in array.shape:
        out += struct.pack(">I", n)
    return bytes(out) + array.astype(np.uint8).tobytes()


def _write_mnist_dir(d, n_train=30, n_test=10, gz=False):
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 10,
    }
    for name, arr in files.items():
        data = _idx_bytes(np.asarray(arr))
        if gz:
            with gzip.open(d / (name + ".gz"), "wb") as f:
                f.write(data)
        else:
            (d / name).write_bytes(data)
    return files


@pytest.mark.parametrize("gz", [False, True])
def test_idx_loader_reads_what_the_format_says(tmp_path, gz):
    files = _write_mnist_dir(tmp_path, gz=gz)
    ds = load_dataset(f"idx:{tmp_path}")
    assert ds.x_train.shape == (30, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.y_train.tolist() == files["train-labels-idx1-ubyte"].tolist()
    raw = files["train-images-idx3-ubyte"].astype(np.float64) / 255
    # standardized with the training mean/std: undo and compare
    mean, std = raw.mean(), raw.std(ddof=1)
    np.testing.assert_allclose(ds.x_train.numpy()[:, 0].astype(np.float64) * std + mean, raw,
                               atol=1e-5)
    suffix = ".gz" if gz else ""
    np.testing.assert_array_equal(read_idx(tmp_path / ("t10k-labels-idx1-ubyte" + suffix)),
                                  files["t10k-labels-idx1-ubyte"])


def test_idx_bad_files(tmp_path):
    (tmp_path / "x").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "x")
    with pytest.raises(DatasetNotFound, match="train-images-idx3-ubyte"):
        load_dataset(f"idx:{tmp_path}")


def test_cifar10_loader_reads_python_batches(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(1)
    labels = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        lab = list(rng.integers(0, 10, 4))
        labels[name] = (data, lab)
        with open(d / name, "wb") as f:  # the layout of the python version of CIFAR-10
            pickle.dump({b"batch_label": name.encode(), b"labels": lab, b"data": data,
                         b"filenames": [b"x"] * 4}, f)
    ds = load_dataset(f"cifar10:{tmp_path}")
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert ds.y_test.tolist() == [int(v) for v in labels["test_batch"][1]]
    # per-channel standardization of the training set
    assert torch.allclose(ds.x_train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)
    # first image's first red pixel, back to [0, 255]
    first = labels["data_batch_1"][0].reshape(4, 3, 32, 32)[0, 0, 0, 0]
    all_red = np.concatenate([labels[f"data_batch_{i}"][0].reshape(4, 3, 32, 32)[:, 0]
                              for i in range(1, 6)]).astype(np.float64) / 255
    v = ds.x_train[0, 0, 0, 0].item() * all_red.std(ddof=1) + all_red.mean()
    assert v == pytest.approx(first / 255, abs=1e-5)


def test_missing_datasets_say_how_to_get_them(tmp_path):
    with pytest.raises(DatasetNotFound) as err:
        load_dataset(f"fashion-mnist:{tmp_path / 'nope'}")
    assert "apt-get install dataset-fashion-mnist" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(DatasetNotFound, match="data_batch_1"):
        load_dataset(f"cifar10:{tmp_path}")
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'.*mnist, digits"):
        load_dataset("imagenet")


def test_real_mnist_split_is_fixed_and_stratified():
    ds = load_dataset("mnist")
    assert ds.x_train.shape == (4000, 1, 28, 28) and ds.x_test.shape == (1000, 1, 28, 28)
    assert torch.bincount(ds.y_test).tolist() == [100] * 10
    assert torch.bincount(ds.y_train).tolist() == [400] * 10
    again = load_dataset("mnist")
    assert torch.equal(ds.x_test, again.x_test)
    assert abs(ds.x_train.mean().item()) < 1e-5


def test_digits_and_mnist1d():
    d = load_dataset("digits")
    assert d.input_shape == (1, 8, 8) and len(d.x_train) + len(d.x_test) == 1797
    m = load_dataset("mnist1d")
    assert m.input_shape == (1, 40) and len(m.x_train) == 4000 and len(m.x_test) == 1000


def test_real_fashion_mnist_if_installed():
    from lowprec.experiments.data import FASHION_MNIST_DIR
    from pathlib import Path
    if not Path(FASHION_MNIST_DIR).exists():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    ds = load_dataset("fashion-mnist")
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.y_test).tolist() == [1000] * 10


def test_user_dataset_and_model(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def load():\n"
        "    r = np.random.default_rng(0)\n"
        "    return r.normal(size=(40, 12)), np.arange(40) % 3, r.normal(size=(10, 12)), "
        "np.arange(10) % 3\n"
        "def net(shape, classes):\n"
        "    import torch.nn as nn\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(12, classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ds = load_dataset("mydata:load")
    assert ds.input_shape == (1, 12) and ds.num_classes == 3
    model = build_model("mydata:net", ds.input_shape, ds.num_classes)
    assert model(ds.x_train).shape == (40, 3)
    with pytest.raises(DatasetNotFound, match="no function 'missing'"):
        load_dataset("mydata:missing")
    with pytest.raises(ValueError, match="unknown model 'alexnet'"):
        build_model("alexnet", (1, 28, 28), 10)
    sys.modules.pop("mydata", None)


_GARBAGE_MODULE = """
import sys
import numpy as np
from torch import nn

def _xy(n=40, d=12, classes=3, seed=0):
    r = np.random.default_rng(seed)
    return r.normal(size=(n, d)).astype(np.float32), np.arange(n) % classes

def test_label_99():
    x, y = _xy(); xt, yt = _xy(seed=1); yt[0] = 99; return x, y, xt, yt
def test_label_unseen():
    x, y = _xy(classes=4); y[y == 2] = 3; xt, yt = _xy(classes=4, seed=1); return x, y, xt, yt
def one_d():
    x, y = _xy(); return x[:, 0], y, x[:, 0], y
def exits():
    sys.exit(0)
def net_exits(shape, classes):
    sys.exit(0)
class _Exits(nn.Module):
    def __init__(self, n):
        super().__init__(); self.fc = nn.Linear(12, n)
    def forward(self, x):
        sys.exit(3)
def forward_exits(shape, classes):
    return _Exits(classes)
"""


@pytest.fixture
def garbage_module(tmp_path, monkeypatch):
    (tmp_path / "lp_dm_garbage.py").write_text(_GARBAGE_MODULE)
    (tmp_path / "lp_dm_exit_at_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "lp_dm_garbage:"
    for m in ("lp_dm_garbage", "lp_dm_exit_at_import"):
        sys.modules.pop(m, None)


@pytest.mark.parametrize("fn,match", [
    ("test_label_99", r"test labels range over \[0, 99\]; they must be in \[0, 2\] \(the classes "
                      r"of the training labels\)"),
    ("test_label_unseen", "test labels 2 occur in no training example"),
    ("one_d", r"train features have shape \(40,\)"),
])
def test_test_labels_must_be_training_classes_and_examples_need_features(garbage_module, fn,
                                                                          match):
    """A test label of 99 with training labels 0..2 used to build a 100-class model."""
    with pytest.raises(ValueError, match=match):
        load_checked_dataset(garbage_module + fn)


def test_idx_images_of_one_number_per_example_are_refused(tmp_path):
    files = _write_mnist_dir(tmp_path)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx_bytes(np.arange(30) % 256))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte .* shape \(30,\)"):
        load_checked_dataset(f"idx:{tmp_path}")
    assert len(files) == 4


def test_the_classes_are_those_of_the_training_labels(tmp_path):
    _write_mnist_dir(tmp_path, n_train=30, n_test=5)  # test labels 0..4, train 0..9
    assert load_checked_dataset(f"idx:{tmp_path}").num_classes == 10


@pytest.mark.parametrize("call", ["data", "data-import", "model", "model-import", "forward"])
def test_sys_exit_in_user_code_is_a_one_line_error(garbage_module, call):
    """A --data/--model function (or module, or forward) calling sys.exit(0) used to end the
    command silently with exit code 0."""
    with pytest.raises((ValueError, DatasetNotFound)) as err:
        if call == "data":
            load_checked_dataset(garbage_module + "exits")
        elif call == "data-import":
            load_checked_dataset("lp_dm_exit_at_import:load")
        else:
            data = load_checked_dataset("digits")
            name = {"model": garbage_module + "net_exits", "model-import":
                    "lp_dm_exit_at_import:net", "forward": garbage_module + "forward_exits"}[call]
            build_checked_model(name, data)
    msg = str(err.value)
    assert "SystemExit" in msg and "sys.exit(" in msg and "\n" not in msg


SHAPES = {"mlp": (1, 28, 28), "lenet5": (1, 28, 28), "resnet20": (3, 32, 32), "vgg": (3, 32, 32),
          "cnn1d": (1, 40), "transformer": (1, 28, 28), "mobilenet": (3, 32, 32),
          "chartransformer": (1, 16)}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["32-true", "16-true", "bf16-mixed"])
def test_every_model_trains_under_every_policy_family(name, policy):
    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10)
    prec = Precision(policy)
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x = torch.randn(4, *SHAPES[name])
    y = torch.tensor([0, 1, 2, 3])
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    prec.backward(loss)
    assert prec.step(opt)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_convolutional_model_is_laid_out_channels_last_with_its_inputs():
    """channels_last (what the runner applies to every model): 4-d weights and inputs NHWC, the
    outputs those of the row-major model up to float32 summation order; no change to a model
    without 2-d convolutions."""
    torch.manual_seed(0)
    model = build_model("resnet20", SHAPES["resnet20"], 10)
    ref = build_model("resnet20", SHAPES["resnet20"], 10)
    ref.load_state_dict(model.state_dict())
    assert layout_of(model) == "contiguous"
    assert channels_last(model) and layout_of(model) == "channels_last"
    seen = []
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    first.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(3, *SHAPES["resnet20"])
    model.eval(), ref.eval()
    out = model(x)
    assert seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-5)
    mlp = build_model("mlp", SHAPES["mlp"], 10)
    assert not channels_last(mlp) and layout_of(mlp) == "contiguous"
    assert not mlp._forward_pre_hooks


@pytest.mark.parametrize("policy", ["16-true", "q6.10-sr", "mxfp8_e4m3"])
def test_emulation_keeps_a_channels_last_model_on_its_grids_and_layout(policy):
    """Under emulated policies the rounded activations of a channels-last model stay NHWC
    (rounded in their memory order, not copied to row-major) and on the policy's grid."""
    from lowprec import quantize

    torch.manual_seed(0)
    model = build_model("mobilenet", SHAPES["mobilenet"], 10)
    channels_last(model)
    prec = Precision(policy, seed=0)
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    acts = []
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.BatchNorm2d)):
            m.register_forward_hook(lambda m, a, out: acts.append(out))
    x = torch.randn(4, *SHAPES["mobilenet"])
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), torch.tensor([0, 1, 2, 3]))
    prec.backward(loss)
    assert prec.step(opt)
    fmt = "fp16" if policy == "16-true" else "q6.10" if policy.startswith("q") else None
    assert acts and all(a.is_contiguous(memory_format=torch.channels_last) for a in acts)
    if fmt is not None:
        for a in acts:
            assert torch.equal(quantize(a.detach(), fmt), a.detach())
    assert all(torch.isfinite(p).all() for p in model.parameters())
