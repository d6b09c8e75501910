"""Every user mistake: one line on stderr, no traceback, the documented exit code, nothing stored
changed. One table drives all seven commands, run in-process through ``lowprec.cli.main``.

Cases that need files get them from small builders: user modules (``--data``/``--model``
functions that misbehave), damaged dataset files, run folders with a damaged database or a
stored configuration that a ``--resume`` contradicts. Where a results database exists, its
bytes are compared before and after the command.
"""

import gzip
import hashlib
import pickle
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from lowprec.cli import main
from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments.runfolder import FolderLock

USER_MODULE = '''
import numpy as np
import torch
from torch import nn

def _xy(n=40, d=12, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, classes, n)

def good():
    x, y = _xy(); xt, yt = _xy(seed=1); return x, y, xt, yt
def raises():
    raise RuntimeError("cannot reach the data server")
def strings():
    return "a", "b", "c", "d"
def three():
    return 1, 2, 3
def float_labels():
    x, y = _xy(); return x, y + 0.5, x, y.astype(np.float32)
def negative_labels():
    x, y = _xy(); y[3] = -1; return x, y, x, y
def label_count():
    x, y = _xy(); return x, y[:-5], x, y
def test_size():
    x, y = _xy(); xt, yt = _xy(d=7); return x, y, xt, yt
def nan_data():
    x, y = _xy(); x[2, 3] = np.nan; return x, y, x, y
def inf_data():
    x, y = _xy(); xt = x.copy(); xt[0, 0] = np.inf; return x, y, xt, y
def one_class():
    x, y = _xy(); return x, 0 * y, x, 0 * y

def wrong_signature():
    return nn.Linear(12, 3)
def three_outputs(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 3 if num_classes != 3 else 5))
def no_params(input_shape, num_classes):
    return nn.Flatten()
def not_a_module(input_shape, num_classes):
    return "a model"
def raises_model(input_shape, num_classes):
    raise ValueError("no GPU")
def bad_forward(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(99, num_classes))
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    mod = root / "mods"
    mod.mkdir()
    (mod / "lp_user_fns.py").write_text(textwrap.dedent(USER_MODULE))
    (mod / "lp_user_broken.py").write_text("import numpy\nraise SystemError('broken at import')\n")
    sys.path.insert(0, str(mod))
    _garbage_files(root, mod)  # the hostile tester's cases (block below CASES)
    # damaged dataset files
    idx = root / "idx_trunc"
    idx.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (idx / stem).write_bytes(b"\x00\x00\x08\x03\x00\x00")  # header cut after 2 bytes
    gz = root / "idx_gz"
    gz.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (gz / (stem + ".gz")).write_bytes(b"not gzip at all" * 10)
    gzcut = root / "idx_gzcut"
    gzcut.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (gzcut / (stem + ".gz")).write_bytes(gzip.compress(b"\x00\x00\x08\x03" + b"\x00" * 400)[:30])
    magic = root / "idx_magic"
    magic.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (magic / stem).write_bytes(b"GIF89a" + b"\x00" * 100)
    for name, content in (("cifar_garbage", b"\x80\x04garbage"),
                          ("cifar_trunc", pickle.dumps({b"data": [1] * 100,
                                                        b"labels": [0] * 10})[:40]),
                          ("cifar_keys", pickle.dumps({b"pixels": 1})),
                          ("cifar_shape", pickle.dumps({b"data": [1, 2, 3], b"labels": [0]}))):
        d = root / name
        d.mkdir()
        for b in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            (d / b).write_bytes(content)
    # a real run folder (1 epoch, 64 digits) for --resume and report cases
    good = root / "good"
    run_compare(CompareConfig(data="digits", model="mlp", policies=("32-true",), seeds=(0,),
                              epochs=1, batch_size=32, train_subset=64, out=str(good),
                              quiet=True))
    (root / "afile").write_text("x")
    (root / "shape_plan.json").write_text('{"policy": 5, "overrides": "x"}')
    for name, text in (("key.toml", "epoch = 3\n"), ("value.toml", "epochs = 0\n"),
                       ("table.toml", "[frobnicate]\nepochs = 1\n"),
                       ("switch.toml", 'quiet = "yes"\n'), ("list.toml", "lr = [0.1, 0.2]\n"),
                       ("date.toml", "epochs = 1979-05-27\n"),
                       ("positional.toml", 'run_dir = "somewhere"\n')):
        (root / name).write_text(text)
    yield root
    sys.path.remove(str(mod))


def _folder(files, tmp_path, damage=None) -> Path:
    """A copy of the good run folder, optionally damaged with SQL."""
    import sqlite3

    out = tmp_path / "run"
    shutil.copytree(files / "good", out)
    if damage:
        c = sqlite3.connect(out / "results.db")
        c.executescript(damage)
        c.commit()
        c.close()
    return out


U = "lp_user_fns:"
TINY = ["--epochs", "1", "--quiet"]
# (id, argv with {F} = fixtures root and {R} = a run folder copy, exit code, needs run folder,
#  damage SQL)
CASES = [
    # formats
    ("fmt-e9", ["formats", "e9m3"], 2),
    ("fmt-e0", ["formats", "e0m3"], 2),
    ("fmt-m99", ["formats", "e5m99"], 2),
    ("fmt-q", ["formats", "q"], 2),
    ("fmt-fixed-wide", ["formats", "fixed<30,9>"], 2),
    ("fmt-block-binary", ["formats", "block<binary,32>"], 2),
    ("fmt-long", ["formats", "x" * 100_000], 2),
    ("fmt-modifier", ["formats", "e5m10-foo"], 2),
    ("fmt-int0", ["formats", "int<0>"], 2),
    ("fmt-dfxp-opt", ["formats", "dfxp<10,foo=1>"], 2),
    ("fmt-unicode", ["formats", "ü"], 2),
    ("fmt-fn-inf", ["formats", "e4m3fn-ovinf"], 2),
    # quantize
    ("q-underscore", ["quantize", "1_000", "-f", "fp16"], 2),
    ("q-arabic-digits", ["quantize", "\u0661\u0662", "-f", "fp16"], 2),
    ("q-fullwidth", ["quantize", "\uff11", "-f", "fp16"], 2),
    ("q-word", ["quantize", "abc", "-f", "fp16"], 2),
    ("q-dfxp", ["quantize", "1", "-f", "dfxp<10>"], 2),
    ("q-format", ["quantize", "1", "-f", "nope"], 2),
    ("q-rounding", ["quantize", "1", "-f", "fp16", "-r", "sideways"], 2),
    ("q-seed-neg", ["quantize", "1", "-f", "fp16", "--seed", "-1"], 2),
    ("q-seed-huge", ["quantize", "1", "-f", "fp16", "--seed", "99999999999999999999999"], 2),
    ("q-sr0", ["quantize", "1", "-f", "fp16", "-r", "sr0"], 2),
    ("q-no-format", ["quantize", "1"], 2),
    ("q-hex", ["quantize", "0x10", "-f", "fp16"], 2),
    ("q-empty", ["quantize", "", "-f", "fp16"], 2),
    ("q-exp", ["quantize", "1e", "-f", "fp16"], 2),
    ("q-seed-underscore", ["quantize", "1", "-f", "fp16", "--seed", "1_0"], 2),
    ("q-no-values", ["quantize", "-f", "fp16"], 2),
    # compare: policies and loss scales
    ("c-ls-init-neg", ["compare", "--policies", "p=fp16,ls=dynamic:init=-5"], 2),
    ("c-ls-init-nan", ["compare", "--policies", "p=fp16,ls=dynamic:init=nan"], 2),
    ("c-ls-static-inf", ["compare", "--policies", "p=fp16,ls=static:inf"], 2),
    ("c-ls-static-nan", ["compare", "--policies", "p=fp16,ls=static:nan"], 2),
    ("c-ls-growth", ["compare", "--policies", "p=fp16,ls=dynamic:growth=0.5"], 2),
    ("c-ls-backoff", ["compare", "--policies", "p=fp16,ls=dynamic:init=8;backoff=2"], 2),
    ("c-ls-interval", ["compare", "--policies", "p=fp16,ls=dynamic:interval=0"], 2),
    ("c-ls-option", ["compare", "--policies", "p=fp16,ls=dynamic:foo=1"], 2),
    ("c-native-fp8", ["compare", "--policies", "p=e4m3fn,b=native"], 2),
    ("c-policy-name", ["compare", "--policies", "nope"], 2),
    ("c-policy-long", ["compare", "--policies", "p=" + "e" * 100_000], 2),
    ("c-policy-empty", ["compare", "--policies", ""], 2),
    ("c-policy-twice", ["compare", "--policies", "32-true,32-true"], 2),
    # compare: numbers
    ("c-seeds-0", ["compare", "--seeds", "0"], 2),
    ("c-seeds-huge", ["compare", "--seeds", "100000000000000"], 2),
    ("c-seeds-underscore", ["compare", "--seeds", "1_0"], 2),
    ("c-epochs-0", ["compare", "--epochs", "0"], 2),
    ("c-epochs-neg", ["compare", "--epochs", "-1"], 2),
    ("c-batch-0", ["compare", "--batch-size", "0"], 2),
    ("c-batch-neg", ["compare", "--batch-size", "-5"], 2),
    ("c-lr-nan", ["compare", "--lr", "nan"], 2),
    ("c-lr-inf", ["compare", "--lr", "inf"], 2),
    ("c-lr-neg", ["compare", "--lr", "-1"], 2),
    ("c-lr-0", ["compare", "--lr", "0"], 2),
    ("c-wd-inf", ["compare", "--weight-decay", "inf"], 2),
    ("c-wd-neg", ["compare", "--weight-decay", "-1"], 2),
    ("c-momentum-nan", ["compare", "--momentum", "nan"], 2),
    ("c-momentum-1", ["compare", "--momentum", "1", "--out", "{T}/m"], 2),
    ("c-optimizer", ["compare", "--optimizer", "rmsprop", "--out", "{T}/o"], 2),
    ("c-schedule", ["compare", "--schedule", "linear", "--out", "{T}/s"], 2),
    ("c-preset", ["compare", "--preset", "nope"], 2),
    ("c-subset-0", ["compare", "--train-subset", "0"], 2),
    ("c-out-empty", ["compare", "--out", ""], 2),
    ("c-out-long", ["compare", "--out", "{T}/" + "a" * 5000], 2),
    ("c-out-file", ["compare", "--out", "{F}/afile", *TINY], 2),
    # compare: data
    ("c-data-name", ["compare", "--data", "nope", "--out", "{T}/d"], 2),
    ("c-data-idx-missing", ["compare", "--data", "idx:/nonexistent", "--out", "{T}/d"], 2),
    ("c-data-cifar-missing", ["compare", "--data", "cifar10:/nonexistent", "--out", "{T}/d"], 2),
    ("c-data-idx-trunc", ["compare", "--data", "idx:{F}/idx_trunc", "--out", "{T}/d"], 2),
    ("c-data-idx-gz", ["compare", "--data", "idx:{F}/idx_gz", "--out", "{T}/d"], 2),
    ("c-data-idx-gzcut", ["compare", "--data", "idx:{F}/idx_gzcut", "--out", "{T}/d"], 2),
    ("c-data-idx-magic", ["compare", "--data", "idx:{F}/idx_magic", "--out", "{T}/d"], 2),
    ("c-data-cifar-garbage", ["compare", "--data", "cifar10:{F}/cifar_garbage", "--out",
                              "{T}/d"], 2),
    ("c-data-cifar-trunc", ["compare", "--data", "cifar10:{F}/cifar_trunc", "--out", "{T}/d"], 2),
    ("c-data-cifar-keys", ["compare", "--data", "cifar10:{F}/cifar_keys", "--out", "{T}/d"], 2),
    ("c-data-cifar-shape", ["compare", "--data", "cifar10:{F}/cifar_shape", "--out", "{T}/d"], 2),
    ("c-data-raises", ["compare", "--data", U + "raises", "--out", "{T}/d"], 2),
    ("c-data-strings", ["compare", "--data", U + "strings", "--out", "{T}/d"], 2),
    ("c-data-three", ["compare", "--data", U + "three", "--out", "{T}/d"], 2),
    ("c-data-float-labels", ["compare", "--data", U + "float_labels", "--out", "{T}/d"], 2),
    ("c-data-neg-labels", ["compare", "--data", U + "negative_labels", "--out", "{T}/d"], 2),
    ("c-data-label-count", ["compare", "--data", U + "label_count", "--out", "{T}/d"], 2),
    ("c-data-test-size", ["compare", "--data", U + "test_size", "--out", "{T}/d"], 2),
    ("c-data-nan", ["compare", "--data", U + "nan_data", "--out", "{T}/d"], 2),
    ("c-data-inf", ["compare", "--data", U + "inf_data", "--out", "{T}/d"], 2),
    ("c-data-one-class", ["compare", "--data", U + "one_class", "--out", "{T}/d"], 2),
    ("c-data-no-module", ["compare", "--data", "lp_no_such_module:f", "--out", "{T}/d"], 2),
    ("c-data-broken-module", ["compare", "--data", "lp_user_broken:f", "--out", "{T}/d"], 2),
    ("c-data-no-function", ["compare", "--data", U + "nothing", "--out", "{T}/d"], 2),
    # compare: models
    ("c-model-name", ["compare", "--data", U + "good", "--model", "nope", "--out", "{T}/d"], 2),
    ("c-model-signature", ["compare", "--data", U + "good", "--model", U + "wrong_signature",
                           "--out", "{T}/d"], 2),
    ("c-model-outputs", ["compare", "--data", U + "good", "--model", U + "three_outputs",
                         "--out", "{T}/d"], 2),
    ("c-model-no-params", ["compare", "--data", U + "good", "--model", U + "no_params",
                           "--out", "{T}/d"], 2),
    ("c-model-not-module", ["compare", "--data", U + "good", "--model", U + "not_a_module",
                            "--out", "{T}/d"], 2),
    ("c-model-raises", ["compare", "--data", U + "good", "--model", U + "raises_model",
                        "--out", "{T}/d"], 2),
    ("c-model-forward", ["compare", "--data", U + "good", "--model", U + "bad_forward",
                         "--out", "{T}/d"], 2),
    ("c-model-cnn1d-2d", ["compare", "--data", "digits", "--model", "cnn1d", "--out",
                          "{T}/d"], 2),
    # compare: run folders
    ("c-exists", ["compare", "--out", "{R}", *TINY], 2, "folder"),
    ("c-resume-epochs", ["compare", "--out", "{R}", "--resume", "--epochs", "5", "--quiet"], 2,
     "folder"),
    ("c-resume-lr", ["compare", "--out", "{R}", "--resume", "--lr", "0.3", "--quiet"], 2,
     "folder"),
    ("c-resume-adam", ["compare", "--out", "{R}", "--resume", "--optimizer", "adam", "--quiet"],
     2, "folder"),
    ("c-resume-model", ["compare", "--out", "{R}", "--resume", "--model", "lenet5", "--quiet"],
     2, "folder"),
    ("c-resume-bad-json", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "folder",
     "UPDATE meta SET value = '{not json' WHERE key = 'config';"),
    ("c-resume-dropped", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "folder",
     "DROP TABLE epochs;"),
    ("c-resume-locked", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "locked"),
    ("c-locked", ["compare", "--out", "{R}", *TINY], 2, "locked"),
    # run folders and databases that --resume and report must refuse (not extend or trust)
    ("c-resume-policies", ["compare", "--out", "{R}", "--resume", "--policies",
                           "32-true,16-true", "--quiet"], 2, "folder"),
    ("c-resume-seeds", ["compare", "--out", "{R}", "--resume", "--seeds", "2", "--quiet"], 2,
     "folder"),
    ("c-resume-preset", ["compare", "--out", "{R}", "--resume", "--preset", "gupta", "--quiet"],
     2, "folder"),
    ("c-resume-schema-99", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "folder",
     "UPDATE meta SET value = '99' WHERE key = 'schema_version';"),
    ("c-resume-metric-text", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "folder",
     "UPDATE epochs SET test_loss = 'low';"),
    ("c-resume-config-list", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "folder",
     "UPDATE meta SET value = '[1, 2]' WHERE key = 'config';"),
    ("c-resume-user-file", ["compare", "--out", "{R}", "--resume", "--quiet"], 2, "userfile"),
    ("c-user-folder", ["compare", "--out", "{R}", *TINY], 2, "userfile"),
    ("c-out-foreign", ["compare", "--out", "{F}", *TINY], 2),
    ("c-out-root", ["compare", "--out", "/", *TINY], 2),
    ("t-resume-other-policy", ["train", "--out", "{R}", "--resume", "--policy", "16-true",
                               "--quiet"], 2, "folder"),
    ("t-resume-other-seed", ["train", "--out", "{R}", "--resume", "--seed", "1", "--quiet"], 2,
     "folder"),
    ("t-out-foreign", ["train", "--out", "{F}", *TINY], 2),
    ("r-schema-99", ["report", "{R}"], 2, "folder",
     "UPDATE meta SET value = '99' WHERE key = 'schema_version';"),
    ("r-schema-abc", ["report", "{R}"], 2, "folder",
     "UPDATE meta SET value = 'abc' WHERE key = 'schema_version';"),
    ("r-schema-missing", ["report", "{R}"], 2, "folder",
     "DELETE FROM meta WHERE key = 'schema_version';"),
    ("r-config-json", ["report", "{R}"], 2, "folder",
     "UPDATE meta SET value = '{not json' WHERE key = 'config';"),
    ("r-config-list", ["report", "{R}"], 2, "folder",
     "UPDATE meta SET value = '[1, 2]' WHERE key = 'config';"),
    ("r-config-types", ["report", "{R}"], 2, "folder",
     "UPDATE meta SET value = '{\"epochs\": \"many\"}' WHERE key = 'config';"),
    ("r-run-config-list", ["report", "{R}"], 2, "folder", "UPDATE runs SET config = '[1]';"),
    ("r-run-versions-list", ["report", "{R}"], 2, "folder", "UPDATE runs SET versions = '[]';"),
    ("r-metric-text", ["report", "{R}"], 2, "folder", "UPDATE epochs SET test_acc = 'high';"),
    ("r-seconds-null", ["report", "{R}"], 2, "folder",
     "CREATE TABLE e2 AS SELECT * FROM epochs; DROP TABLE epochs; "
     "CREATE TABLE epochs AS SELECT * FROM e2; DROP TABLE e2; UPDATE epochs SET seconds = NULL;"),
    ("r-memory-text", ["report", "{R}"], 2, "folder", "UPDATE memory SET total = 'lots';"),
    ("r-seed-text", ["report", "{R}"], 2, "folder", "UPDATE runs SET seed = 'zero';"),
    # train
    ("t-seed-huge", ["train", "--seed", "99999999999999999999999"], 2),
    ("t-seed-neg", ["train", "--seed", "-1"], 2),
    ("t-policy", ["train", "--policy", "nope"], 2),
    ("t-ls", ["train", "--policy", "p=fp16,ls=static:nan"], 2),
    ("t-epochs", ["train", "--epochs", "0"], 2),
    ("t-batch", ["train", "--batch-size", "0"], 2),
    ("t-resume-locked", ["train", "--out", "{R}", "--resume", "--quiet"], 2, "locked"),
    ("t-resume-other", ["train", "--out", "{R}", "--resume", "--policy", "32-true",
                        "--epochs", "3", "--quiet"], 2, "folder"),
    # report
    ("r-missing", ["report", "{T}/nothing"], 2),
    ("r-file", ["report", "{F}/afile"], 2),
    ("r-long", ["report", "{T}/" + "a" * 5000], 2),
    ("r-dropped", ["report", "{R}"], 2, "folder", "DROP TABLE epochs;"),
    ("r-dropped-runs", ["report", "{R}"], 2, "folder", "DROP TABLE runs;"),
    ("r-bad-json", ["report", "{R}"], 2, "folder",
     "UPDATE runs SET config = '{broken';"),
    ("r-bad-analysis", ["report", "{R}"], 2, "folder",
     "UPDATE analysis SET payload = 'nope';"),
    ("r-garbage-db", ["report", "{R}"], 2, "garbage"),
    # certify
    ("ce-batch-0", ["certify", "--batch-size", "0"], 2),
    ("ce-batch-neg", ["certify", "--batch-size", "-5"], 2),
    ("ce-lr-nan", ["certify", "--lr", "nan"], 2),
    ("ce-lr-inf", ["certify", "--lr", "inf"], 2),
    ("ce-epochs-neg", ["certify", "--epochs", "-1"], 2),
    ("ce-format", ["certify", "--format", "nope"], 2),
    ("ce-cnn1d", ["certify", "--data", "digits", "--model", "cnn1d", "--epochs", "0"], 2),
    ("ce-data", ["certify", "--data", "nope"], 2),
    ("ce-data-nan", ["certify", "--data", U + "nan_data", "--model", "mlp", "--epochs", "0"], 2),
    ("ce-seed", ["certify", "--seed", "-1"], 2),
    ("ce-model-outputs", ["certify", "--data", U + "good", "--model", U + "three_outputs"], 2),
    # advise
    ("ad-batches-0", ["advise", "--batches", "0"], 2),
    ("ad-batches-neg", ["advise", "--batches", "-3"], 2),
    ("ad-lr-inf", ["advise", "--lr", "inf"], 2),
    ("ad-batch-0", ["advise", "--batch-size", "0"], 2),
    ("ad-data-nan", ["advise", "--data", U + "nan_data", "--model", "mlp", "--epochs", "0"], 2),
    ("ad-data-inf", ["advise", "--data", U + "inf_data", "--model", "mlp", "--epochs", "0"], 2),
    ("ad-format", ["advise", "--format", "e9m9"], 2),
    ("ad-epochs", ["advise", "--epochs", "1_0"], 2),
    ("ad-no-params", ["advise", "--data", U + "good", "--model", U + "no_params"], 2),
    # --config FILE.toml (any flag of the command; the command line wins)
    ("cfg-missing", ["compare", "--config", "{T}/nope.toml"], 2),
    ("cfg-not-toml", ["compare", "--config", "{F}/afile"], 2),
    ("cfg-folder", ["compare", "--config", "{F}"], 2),
    ("cfg-unknown-key", ["compare", "--config", "{F}/key.toml"], 2),
    ("cfg-bad-value", ["compare", "--config", "{F}/value.toml"], 2),
    ("cfg-unknown-table", ["compare", "--config", "{F}/table.toml"], 2),
    ("cfg-switch-string", ["compare", "--config", "{F}/switch.toml"], 2),
    ("cfg-list-for-one", ["train", "--config", "{F}/list.toml"], 2),
    ("cfg-date", ["advise", "--config", "{F}/date.toml"], 2),
    ("cfg-positional", ["report", "{R}", "--config", "{F}/positional.toml"], 2, "folder"),
    ("cfg-ce-unknown-key", ["certify", "--config", "{F}/key.toml"], 2),
    ("cfg-empty-name", ["compare", "--config", ""], 2),
    # export
    ("ex-format", ["export", "{R}", "--to", "xml"], 2, "folder"),
    ("ex-no-to", ["export", "{R}"], 2, "folder"),
    ("ex-missing", ["export", "{T}/nothing", "--to", "csv"], 2),
    ("ex-file", ["export", "{F}/afile", "--to", "csv"], 2),
    ("ex-out-taken", ["export", "{R}", "--to", "csv", "--out", "{F}"], 2, "folder"),
    ("ex-out-file", ["export", "{R}", "--to", "parquet", "--out", "{F}/afile"], 2, "folder"),
    ("ex-schema-99", ["export", "{R}", "--to", "csv"], 2, "folder",
     "UPDATE meta SET value = '99' WHERE key = 'schema_version';"),
    ("ex-metric-text", ["export", "{R}", "--to", "tensorboard"], 2, "folder",
     "UPDATE epochs SET test_acc = 'high';"),
    ("ex-json-twice-out", ["export", "{R}", "--to", "csv", "--out"], 2, "folder"),
    # issue 36: paths that cannot be written, checked before any work; flags that mean nothing
    ("ex-out-under-file", ["export", "{R}", "--to", "csv", "--out", "{F}/afile/x"], 2, "folder"),
    ("ex-out-proc", ["export", "{R}", "--to", "csv", "--out", "/proc/lowprec-x"], 2, "folder"),
    ("ex-out-proc-deep", ["export", "{R}", "--to", "csv", "--out", "/proc/x/y"], 2, "folder"),
    ("pl-out-toml", ["plan", "--data", "digits", "--model", "mlp", "--out", "{T}/p.toml"], 2),
    ("pl-out-empty", ["plan", "--data", "digits", "--model", "mlp", "--out", ""], 2),
    ("pl-out-folder", ["plan", "--data", "digits", "--model", "mlp", "--out", "{T}"], 2),
    ("pl-out-no-folder", ["plan", "--data", "digits", "--model", "mlp", "--out",
                          "{T}/nowhere/p.json"], 2),
    ("pl-report-folder", ["plan", "--data", "digits", "--model", "mlp", "--out", "{T}/p.json",
                          "--report", "{T}"], 2),
    ("cmp-executor-empty", ["compare", "--executor", "", "--out", "{T}/r"], 2),
    ("cmp-force-no-resume", ["compare", "--force-config", "--out", "{T}/r"], 2),
    ("tr-force-no-resume", ["train", "--force-config", "--out", "{T}/r"], 2),
    # the hostile tester's (issue 36's closing round)
    ("g-out-in-a-run", ["compare", "--data", "digits", "--model", "mlp", "--out",
                        "{R}/checkpoints"], 2, "folder"),
    ("g-plan-shape", ["compare", "--policies", "plan:{F}/shape_plan.json", "--out", "{T}/r"], 2),
    ("g-plan-menu-empty", ["plan", "--data", "digits", "--model", "mlp", "--menu", "",
                           "--out", "{T}/p.json"], 2),
    ("g-plan-menu-unknown", ["plan", "--data", "digits", "--model", "mlp", "--menu",
                             "fp32,fp17", "--out", "{T}/p.json"], 2),
    ("g-lr-minus-inf", ["compare", "--lr", "-inf", "--out", "{T}/r"], 2),
    ("g-wd-minus-exp", ["compare", "--weight-decay", "-1e-9", "--out", "{T}/r"], 2),
    ("g-policies-blank-item", ["compare", "--policies", "32-true,,16-true", "--out", "{T}/r"], 2),
    ("g-policies-dup", ["compare", "--policies", "32-true,bf16-true,32-true", "--out", "{T}/r"],
     2),
    ("g-q-sr0", ["quantize", "-f", "fp16", "-r", "sr0", "1"], 2),
    # --json takes no value; --version is no command's flag
    ("json-value", ["compare", "--json", "yes"], 2),
    ("version-after-command", ["compare", "--version"], 2),
    ("json-formats", ["formats", "--json"], 2),
    # no command, unknown command, unknown flag
    ("no-command", [], 2),
    ("unknown-command", ["frobnicate"], 2),
    ("unknown-flag", ["compare", "--frobnicate"], 2),
]

# -- the hostile tester's findings (branch garbage): accepted garbage, and its classes ----------
G = "lp_garbage_fns:"
GARBAGE_MODULE = """
import sys
import numpy as np
from torch import nn

def _xy(n=40, d=12, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), np.arange(n) % classes

def test_label_99():
    x, y = _xy(); xt, yt = _xy(seed=1); yt[0] = 99; return x, y, xt, yt
def test_label_unseen():
    x, y = _xy(classes=4); y[y == 2] = 3; xt, yt = _xy(classes=4, seed=1); return x, y, xt, yt
def one_d():
    x, y = _xy(); return x[:, 0], y, x[:, 0], y
def no_features():
    x, y = _xy(); return x[:, :0], y, x[:, :0], y
def exit0():
    sys.exit(0)
def exit_msg():
    sys.exit("done here")
def model_exit0(input_shape, num_classes):
    sys.exit(0)
class _Exits(nn.Module):
    def __init__(self, n):
        super().__init__(); self.fc = nn.Linear(64, n)
    def forward(self, x):
        sys.exit(0)
def forward_exit0(input_shape, num_classes):
    return _Exits(num_classes)
"""


def _garbage_files(root: Path, mod: Path) -> None:
    (mod / "lp_garbage_fns.py").write_text(GARBAGE_MODULE)
    (mod / "lp_garbage_exit.py").write_text("import sys\nsys.exit(0)\n")
    idx1d = root / "idx_1d"  # an images file holding one number per example
    idx1d.mkdir()
    for stem, n in (("train-images-idx3-ubyte", 60), ("train-labels-idx1-ubyte", 60),
                    ("t10k-images-idx3-ubyte", 20), ("t10k-labels-idx1-ubyte", 20)):
        (idx1d / stem).write_bytes(bytes([0, 0, 8, 1]) + n.to_bytes(4, "big")
                                   + bytes(i % 10 for i in range(n)))


GARBAGE_CASES = [
    # a key, option or setting given twice; inconsistent loss-scale options
    ("g-policy-key-twice", ["compare", "--policies", "p=fp16,p=bf16"], 2),
    ("g-policy-alias-twice", ["compare", "--policies", "p=fp16,params=bf16"], 2),
    ("g-policy-ls-twice", ["compare", "--policies", "p=fp16,ls=none,ls=dynamic"], 2),
    ("g-policy-update-twice", ["compare", "--policies", "p=fp16:kahan,u=nearest"], 2),
    ("g-policy-rounding-twice", ["compare", "--policies", "c=fp16:sr,r=nearest"], 2),
    ("g-ls-option-twice", ["compare", "--policies", "p=fp16,ls=dynamic:init=8,init=16"], 2),
    ("g-ls-init-above-max", ["compare", "--policies", "p=fp16,ls=dynamic:init=5;min=1;max=1"],
     2),
    ("g-ls-init-below-min", ["compare", "--policies", "p=fp16,ls=dynamic:init=0.5;min=1"], 2),
    ("g-ls-min-above-max", ["compare", "--policies", "p=fp16,ls=dynamic:min=4;max=2"], 2),
    ("g-policy-dfxp-opt-twice", ["compare", "--policies", "p=dfxp<10,interval=2,interval=3>"],
     2),
    ("g-train-policy-twice", ["train", "--policy", "p=fp16,p=bf16"], 2),
    ("g-fmt-dfxp-opt-twice", ["formats", "dfxp<10,overflow=0.01,overflow=0.02>"], 2),
    ("g-fmt-block-opt-twice", ["formats", "block<e4m3,32,axis=0,axis=1>"], 2),
    ("g-fmt-dfxp-underscore", ["formats", "dfxp<10,interval=1_0>"], 2),
    ("g-q-block-opt-twice", ["quantize", "1", "-f", "block<e4m3,32,axis=0,axis=0>"], 2),
    # labels and shapes of the data
    ("g-data-test-label-99", ["compare", "--data", G + "test_label_99", "--out", "{T}/d"], 2),
    ("g-data-test-label-unseen", ["compare", "--data", G + "test_label_unseen", "--out",
                                  "{T}/d"], 2),
    ("g-data-1d", ["compare", "--data", G + "one_d", "--out", "{T}/d"], 2),
    ("g-data-no-features", ["compare", "--data", G + "no_features", "--out", "{T}/d"], 2),
    ("g-data-idx-1d", ["compare", "--data", "idx:{F}/idx_1d", "--out", "{T}/d"], 2),
    ("g-ce-data-test-label-99", ["certify", "--data", G + "test_label_99", "--model", "mlp"], 2),
    # sys.exit() in user code
    ("g-data-exit0", ["compare", "--data", G + "exit0", "--out", "{T}/d"], 2),
    ("g-data-exit-msg", ["compare", "--data", G + "exit_msg", "--out", "{T}/d"], 2),
    ("g-data-exit-import", ["compare", "--data", "lp_garbage_exit:load", "--out", "{T}/d"], 2),
    ("g-model-exit0", ["compare", "--data", "digits", "--model", G + "model_exit0", "--out",
                       "{T}/d"], 2),
    ("g-model-exit-import", ["compare", "--data", "digits", "--model", "lp_garbage_exit:net",
                             "--out", "{T}/d"], 2),
    ("g-model-forward-exit0", ["compare", "--data", "digits", "--model", G + "forward_exit0",
                               "--out", "{T}/d"], 2),
    ("g-train-data-exit0", ["train", "--data", G + "exit0", "--out", "{T}/d"], 2),
    ("g-ce-data-exit0", ["certify", "--data", G + "exit0"], 2),
    ("g-ad-model-exit0", ["advise", "--data", "digits", "--model", G + "model_exit0"], 2),
    # dynamic fixed point where the analysis needs a static grid
    ("g-ad-dfxp", ["advise", "--format", "dfxp<10>", "--data", "digits", "--model", "mlp",
                   "--epochs", "0"], 2),
    ("g-ce-dfxp-probs", ["certify", "--format", "dfxp<10>", "--outputs", "probs", "--data",
                         "digits", "--model", "mlp", "--epochs", "0"], 2),
]
CASES += GARBAGE_CASES
#: what the new flags' lines say: the value and the accepted ones
NEW_FLAG_SAYS = {
    "cfg-unknown-key": "'epoch' is not a flag of lowprec compare; accepted: ",
    "cfg-bad-value": "'0' is not in [1, 100000] (set in --config ",
    "cfg-unknown-table": "table [frobnicate] is not a command of lowprec (accepted: formats",
    "cfg-switch-string": "quiet = 'yes' must be true or false",
    "cfg-list-for-one": "lr takes one value, not a list",
    "cfg-date": "epochs = '1979-05-27' must be a string, a number or a list",
    "cfg-positional": "'run_dir' is not a flag of lowprec report",
    "cfg-not-toml": "is not valid TOML",
    "cfg-missing": "cannot read it",
    "ex-format": "--to 'xml'; accepted: csv, parquet, tensorboard, mlflow",
    "ex-out-taken": "already exists and is not an empty folder",
    "ex-missing": "has no results.db",
    "ex-schema-99": "schema version '99'",
}


@pytest.mark.parametrize("name", sorted(NEW_FLAG_SAYS))
def test_new_flags_name_the_value_and_the_accepted_ones(name, files, tmp_path, capsys):
    case = next(c for c in CASES if c[0] == name)
    run = _folder(files, tmp_path, case[4] if len(case) > 4 else None) if len(case) > 3 else None
    argv = [a.replace("{F}", str(files)).replace("{T}", str(tmp_path)).replace(
        "{R}", str(run)) for a in case[1]]
    assert main(argv) == 2
    assert NEW_FLAG_SAYS[name] in capsys.readouterr().err


#: what each of those lines must say (the value and why), beyond being one line with exit 2
GARBAGE_SAYS = {
    "g-policy-key-twice": "params given twice (p='fp16' and p='bf16')",
    "g-policy-alias-twice": "params given twice (p='fp16' and params='bf16')",
    "g-policy-ls-twice": "loss_scale given twice",
    "g-policy-update-twice": "the write-back is given twice",
    "g-policy-rounding-twice": "the compute rounding is given twice",
    "g-ls-option-twice": "init given twice",
    "g-ls-init-above-max": "init=5.0 must be in [min, max] = [1, 1]",
    "g-ls-init-below-min": "init=0.5 must be in [min, max]",
    "g-ls-min-above-max": "0 < min <= max",
    "g-policy-dfxp-opt-twice": "dfxp option interval given twice",
    "g-train-policy-twice": "params given twice",
    "g-fmt-dfxp-opt-twice": "dfxp option overflow given twice",
    "g-fmt-block-opt-twice": "block option axis given twice",
    "g-fmt-dfxp-underscore": "'1_0' is not an integer",
    "g-q-block-opt-twice": "block option axis given twice",
    "g-data-test-label-99": "test labels range over [0, 99]; they must be in [0, 2] (the classes "
                            "of the training labels)",
    "g-data-test-label-unseen": "test labels 2 occur in no training example",
    "g-data-1d": "train features have shape (40,)",
    "g-data-no-features": "train features have shape (40, 1, 0)",
    "g-data-idx-1d": "holds an array of shape (60,)",
    "g-ce-data-test-label-99": "test labels range over [0, 99]",
    "g-data-exit0": "exit0() raised SystemExit: sys.exit(0) was called",
    "g-data-exit-msg": "sys.exit('done here') was called",
    "g-data-exit-import": "cannot import 'lp_garbage_exit' (SystemExit: sys.exit(0) was called)",
    "g-model-exit0": "model_exit0(input_shape, num_classes) raised SystemExit",
    "g-model-exit-import": "cannot import 'lp_garbage_exit' (SystemExit",
    "g-model-forward-exit0": "SystemExit: sys.exit(0) was called",
    "g-train-data-exit0": "SystemExit: sys.exit(0) was called",
    "g-ce-data-exit0": "SystemExit: sys.exit(0) was called",
    "g-ad-model-exit0": "SystemExit: sys.exit(0) was called",
    "g-ad-dfxp": "dfxp<10> is dynamic fixed point",
    "g-ce-dfxp-probs": "dfxp<10> is dynamic fixed point",
    "g-out-in-a-run": "lies inside the run folder",
    "g-plan-shape": "shape_plan.json' is not a lowprec plan: 'policy' must be a policy string",
    "g-plan-menu-empty": "menu '' holds an empty level; accepted levels: fp32",
    "g-plan-menu-unknown": "unknown menu level 'fp17'; accepted: fp32, bf16",
    "g-lr-minus-inf": "'-inf' is not finite",
    "g-wd-minus-exp": "'-1e-9' must be >= 0",
    "g-policies-blank-item": "hold an empty item",
    "g-policies-dup": "policy '32-true' is listed twice",
    "g-q-sr0": "rounding mode 'sr0': srN takes N = 1..32",
}


@pytest.mark.parametrize("case", GARBAGE_CASES, ids=[c[0] for c in GARBAGE_CASES])
def test_garbage_error_names_the_value_and_why(case, files, tmp_path, capsys):
    name, argv, code = case
    argv = [a.replace("{F}", str(files)).replace("{T}", str(tmp_path)) for a in argv]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith(f"lowprec {argv[0]}: error: ") and GARBAGE_SAYS[name] in err, err


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(case, files, tmp_path, capsys):
    name, argv, code = case[:3]
    kind = case[3] if len(case) > 3 else None
    damage = case[4] if len(case) > 4 else None
    run = None
    if kind in ("folder", "locked", "garbage", "userfile"):
        run = _folder(files, tmp_path, damage)
        if kind == "garbage":
            (run / "results.db").write_bytes(b"SQLite format 3\x00" + b"\xff" * 3000)
        if kind == "userfile":  # a user's own file in the run folder: kept, and named
            (run / "backup.tmp1").write_text("mine")
    argv = [a.replace("{F}", str(files)).replace("{T}", str(tmp_path)).replace(
        "{R}", str(run)) for a in argv]
    before = {p: _sha(p) for p in (run.rglob("results.db*") if run else [])}
    lock = FolderLock(run) if kind == "locked" else None
    if lock:
        lock.acquire()
    try:
        got = main(argv)
    finally:
        if lock:
            lock.release()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert got == code, (got, err[-800:])
    assert "Traceback" not in err
    if argv:  # without a command, the help text is the answer
        assert len(lines) == 1, err[-2000:]
        assert len(lines[0]) <= 1100  # (the cap, with the command's prefix)
    for p, h in before.items():
        assert _sha(p) == h, f"{p.name} changed"
    if kind == "locked":
        import os

        assert f"process {os.getpid()}" in err
    if kind == "userfile":
        assert "backup.tmp1" in err and (run / "backup.tmp1").read_text() == "mine"


def _has_json(command: str) -> bool:
    from lowprec.cli import build_parser

    sub = build_parser().commands.get(command)
    return sub is not None and "--json" in sub._option_string_actions


JSON_CASES = [c for c in CASES if c[1] and _has_json(c[1][0]) and "--json" not in c[1]]


@pytest.mark.parametrize("case", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_a_failing_command_prints_one_json_document(case, files, tmp_path, capsys):
    """--json: a failing command's stdout is exactly one JSON document, {"error", "exit"},
    with the exit code it returned and the line it printed on stderr."""
    import json

    name, argv, code = case[:3]
    kind = case[3] if len(case) > 3 else None
    run = None
    if kind in ("folder", "locked", "garbage", "userfile"):
        run = _folder(files, tmp_path, case[4] if len(case) > 4 else None)
        if kind == "garbage":
            (run / "results.db").write_bytes(b"SQLite format 3\x00" + b"\xff" * 3000)
        if kind == "userfile":
            (run / "backup.tmp1").write_text("mine")
    argv = [a.replace("{F}", str(files)).replace("{T}", str(tmp_path)).replace(
        "{R}", str(run)) for a in argv] + ["--json"]
    lock = FolderLock(run) if kind == "locked" else None
    if lock:
        lock.acquire()
    try:
        got = main(argv)
    finally:
        if lock:
            lock.release()
    out, err = capsys.readouterr()
    assert got == code
    doc = json.loads(out)  # one document, nothing else
    assert doc == {"error": err.strip().splitlines()[-1], "exit": code}, (doc, err)


def test_at_least_80_cases_across_the_seven_commands():
    commands = {c[1][0] for c in CASES if c[1]}
    assert {"compare", "train", "report", "formats", "quantize", "certify", "advise"} <= commands
    assert len(CASES) >= 80


@pytest.mark.parametrize("text", ["{bad", '{"models": 5}', '{"models": ["../x"]}', "[]",
                                  '{"models": []}'])
@pytest.mark.parametrize("command", [["report"], ["export", "--to", "csv"]])
def test_a_damaged_models_json_is_one_line(files, tmp_path, capsys, text, command):
    """report and export of a multi-model folder whose models.json is damaged: one line
    naming the file, exit 2, the file untouched."""
    import shutil

    out = tmp_path / "several"
    shutil.copytree(files / "good", out / "mlp")
    (out / "models.json").write_text(text)
    argv = [command[0], str(out), *command[1:]]
    if command[0] == "export":
        argv += ["--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "models.json is damaged" in err[0], err
    assert (out / "models.json").read_text() == text


@pytest.mark.parametrize("argv", [["formats", "fp16"], ["quantize", "-f", "fp16", "1"]])
def test_output_to_a_full_device_is_one_line(argv, capsys, monkeypatch):
    """stdout on /dev/full (ENOSPC at the write or the flush): exit 1 and one line, no
    traceback; a closed pipe (| head) ends quietly with 141, as the shell reports SIGPIPE."""
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self):
            raise io.UnsupportedOperation("no file descriptor")

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lowprec: error: cannot write the output: No space left on device"]


def test_a_full_disk_elsewhere_is_not_taken_for_lost_output(monkeypatch, capsys):
    """ENOSPC from a named file that nothing caught (a bug) keeps its traceback: it is not
    reported as stdout that could not be written."""
    import errno

    import lowprec.cli as cli

    def broken(args, console):
        raise OSError(errno.ENOSPC, "No space left on device", "/somewhere/model.pt")

    monkeypatch.setattr(cli, "cmd_formats", broken)
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.commands["formats"].set_defaults(func=broken)
    with pytest.raises(OSError, match="model.pt"):
        main(["formats", "fp16"])


def test_negative_numbers_are_values_not_flags(capsys):
    """argparse took -1e-3 and -inf for flags; the help says they are accepted values."""
    assert main(["quantize", "-f", "fp16", "-1e-3", "-inf", "1e30"]) == 0
    out = capsys.readouterr().out
    assert "-0.0010004" in out and "-inf" in out
