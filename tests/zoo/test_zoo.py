"""The zoo matrix: every zoo model under every named policy and the issue's extra specs, 20
steps of the documented loop on a fixed batch -- no crash, finite losses, the loss falling;
torch's and lowprec's optimizers, torch's schedulers built before or after setup; and every
analysis on every model with 0 certificate violations.

Run the whole matrix with ``pytest tests/zoo -n 2`` (a few minutes on 2 cores)."""

import math
import types
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from lowprec.analysis import (advise, certify, first_nonfinite, layer_errors,  # noqa: E402
                              lost_updates, range_profile)
from lowprec import Precision  # noqa: E402
from lowprec.training.tree import call_model, output_tensor, slice_batch  # noqa: E402

from runner import OPTIMIZERS, POLICIES, falls, train  # noqa: E402
from zoo import ZOO  # noqa: E402

# (model, policy) cells that raise a documented refusal instead of training: the error type and
# a pattern its message must match
REFUSALS: dict[tuple[str, str], tuple[type, str]] = {}

# Cells the operator-level emulation engine cannot run yet, with the error measured (skipped
# with the reason, visible under -rs; none today). nn.TransformerEncoder's -inf padding mask
# under MX/fp8 matmul policies used to be one: the mask is the additive operand of attention,
# added in the fp32 accumulator and no longer rounded to a block or Inf-less format.
ENGINE_GAPS: dict[tuple[str, str], str] = {}


def skip_engine_gap(model: str, policy: str) -> None:
    reason = ENGINE_GAPS.get((model, policy))
    if reason is not None:
        pytest.skip(f"emulation engine gap, left for its owner: {reason}")


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="transformers")
        yield


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", list(ZOO))
def test_policy_trains_or_refuses(model, policy):
    entry = ZOO[model]
    skip_engine_gap(model, policy)
    if (model, policy) in REFUSALS:
        err, pattern = REFUSALS[(model, policy)]
        with pytest.raises(err, match=pattern):
            train(entry, policy)
        return
    run = train(entry, policy)
    assert falls(run["losses"]), run["losses"]
    assert run["prec"].steps == 20


OPT_POLICIES = ["bf16-true", "16-true", "16-master", "p=bf16:stochastic"]


@pytest.mark.parametrize("policy", OPT_POLICIES)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", ["bert", "resnet", "lstm"])
def test_torch_and_lowprec_optimizers(model, optimizer, policy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train(ZOO[model], policy, optimizer)
    eps_warned = any("eps=" in str(w.message) for w in caught)
    # the warning fires exactly when a torch Adam keeps fp16 state (eps = 1e-8 rounds to 0)
    fp16_state = policy == "16-true" and optimizer.startswith("torch-adam")
    assert eps_warned == fp16_state
    if fp16_state:
        # what the warning says happens: measured on BERT, NaN from step 9 (Adam) or 12
        # (AdamW), where lowprec.optim.Adam trains (1.10 -> 0.19 in 20 steps)
        return
    assert falls(run["losses"]), run["losses"]


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (1 + 0.1 * k)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=20),
}


@pytest.mark.parametrize("when", ["after-setup", "before-setup"])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("policy", ["16-master", "p=bf16:kahan", "bf16-true"])
def test_schedulers_set_the_rate_used(policy, sched, when):
    entry = ZOO["bert"]
    model = entry.build()
    inputs, targets = entry.batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prec = Precision(policy)
    s = SCHEDULERS[sched](opt) if when == "before-setup" else None
    model, opt = prec.setup(model, opt)
    s = s or SCHEDULERS[sched](opt)
    inner = getattr(opt, "optimizer", opt)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        with prec.autocast():
            loss = entry.loss(output_tensor(call_model(model, prec.convert_input(inputs))),
                              targets)
        prec.backward(loss)
        prec.step(opt)
        s.step()
        losses.append(loss.item())
        assert inner.param_groups[0]["lr"] == s.get_last_lr()[0]
    assert falls(losses), losses


def dataset(entry, n=8):
    inputs, targets = entry.batch()
    return types.SimpleNamespace(x_train=inputs, y_train=targets,
                                 x_test=slice_batch(inputs, 0, n), y_test=targets[:n])


@pytest.mark.parametrize("model", list(ZOO))
def test_analyses_run_on_every_zoo_model(model):
    skip_engine_gap(model, "analyses")
    entry = ZOO[model]
    net = entry.build()
    inputs, targets = entry.batch()
    batch = (inputs, targets)
    for fmt in ("fp16", "bf16"):
        cert = certify(net, batch, fmt)
        assert cert.n > 0 and cert.violations == 0, cert
        assert math.isfinite(cert.summary()["delta_max"])
    rows = layer_errors(net, inputs, "bf16")
    assert rows and all(math.isfinite(r.max_abs_error) for r in rows)
    prof = range_profile(net, batch, entry.loss, "fp16")
    assert prof.role("weights") and prof.role("weight_grads")
    lost = lost_updates(net, batch, entry.loss, "bf16", lr=1e-3)
    assert lost and all(0 <= r.nearest <= 1 for r in lost)
    assert first_nonfinite(net, batch, entry.loss, "bf16-true").clean
    advice = advise(net, dataset(entry), "bf16", loss_fn=entry.loss, batches=1, batch_size=8)
    assert advice.certificate.violations == 0 and advice.verdict in ("safe", "needs care",
                                                                      "unsafe")
