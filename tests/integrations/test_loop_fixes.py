"""The bugs a new user met with real models and torch's own optimizers and schedulers
(issue 11), each checked against torch's own behaviour."""

import copy
import warnings

import pytest
import torch
from torch import nn

import lowprec
from lowprec import Precision
from lowprec.analysis import certify, first_nonfinite, layer_errors, low_precision_copy
from lowprec.analysis.common import run_model
from lowprec.training.regimes.binary import FeatureBatchNorm

from helpers import assert_same_bits, native


def mlp(seed=0, d_in=6, d_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, d_out))


def batch(seed=1, n=8, d_in=6, classes=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)


TORCH_OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True),
}


@pytest.mark.parametrize("policy", ["16-master", "p=bf16:kahan", "p=bf16:stochastic"])
def test_adamw_sets_up_under_wrapping_policies(policy):
    """The issue's one-liner: AdamW was rebuilt from its defaults and rejected its own
    decoupled_weight_decay key."""
    m = nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), weight_decay=0.05)
    keys = set(opt.param_groups[0])
    _, wrapped = Precision(policy).setup(m, opt)
    assert isinstance(wrapped, torch.optim.Optimizer)
    assert set(wrapped.param_groups[0]) == keys  # every group key kept
    assert wrapped.param_groups[0]["weight_decay"] == 0.05


@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_fp32_master_weights_follow_torch_bit_for_bit(name):
    """With fp32 parameters and fp32 master weights the wrapper steps the user's own optimizer
    object on the masters: the trajectory equals plain torch's, bit for bit."""
    x, y = batch()
    ref, mine = mlp(), mlp()
    opt_ref = TORCH_OPTIMIZERS[name](ref.parameters())
    prec = Precision("p=fp32,m=fp32")
    mine, opt = prec.setup(mine, TORCH_OPTIMIZERS[name](mine.parameters()))
    assert opt.masters is not None
    for _ in range(4):
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        prec.backward(nn.functional.cross_entropy(mine(x), y))
        prec.step(opt)
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert_same_bits(a, b, name)


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + k)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_schedulers_drive_the_rate_actually_used(sched, when):
    """A scheduler built on the user's optimizer before setup, or on the returned one after,
    sets the rate of the update: the run equals plain torch with the same scheduler."""
    x, y = batch()
    ref, mine = mlp(), mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    s_ref = SCHEDULERS[sched](opt_ref)
    prec = Precision("p=fp32,m=fp32")
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    s = SCHEDULERS[sched](opt) if when == "before" else None
    mine, opt = prec.setup(mine, opt)
    s = s or SCHEDULERS[sched](opt)
    for _ in range(6):
        for model, o, sc, step in ((ref, opt_ref, s_ref, None), (mine, opt, s, prec)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if step is None:
                loss.backward()
                o.step()
            else:
                step.backward(loss)
                step.step(o)
            sc.step()
        assert s.get_last_lr() == s_ref.get_last_lr()
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert_same_bits(a, b, f"{sched} {when}")


@pytest.mark.parametrize("policy", ["16-master", "p=bf16:stochastic", "16-true"])
def test_scheduler_rate_reaches_low_precision_wrappers(policy):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    prec = Precision(policy, loss_scale="static:8")
    m, o = prec.setup(m, opt)
    x, y = batch()
    for _ in range(3):
        o.zero_grad()
        prec.backward(nn.functional.cross_entropy(m(prec.convert_input(x)).float(), y))
        assert prec.step(o)
        sched.step()
    inner = getattr(o, "optimizer", o)
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-4) == sched.get_last_lr()[0]


class KwargsNet(nn.Module):
    """Keyword and nested inputs, an integer mask; a dict output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x, *, extra, mask):
        assert mask.dtype == torch.int64
        h = torch.relu(self.a(x) + extra["shift"][0])
        return {"logits": self.b(h) * mask[:, None], "hidden": h}


@pytest.mark.parametrize("policy", ["bf16-true", "p=fp16,b=native"])
def test_native_policies_cast_kwargs_and_nested_containers(policy):
    model = KwargsNet()
    prec = Precision(native(policy))
    model, _ = prec.setup(model)
    x, _ = batch()
    extra = {"shift": [torch.randn(8)]}
    mask = torch.ones(8, dtype=torch.int64)
    out = model(x, extra=extra, mask=mask)  # crashed: mat1 and mat2 must have the same dtype
    assert out["logits"].dtype == model.a.weight.dtype != torch.float32
    conv = prec.convert_input({"x": x, "extra": extra, "mask": mask})
    assert conv["x"].dtype == model.a.weight.dtype and conv["mask"].dtype == torch.int64
    assert conv["extra"]["shift"][0].dtype == model.a.weight.dtype


class Ids(nn.Module):
    """A token classifier that records the ids it was given."""

    def __init__(self, vocab=30000, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, 5)
        self.seen = []

    def forward(self, input_ids):
        self.seen.append(input_ids.clone())
        return (self.head(self.emb(input_ids).mean(1)), "extra")  # a tuple output


@pytest.mark.parametrize("fmt,backend", [("fp16", "emulated"), ("bf16", "native")])
def test_certify_leaves_token_ids_unchanged(fmt, backend):
    torch.manual_seed(0)
    model = Ids()
    ids = torch.randint(29000, 30000, (64, 7))  # fp16 holds integers exactly only up to 2048
    cert = certify(model, (ids, None), fmt, backend=backend)
    assert cert.n == 64 and cert.violations == 0
    # the 16-bit twin certify runs receives the ids as given
    twin, prec = low_precision_copy(model, fmt, backend)
    twin.seen.clear()
    run_model(twin, prec.convert_input(ids))
    assert twin.seen[0].dtype == torch.int64 and torch.equal(twin.seen[0], ids)
    assert len(layer_errors(model, ids, fmt, backend=backend)) >= 2


def test_outputs_in_dicts_tuples_and_output_fn():
    model = KwargsNet()
    x, y = batch()
    inputs = {"x": x, "extra": {"shift": [torch.zeros(8)]}, "mask": torch.ones(8, dtype=torch.long)}
    cert = certify(model, (inputs, y), "bf16")
    assert cert.n == 8 and cert.violations == 0
    ref = model(**inputs)["logits"]
    cert2 = certify(model, (inputs, y), "bf16", output_fn=lambda o: o["logits"])
    assert (cert.pred32 == ref.argmax(1).numpy()).all() and (cert2.pred32 == cert.pred32).all()
    rep = first_nonfinite(model, (inputs, y), nn.functional.cross_entropy, "bf16-true")
    assert rep.clean
    with pytest.raises(TypeError, match="output_fn"):
        certify(model, (inputs, y), "bf16", output_fn=lambda o: "not a tensor")


def test_modeloutput_is_read_by_its_logits():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import SequenceClassifierOutput

    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            return SequenceClassifierOutput(loss=None, logits=self.lin(x), hidden_states=(x,))

    x, y = batch()
    cert = certify(HF(), (x, y), "fp16")
    assert cert.n == 8 and cert.violations == 0
    assert first_nonfinite(HF(), (x, y), nn.functional.cross_entropy, "16-true").clean


def test_feature_batchnorm_equals_torch_batchnorm_over_tokens():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8) * 3 + 1
    ours = FeatureBatchNorm(8)
    ref = nn.BatchNorm1d(8)  # (N, C, L): statistics over N and L per channel
    torch.testing.assert_close(ours(x), ref(x.transpose(1, 2)).transpose(1, 2))
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)


def test_binary_trains_on_token_sequences():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    x = torch.randn(16, 5, 8)
    y = torch.randint(0, 3, (16, 5))
    prec = Precision("binary", seed=0)
    model, opt = prec.setup(model, lowprec.optim.Adam(model.parameters(), lr=1e-2))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))
        prec.backward(loss)
        prec.step(opt)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_torch_adam_with_fp16_state_warns_once_naming_lowprec_adam():
    """At its first step, where the state and the gradients are known
    (tests/training/test_torch_adam_warning.py has the cases)."""
    m = mlp()
    prec = Precision("16-true")
    m, opt = prec.setup(m, torch.optim.Adam(m.parameters()))
    x, y = batch()
    with pytest.warns(lowprec.optim.OptimizerPrecisionWarning,
                      match=r"lowprec\.optim\.Adam") as rec:
        opt.zero_grad()
        prec.backward(nn.functional.cross_entropy(m(x), y))
        prec.step(opt)
    assert len([w for w in rec if "eps" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning while training
        opt.zero_grad()
        prec.backward(nn.functional.cross_entropy(m(x), y))
        prec.step(opt)
        for policy, make in (("bf16-true", torch.optim.Adam),  # 1e-8 is a normal bf16 number
                             ("16-true", lowprec.optim.Adam),
                             ("16-master", torch.optim.AdamW)):  # fp32 master state
            mm = mlp()
            pp = Precision(policy)
            mm, o = pp.setup(mm, make(mm.parameters()))
            o.zero_grad()
            pp.backward(nn.functional.cross_entropy(mm(pp.convert_input(x)).float(), y))
            pp.step(o)


def test_optimizer_setup_never_saw_is_refused():
    m = mlp()
    prec = Precision("16-true")
    m, opt = prec.setup(m, lowprec.optim.SGD(m.parameters(), lr=0.1))
    late = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = batch()
    prec.backward(nn.functional.cross_entropy(m(x), y))
    with pytest.raises(ValueError, match="never saw"):
        prec.step(late)
    late = prec.setup_optimizer(late)
    assert prec.step(late)
    # the object given to setup, when setup wrapped it
    m2 = mlp()
    prec2 = Precision("16-master")
    given = torch.optim.AdamW(m2.parameters())
    m2, _ = prec2.setup(m2, given)
    prec2.backward(nn.functional.cross_entropy(m2(x), y))
    with pytest.raises(ValueError, match="returned"):
        prec2.step(given)


def test_step_without_gradients_warns_and_is_not_counted():
    m = mlp()
    prec = Precision("bf16-true")
    m, opt = prec.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))
    before = copy.deepcopy(m.state_dict())
    with pytest.warns(UserWarning, match="no gradients"):
        assert prec.step(opt) is False
    assert prec.steps == 0 and prec.trace == []
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
