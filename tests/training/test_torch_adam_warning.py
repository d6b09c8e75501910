"""A torch Adam that will lose eps or its second moment in the formats it runs in gets one
OptimizerPrecisionWarning at its first step, naming what to use instead; none where it is safe
(lowprec's Adam, bf16 and fp32 state, fp32 master weights)."""

import warnings

import pytest
import torch
from helpers import small_mlp, train_steps
from torch import nn

import lowprec
from lowprec import Precision
from lowprec.training.optim import OptimizerPrecisionWarning
from lowprec.training.optim.torch_adam import adam_risks


def batch(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)


def run(policy, make, steps=3, model=None, after_setup=False):
    """The documented loop; returns the warnings of this category, with the step they came in
    (0: at setup)."""
    model = model if model is not None else small_mlp(0)
    x, y = batch()
    prec = Precision(policy)
    caught = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if after_setup:  # a native policy accepts an optimizer that setup never saw
            model, _ = prec.setup(model)
            opt = make(model.parameters())
        else:
            model, opt = prec.setup(model, make(model.parameters()))
        caught += [(0, w) for w in rec if issubclass(w.category, OptimizerPrecisionWarning)]
        for step in range(1, steps + 1):
            rec.clear()
            xin = prec.convert_input(x).to(next(model.parameters()).dtype)
            train_steps(prec, model, opt, xin, y, 1)
            caught += [(step, w) for w in rec
                       if issubclass(w.category, OptimizerPrecisionWarning)]
    return caught


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-6)],
                         ids=["Adam", "AdamW", "Adam-eps1e-6"])
def test_emulated_fp16_state_warns_once_at_the_first_step(make):
    """16-true on CPU is emulated: torch's Adam computes in fp32 and lowprec rounds its state to
    fp16 after each step, so eps survives but v = 1e-3 g**2 flushes. eps=1e-6 is an fp16 number:
    the setup-time check (eps rounds to 0?) stayed silent for it."""
    caught = run("16-true", make)
    assert [step for step, _ in caught] == [1], [str(w.message) for _, w in caught]
    msg = str(caught[0][1].message)
    assert "lowprec.optim.Adam" in msg and "eps >= 5.5e-03" in msg and "fp32" in msg
    assert "flushes to 0 in fp16" in msg and "arithmetic in fp32" in msg
    assert "rounds to 0" not in msg  # the wrapper adds eps in fp32


def test_native_fp16_adam_names_the_lost_eps_and_goes_inf_as_it_says():
    caught = run("p=fp16,c=fp16,g=fp16,o=fp16,b=native", lambda ps: torch.optim.Adam(ps))
    assert len(caught) == 1 and caught[0][0] == 1
    msg = str(caught[0][1].message)
    assert "eps=1e-08 rounds to 0 in fp16" in msg and "lowprec.optim.Adam" in msg
    # what it says happens: torch's own fp16 Adam, one step, gradients 1e-4 and 1e-3
    p = nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = torch.optim.Adam([p], lr=1e-3)
    p.grad = torch.tensor([1e-4, 1e-3], dtype=torch.float16)
    opt.step()
    assert torch.isinf(p).all()


def test_the_actual_state_dtype_counts_not_the_policy():
    """The user's own model.half() under 32-true: torch's Adam keeps fp16 state; and a torch Adam
    a native policy accepts without setup_optimizer is checked too."""
    caught = run("32-true", lambda ps: torch.optim.Adam(ps), model=small_mlp(0).half())
    assert len(caught) == 1 and "state in fp16" in str(caught[0][1].message)
    caught = run("p=fp16,c=fp16,g=fp16,o=fp16,b=native", lambda ps: torch.optim.AdamW(ps),
                 after_setup=True)
    assert len(caught) == 1 and caught[0][0] == 1


def test_fused_adam_adds_eps_in_fp32_but_still_loses_v():
    caught = run("p=fp16,c=fp16,g=fp16,o=fp16,b=native",
                 lambda ps: torch.optim.Adam(ps, fused=True))
    assert len(caught) == 1
    msg = str(caught[0][1].message)
    assert "arithmetic in fp32" in msg and "rounds to 0" not in msg and "flushes" in msg


@pytest.mark.parametrize("policy,make", [
    ("16-true", lambda ps: lowprec.optim.Adam(ps, lr=1e-3)),
    ("16-true", lambda ps: lowprec.optim.AdamW(ps, lr=1e-3)),
    ("bf16-true", lambda ps: torch.optim.Adam(ps, lr=1e-3)),  # 1e-8 and v hold in bf16
    ("p=bf16,c=bf16,g=bf16,o=bf16,b=emulated", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    ("16-master", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),  # fp32 master state
    ("16-mixed", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    ("32-true", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    ("16-true", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
])
def test_no_warning_where_it_is_safe(policy, make):
    assert run(policy, make) == []


def test_risks_match_torchs_own_fp16_state():
    """v's flushes are where torch's own fp16 Adam stores 0 after one step; g**2 beyond 65504
    (|g| > 256) is an overflow; bf16 loses neither."""
    from lowprec import parse_format

    g = torch.tensor([1e-4, 1e-3, 6e-3, 1e-2, 300.0, 0.0])
    p = nn.Parameter(torch.ones(6, dtype=torch.float16))
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    p.grad = g.half()
    opt.step()
    torch_flushed = int(((opt.state[p]["exp_avg_sq"] == 0) & (g != 0)).sum())
    fp16, bf16, fp32 = (parse_format(f) for f in ("fp16", "bf16", "fp32"))
    (r,) = adam_risks([(1e-8, (0.9, 0.999), fp32, fp16, g)])
    assert (r.n, r.underflow, r.overflow) == (5, torch_flushed, 1) == (5, 2, 1)
    assert not r.eps_lost and abs(r.safe_eps - 5.46e-3) < 1e-5
    assert adam_risks([(1e-8, (0.9, 0.999), bf16, bf16, g)]) == []
    (r,) = adam_risks([(1e-8, (0.9, 0.999), fp16, fp16, None)])
    assert r.eps_lost and r.n == 0
