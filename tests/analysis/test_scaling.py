"""find_loss_scale: underflow measured against direct rounding."""

import math

import pytest
import torch
from helpers import small_mlp
from torch import nn

import lowprec
from lowprec import find_loss_scale, quantize
from lowprec.numerics.formats import FP16


def test_find_loss_scale_measures_underflow():
    model = small_mlp(0)
    x, y = torch.randn(32, 20), torch.randint(0, 5, (32,))

    def loss_fn(out, t):  # a loss whose gradients sit largely below fp16's subnormals
        return nn.functional.cross_entropy(out, t) * 1e-6

    capped = find_loss_scale(model, (x, y), loss_fn, "fp16", max_scale=2.0**20)
    assert capped.scale == 2.0**20
    choice = find_loss_scale(model, (x, y), loss_fn, "fp16", max_scale=2.0**40)
    assert math.log2(choice.scale).is_integer()
    assert choice.max_abs * choice.scale * choice.headroom <= FP16.max
    assert choice.max_abs * choice.scale * 2 * choice.headroom > FP16.max  # the largest such
    mags = lowprec.analysis.scaling.gradient_magnitudes(model, (x, y), loss_fn)
    nz = mags[mags > 0].double()
    direct_1 = (quantize(nz.float(), "fp16") == 0).double().mean().item()
    direct_s = (quantize((nz * choice.scale).float(), "fp16") == 0).double().mean().item()
    assert choice.underflow_at_1 == pytest.approx(direct_1, abs=1e-12)
    assert choice.underflow_at_scale == pytest.approx(direct_s, abs=1e-12)
    assert choice.underflow_at_1 > 0.5 > choice.underflow_at_scale
    assert "underflow" in str(choice)
