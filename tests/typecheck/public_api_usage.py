"""A user's script over lowprec's public API, for mypy (tests/test_typing.py type-checks it;
it is not run). Each line is a call the README and the docs show; a signature that stops
accepting it, or a return type that stops having the attribute used, fails the check."""

from __future__ import annotations

import pandas as pd
import torch

import lowprec
import lowprec.results
from lowprec.optim import Adam

model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
prec = lowprec.Precision("16-true")
policy: lowprec.Policy = lowprec.parse_policy("p=fp16,m=fp32")
prec2 = lowprec.Precision(policy)
model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
with prec.autocast():
    loss = torch.nn.functional.cross_entropy(model(x), y)
prec.backward(loss)
prec.step(opt)
steps: int = prec.steps

q: torch.Tensor = lowprec.quantize(x, "fp16")
z: torch.Tensor = lowprec.quantize(x, "e4m3fn", "stochastic",
                                   generator=torch.Generator().manual_seed(0))
fmt = lowprec.parse_format("e5m10")
rounding = lowprec.parse_rounding("stochastic")
quantizer = lowprec.Quantizer(forward="bf16", backward="e5m2")
scale = lowprec.DynamicLossScale()
adam = Adam(model.parameters(), lr=1e-3)

res: lowprec.results.Results = lowprec.results.load("runs/demo")
runs: pd.DataFrame = res.runs
best: pd.Series = res.epochs.groupby("policy")["test_acc"].max()
cert: pd.DataFrame = res.analysis("certificate:fp16")
