"""An op output rounded to nearest fp16/bf16 whose gradient is rounded the same way takes one
of two paths in the eager engine (``Emulation.round``): the ``Round`` autograd function (a
kernel pass forward and backward, Python nodes) or, for tensors up to
``CAST_ROUND_TRIP_MAX`` elements, torch's cast round trip ``t.half().float()`` (C++ nodes whose
backward casts the gradient). Both must give the same bits: outputs, every parameter gradient
and the parameters after two steps, on a model whose activations are read by several consumers
(gradient sums), hold values beyond the format's range and below its smallest normal. A NaN's
payload may differ (torch's casts keep it, as a native 16-bit run does; the kernel writes one
quiet NaN), its place and every other value's bits may not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import assert_same_values
from lowprec import Precision
from lowprec.training.emulation import autograd_fns, engine
from lowprec.training.optim import SGD


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(8 * 6 * 6, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = h + h * 0.5  # two consumers: a 16-bit gradient sum
        z = self.fc1(h.flatten(1))
        return self.fc2(torch.tanh(z) + z * 1e-6)  # an addend below fp16's normals


def _run(policy: str, cast_max: int, monkeypatch) -> tuple[list, int]:
    calls = []
    original = autograd_fns.Round.apply
    with monkeypatch.context() as m:
        m.setattr(engine, "CAST_ROUND_TRIP_MAX", cast_max)
        m.setattr(autograd_fns.Round, "apply", lambda *a: calls.append(1) or original(*a))
        m.setattr(engine.Round, "apply", autograd_fns.Round.apply)
        torch.manual_seed(0)
        net = Net()
        prec = Precision(policy, seed=0)
        model, opt = prec.setup(net, SGD(net.parameters(), lr=0.1, momentum=0.9))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(5, 3, 6, 6, generator=g) * 3e4  # beyond fp16's max after the conv
        x[0, 0, 0, :2] = 1e-6
        y = torch.randint(0, 4, (5,), generator=g)
        seen = []
        for _ in range(2):
            opt.zero_grad()
            with prec.autocast():
                out = model(x)
                loss = nn.functional.cross_entropy(out.float().nan_to_num(), y)
            prec.backward(loss)
            seen += [out.detach()] + [p.grad.clone() for p in net.parameters()]
            prec.step(opt)
        seen += [p.detach().clone() for p in net.parameters()]
    return seen, len(calls)


@pytest.mark.parametrize("policy", ["16-true", "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated"])
def test_the_cast_round_trip_gives_rounds_bits(policy, monkeypatch):
    casts, n_casts = _run(policy, engine.CAST_ROUND_TRIP_MAX, monkeypatch)
    rounds, n_rounds = _run(policy, 0, monkeypatch)
    assert n_rounds > 0 and n_casts == 0, (n_rounds, n_casts)  # each path taken
    assert not torch.isfinite(casts[0]).all() or policy != "16-true"  # fp16 overflowed
    for i, (a, b) in enumerate(zip(casts, rounds)):  # (NaN payloads aside: torch's casts
        # keep them, as a native 16-bit run's do; the kernel writes one quiet NaN)
        assert_same_values(a.numpy(), b.numpy(), f"{policy}: tensor {i}")


def test_other_formats_and_modes_keep_round(monkeypatch):
    """Stochastic rounding, a gradient format other than the compute format, fp8: Round."""
    for policy in ("p=fp16,c=fp16:sr,g=fp16:sr", "p=fp16,c=fp16,g=bf16", "p=e4m3,c=e4m3"):
        _, n = _run(policy, engine.CAST_ROUND_TRIP_MAX, monkeypatch)
        assert n > 0, policy


@pytest.mark.parametrize("cast_max", [0, None])
def test_a_second_order_gradient_raises_on_either_path(cast_max, monkeypatch):
    """The engine's gradient roundings have no derivative (``once_differentiable``): a gradient
    penalty (``create_graph=True``, then differentiating the gradient) raises, whichever path
    each output's rounding took. Found by review: with the cast round trip on small tensors and
    ``Round`` on large ones, the terms through ``Round`` were silently missing."""
    if cast_max is not None:
        monkeypatch.setattr(engine, "CAST_ROUND_TRIP_MAX", cast_max)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 300), nn.Tanh(), nn.Linear(300, 4))  # (32 x 300: small)
    prec = Precision("16-true", seed=0)
    model, _ = prec.setup(net)
    x = torch.randn(32, 8)
    with prec.autocast():
        out = model(x).float().pow(2).sum()
    (g,) = torch.autograd.grad(out, [net[0].weight], create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        g.pow(2).sum().backward()
