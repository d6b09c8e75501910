"""One list drives the contracts: every registered format, named policy and optimizer goes through
the same checks, with readable test ids.

* formats (``NAMED_FORMATS``): ``quantize`` keeps dtype and shape for fp32, fp16 and bf16 inputs;
  where the format's values survive the dtype, a 16-bit input gives the values the fp32 path
  gives for the same input;
* policies (``POLICIES``) x optimizers (lowprec's SGD/Adam/AdamW, torch's SGD/Adam/AdamW):
  finite losses and outputs on a small model; ``state_dict`` round trip: train 2 steps, save
  model + optimizer + Precision, train 2 more; restore the saved state into a fresh copy, which
  must report equal state, and train 2 more: the parameters must be bit-identical.
"""

import copy
import math

import pytest
import torch
from helpers import assert_same_bits
from torch import nn

from lowprec import POLICIES, Precision, quantize
from lowprec.numerics.formats import NAMED_FORMATS
from lowprec.training import optim

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(NAMED_FORMATS))
def test_format_contract(name, dtype):
    fmt, dt = NAMED_FORMATS[name], DTYPES[dtype]
    x32 = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 4
    x = x32.to(dt)
    y = quantize(x, fmt)
    assert y.dtype == dt and y.shape == x.shape
    assert not x.equal(y) or fmt.bits >= 16  # it rounds (a narrow format changes these values)
    q = quantize(x.float(), fmt)
    if torch.equal(q.to(dt).float(), q):  # the format's values of this sample fit the dtype
        assert_same_bits(y.float(), q, f"{name} from {dtype}")
    if dt == torch.float32:
        assert torch.equal(quantize(y, fmt), y)  # idempotent on its own grid


def _deep_equal(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        if a.is_floating_point():
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))
            assert bool(same.all()), f"{where}: values differ"
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            _deep_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _deep_equal(u, v, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), where


OPTIMIZERS = {
    "lowprec-SGD": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9),
    "lowprec-Adam": lambda ps: optim.Adam(ps, lr=1e-2),
    "lowprec-AdamW": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    "torch-SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "torch-Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "torch-AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
}

_G = torch.Generator().manual_seed(1)
X, Y = torch.randn(16, 32, generator=_G), torch.randint(0, 4, (16,), generator=_G)


def _fresh(policy, opt_name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    prec = Precision(policy, seed=0)
    model, opt = prec.setup(model, OPTIMIZERS[opt_name](model.parameters()))
    return model, opt, prec


def _steps(prec, model, opt, n):
    for _ in range(n):
        opt.zero_grad()
        with prec.autocast():
            out = model(prec.convert_input(X))
            loss = nn.functional.cross_entropy(out.float(), Y)
        assert torch.isfinite(out).all() and math.isfinite(loss.item())
        prec.backward(loss)
        prec.step(opt)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_and_optimizer_contract(policy, opt_name):
    model, opt, prec = _fresh(policy, opt_name)
    _steps(prec, model, opt, 2)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), prec.state_dict()))
    _steps(prec, model, opt, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    model2, opt2, prec2 = _fresh(policy, opt_name)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(copy.deepcopy(saved[1]))
    prec2.load_state_dict(copy.deepcopy(saved[2]))
    _deep_equal(model2.state_dict(), saved[0], "model")
    _deep_equal(opt2.state_dict(), saved[1], "optimizer")
    _deep_equal(prec2.state_dict(), saved[2], "precision")
    _steps(prec2, model2, opt2, 2)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert a.dtype == b.dtype
        assert_same_bits(a, b, f"{policy} {opt_name} {name} after resuming")
    _deep_equal(prec2.state_dict(), prec.state_dict(), "precision after resuming")
