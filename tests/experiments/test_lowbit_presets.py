"""The fp8 and fp4 presets and what they run on: the next-character task over the licence
texts Debian ships (or a user's text) and the small character-level transformer."""

from pathlib import Path

import pytest
import torch

from lowprec import quantize
from lowprec.cli import main
from lowprec.experiments import PRESETS, CompareConfig
from lowprec.experiments.data import DatasetNotFound, load_checked_dataset
from lowprec.experiments.models import build_model
from lowprec.experiments.text import LICENSES_DIR, WINDOW
from lowprec.numerics.formats import Overflow, parse_format
from lowprec.numerics.scaling import scaled_cast
from lowprec.training.policy import parse_policy

from helpers import one_thread  # noqa: E402,F401 - tiny models: one OpenMP thread per test

needs_licenses = pytest.mark.skipif(not Path(LICENSES_DIR).is_dir(),
                                    reason=f"{LICENSES_DIR} (Debian's base-files) is missing")


def _corpus(tmp_path, train, test):
    """A file whose first 90% is ``train`` and last 10% ``test`` (lengths 900 and 100)."""
    f = tmp_path / "corpus.txt"
    f.write_text(train * (900 // len(train)) + test * (100 // len(test)))
    return f


def test_a_users_text_splits_train_from_test_and_maps_unseen_characters(tmp_path):
    """Training windows come from the first 90% of the text, test windows from the rest: a
    test part made of characters the training part never has gives UNKNOWN (0) inputs; test
    windows whose next character is no training label are dropped."""
    f = _corpus(tmp_path, "abcab", "xyzc")
    d = load_checked_dataset(f"text:{f}")
    assert d.input_shape == (1, WINDOW) and d.x_train.dtype == torch.float32
    assert d.name == f"text:{f}"
    assert set(d.y_train.tolist()) <= set(range(1, d.num_classes))
    assert not bool((d.x_train == 0).any())  # every training character is common
    assert len(d.y_test) and set(d.y_test.tolist()) <= set(d.y_train.tolist())
    # x, y, z never occur in training: UNKNOWN inputs; 'c' does (a training label)
    assert bool((d.x_test == 0).any()) and bool((d.x_test != 0).any())
    assert len(d.y_test) < len(range(900, 1000 - WINDOW))  # windows ending in x, y, z dropped


def test_a_missing_corpus_says_so(tmp_path):
    with pytest.raises(DatasetNotFound, match="no such file"):
        load_checked_dataset(f"text:{tmp_path / 'none.txt'}")


@needs_licenses
def test_the_licence_corpus_trains_the_character_model():
    """The default corpus: 16,000 training and about 4,000 test windows of 16 characters, ~70
    classes; 40 Adam steps of the character transformer take the loss from log(classes)
    well below it (a unigram model's entropy is ~3.1 nats here)."""
    d = load_checked_dataset("text")
    assert len(d.x_train) == 16_000 and 3_000 < len(d.x_test) <= 4_000
    assert 50 < d.num_classes < 100
    torch.manual_seed(0)
    model = build_model("chartransformer", d.input_shape, d.num_classes)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    losses = []
    for i in range(40):
        x, y = d.x_train[i * 64:(i + 1) * 64], d.y_train[i * 64:(i + 1) * 64]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * torch.log(torch.tensor(float(d.num_classes))).item()
    assert sum(losses[-5:]) / 5 < 3.3, losses


def test_the_character_model_refuses_images():
    with pytest.raises(ValueError, match="use it with --data text"):
        build_model("chartransformer", (1, 28, 28), 10)


def test_unscaled_fp8_is_a_bare_saturating_cast():
    x = torch.randn(64, 64) * 1e-3
    e4m3 = parse_format("e4m3fn")
    assert torch.equal(scaled_cast(x, "e4m3fn@none"),
                       quantize(x, e4m3.__class__(**{**e4m3.__dict__,
                                                     "overflow": Overflow.SATURATE})))
    assert str(parse_policy("fp8-unscaled").scaled) == "fp8-unscaled"


@pytest.mark.parametrize("name", ["fp8", "fp4", "accumulation"])
def test_presets_are_valid_and_compare_each_recipe(name):
    p = PRESETS[name]
    CompareConfig(**p).validate()
    assert p["policies"][0] == "32-true"
    if name == "accumulation":  # the MLP's 784-term dot products, each policy an accumulator
        assert (p["data"], p["model"]) == ("mnist", "mlp")
        assert all(parse_policy(pol).accumulator is not None for pol in p["policies"][1:])
        return
    assert (p["data"], p["model"]) == ("text", "chartransformer")
    for pol in p["policies"][1:]:
        assert parse_policy(pol).scaled is not None, pol


@needs_licenses
@pytest.mark.slow  # 5 tiny runs with their analyses
@pytest.mark.timeout(3600)  # a hang guard only
def test_fp4_preset_runs_end_to_end_at_tiny_scale(tmp_path):
    out = tmp_path / "fp4"
    assert main(["compare", "--preset", "fp4", "--train-subset", "128", "--epochs", "1",
                 "--seeds", "1", "--threads", "1", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    for pol in PRESETS["fp4"]["policies"]:
        assert f"| {pol} |" in md, pol
