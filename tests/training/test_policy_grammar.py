"""One grammar for every policy argument: ``--policies`` (CompareConfig), ``Precision(policy)``
and the ``overrides=`` of a module accept (and refuse) the same texts, a bare format such as
``e4m3fn`` included; outputs checked against torch's own float8 cast."""

import copy

import pytest
import torch
from torch import nn

from lowprec import Precision
from lowprec.experiments.config import CompareConfig, RunError, split_policies
from lowprec.numerics.formats import E4M3FN, parse_format
from lowprec.training.emulation.engine import Rule, parse_override
from lowprec.training.policy import Policy, parse_policy, policy_or_format

BASE = parse_policy("32-true")


@pytest.mark.parametrize("text", ["e4m3fn", "bf16", "fixed<16,14>", "E5M2", "fp8_e4m3"])
def test_a_bare_format_is_every_role_in_it_for_policies_and_overrides(text):
    fmt = parse_format(text)
    pol = parse_policy(text)
    assert (pol.params, pol.compute, pol.grads, pol.optimizer_state) == (fmt,) * 4
    assert str(pol) == text  # named as given: the run id of --policies e4m3fn
    rule = parse_override(text, BASE)
    assert (rule.compute, rule.grads, rule.params) == (fmt,) * 3
    assert rule == Rule.of(pol)  # the base here rounds to nearest, as the policy does
    cfg = CompareConfig(policies=tuple(split_policies(f"32-true,{text}")))
    cfg.validate()  # no RunError: --policies takes it too


@pytest.mark.parametrize("text", ["e9m2", "fp99", "e4m3fn:sr", "q6.10-xx", "e4m3fn-wobble"])
def test_a_text_no_grammar_reads_is_refused_by_both(text):
    with pytest.raises(ValueError, match="unknown policy|policy "):
        parse_policy(text)
    with pytest.raises(ValueError, match="neither a policy"):
        parse_override(text, BASE)
    with pytest.raises(RunError):
        CompareConfig(policies=(text,)).validate()


def test_names_win_over_formats_in_both():
    # "binary" and "mxfp4" are formats and policies: both read the policy
    for name in ("binary", "mxfp4"):
        assert isinstance(policy_or_format(name), Policy)
        assert parse_override(name, BASE) == Rule.of(parse_policy(name))
    assert policy_or_format("e4m3fn") == E4M3FN


def test_policy_e4m3fn_and_an_override_e4m3fn_compute_the_same_float8_values():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(16, 8)
    outs = []
    for prec in (Precision("e4m3fn"),
                 Precision("32-true", overrides={"0": "e4m3fn", "1": "e4m3fn",
                                                 "2": "e4m3fn"})):
        model, _ = prec.setup(copy.deepcopy(net))
        with prec.autocast():
            outs.append(model(x).float())
    a, b = outs
    assert torch.equal(a, b)
    assert torch.equal(a, a.to(torch.float8_e4m3fn).float())  # on torch's own float8 grid
    assert not torch.equal(a, net(x))  # and not the fp32 result
