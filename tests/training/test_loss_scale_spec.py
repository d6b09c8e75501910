"""The ``ls=`` grammar of a policy: several options, every value checked when the policy is parsed.

The dynamic rule itself is checked against torch.amp.GradScaler's in test_training.py; here:
what a spec may say, that the policy carries the options to the scaler, and that every value
out of its range is a one-line ValueError at parse time.
"""

import math

import pytest
import torch

from lowprec.training.loss_scale import DynamicLossScale, make_loss_scale, parse_loss_scale
from lowprec.training.policy import parse_policy
from lowprec.training.precision import Precision


@pytest.mark.parametrize("spec", ["p=fp16,ls=dynamic:init=1024;growth=4;backoff=0.25;interval=7",
                                  "p=fp16,ls=dynamic:init=1024,growth=4,backoff=0.25,interval=7",
                                  "p=fp16,ls=dynamic:interval=7;backoff=0.25;growth=4;init=1024"])
def test_several_dynamic_options_reach_the_scaler(spec):
    pol = parse_policy(spec)
    assert pol.loss_scale == "dynamic:init=1024;growth=4;backoff=0.25;interval=7"
    assert parse_policy(pol.spec) == pol  # the canonical spec parses back to the same policy
    ls = Precision(pol).loss_scale
    assert isinstance(ls, DynamicLossScale)
    assert (ls.scale, ls.growth, ls.backoff, ls.interval) == (1024.0, 4.0, 0.25, 7)


def test_dynamic_options_follow_grad_scaler_arithmetic():
    """The same growth/backoff/interval in torch.amp.GradScaler's own update rule."""
    ls = make_loss_scale("dynamic:init=8;growth=3;backoff=0.25;interval=2")
    scale = torch.full((1,), 8.0)
    growth_tracker = torch.zeros(1, dtype=torch.int32)
    for found in [0, 0, 1, 0, 0, 0, 1, 1, 0, 0]:
        ls.update(bool(found))
        torch._amp_update_scale_(scale, growth_tracker, torch.full((1,), float(found)), 3.0,
                                 0.25, 2)
        assert ls.scale == scale.item()


BAD = ["dynamic:init=-5", "dynamic:init=0", "dynamic:init=nan", "dynamic:init=inf",
       "dynamic:init=1e400", "static:inf", "static:nan", "static:-1", "static:0", "static:",
       "static", "dynamic:growth=0.5", "dynamic:growth=1", "dynamic:backoff=1",
       "dynamic:backoff=0", "dynamic:backoff=-0.5", "dynamic:interval=0",
       "dynamic:interval=2.5", "dynamic:interval=-3", "dynamic:min=0", "dynamic:min=4;max=2",
       "dynamic:foo=1", "dynamic:init", "dynamic:init=1;init=2", "dynamic:init=abc",
       "none:3", "weird", "dynamic:init=1_000"]


@pytest.mark.parametrize("ls", BAD)
def test_bad_values_are_refused_at_parse_time_in_one_line(ls):
    with pytest.raises(ValueError) as err:
        parse_policy(f"p=fp16,ls={ls}")
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 600 and "loss scale" in msg
    with pytest.raises(ValueError):
        parse_loss_scale(ls)


def test_long_spec_is_shortened_in_the_message():
    with pytest.raises(ValueError) as err:
        parse_loss_scale("dynamic:init=" + "9" * 100_000)
    assert len(str(err.value)) < 600


def test_good_values():
    assert parse_loss_scale("static:512") == ("static", {"scale": 512.0})
    assert parse_loss_scale("dynamic") == ("dynamic", {})
    assert parse_loss_scale("none") == ("none", {})
    kind, opts = parse_loss_scale("dynamic:min=0.5;max=1e6")
    assert opts == {"min": 0.5, "max": 1e6} and math.isfinite(opts["max"])


# -- inconsistent option sets; states (hostile-tester findings) ----------------------------------

@pytest.mark.parametrize("ls", ["dynamic:init=5;min=1;max=1", "dynamic:init=0.5;min=1",
                                "dynamic:init=64;max=32", "dynamic:init=2;min=4;max=8",
                                "dynamic:init=8,init=8"])
def test_init_outside_min_max_or_repeated_is_refused(ls):
    """init=5 with max=1 used to hold the scale at 5 for a whole clean run (no update clamps
    it before the first growth or backoff)."""
    with pytest.raises(ValueError) as err:
        parse_policy(f"p=fp16,ls={ls}")
    msg = str(err.value)
    assert "\n" not in msg and ("[min, max]" in msg or "twice" in msg)


@pytest.mark.parametrize("kwargs", [dict(init=5.0, min=1.0, max=1.0), dict(init=0.5, min=1.0),
                                    dict(init=64.0, max=32.0)])
def test_dynamic_loss_scale_refuses_init_outside_min_max(kwargs):
    with pytest.raises(ValueError, match=r"init=.* must be in \[min, max\]"):
        DynamicLossScale(**kwargs)


def test_init_at_the_bounds_is_valid():
    assert parse_loss_scale("dynamic:init=4;min=4;max=4")[1] == {"init": 4.0, "min": 4.0,
                                                                 "max": 4.0}
    assert DynamicLossScale(init=0.5, min=0.25).scale == 0.5
    # bounds not given are widened to hold init: 2**30 alone starts there (as torch's scaler)
    big, small = DynamicLossScale(init=2.0**30), DynamicLossScale(init=0.5)
    assert (big.scale, big.min, big.max) == (2.0**30, 1.0, 2.0**30)
    assert (small.scale, small.min, small.max) == (0.5, 0.5, 2.0**24)


BAD_STATES = [{"scale": float("nan")}, {"scale": float("inf")}, {"scale": -1.0}, {"scale": 0.0},
              {"scale": "8"}, {"scale": True}, {}, {"scale": 2.0**30},
              {"scale": 8.0, "good_steps": -1}, {"scale": 8.0, "good_steps": 1.5},
              {"scale": 8.0, "good_steps": float("inf")}]


@pytest.mark.parametrize("state", BAD_STATES, ids=[repr(s)[:40] for s in BAD_STATES])
def test_bad_loss_scale_state_is_refused_and_changes_nothing(state):
    ls = DynamicLossScale(init=8.0, interval=3)
    ls.update(False)
    with pytest.raises(ValueError) as err:
        ls.load_state_dict(state)
    assert "\n" not in str(err.value)
    assert (ls.scale, ls.good_steps) == (8.0, 1)


def test_lowered_interval_still_grows():
    """good_steps above a lowered interval (GradScaler.set_growth_interval) grows at the next
    clean step instead of never again."""
    ls = DynamicLossScale(init=8.0, interval=10)
    for _ in range(5):
        ls.update(False)
    ls.interval = 2
    ls.update(False)
    assert (ls.scale, ls.good_steps) == (16.0, 0)
