"""Checkpoints of emulated policies hold what a native run stores: 16-bit parameters, buffers and
optimizer state as fp16/bf16 tensors, fp8 as float8; loading them back gives every bit, and
training continues as if never interrupted."""

import io

import pytest
import torch
from helpers import native, small_cnn, train_steps
from torch import nn

from lowprec import Precision
from lowprec.training.optim import SGD


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 1, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)


def _run(policy, make_opt, steps, state=None):
    prec = Precision(policy, seed=0)
    model = small_cnn()
    model, opt = prec.setup(model, make_opt(model))
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        prec.load_state_dict(state["precision"])
    x, y = _data()
    train_steps(prec, model, opt, x, y, steps)
    return prec, model, opt


POLICIES = [
    # (policy, optimizer, parameter dtype in the file, optimizer-state dtype in the file)
    ("16-true", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
     torch.float16, torch.float16),
    ("16-true", lambda m: SGD(m.parameters(), lr=0.05, momentum=0.9), torch.float16,
     torch.float16),
    ("p=bf16,c=bf16,g=bf16,o=bf16,b=emulated", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
     torch.bfloat16, torch.bfloat16),
    ("p=e4m3fn,c=e4m3fn,g=e5m2,o=e5m2,ls=static:256",
     lambda m: SGD(m.parameters(), lr=0.05, momentum=0.9), torch.float8_e4m3fn,
     torch.float8_e5m2),
]


@pytest.mark.parametrize("policy,make_opt,pdtype,sdtype", POLICIES,
                         ids=["16-true-torch-sgd", "16-true-lowprec-sgd", "bf16-emulated",
                              "fp8"])
def test_checkpoint_in_storage_dtypes_resumes_bit_for_bit(policy, make_opt, pdtype, sdtype):
    straight, m_straight, o_straight = _run(policy, make_opt, 6)
    prec, model, opt = _run(policy, make_opt, 3)
    sd = prec.checkpoint_state_dict()
    for name, t in sd.items():  # BatchNorm's running statistics too; its counter stays int64
        want = torch.int64 if name.endswith("num_batches_tracked") else pdtype
        assert t.dtype == want, name
        assert torch.equal(t.float(), model.state_dict()[name].float()), name
    osd = opt.state_dict()
    inner = osd["optimizer"] if "optimizer" in osd else osd
    assert {v.dtype for s in inner["state"].values() for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0} == {sdtype}
    # the tensors' bytes: half the fp32 carriers' (a quarter for fp8)
    floating = [k for k, t in sd.items() if t.is_floating_point()]
    saved = sum(sd[k].numel() * sd[k].element_size() for k in floating)
    carried = sum(model.state_dict()[k].numel() * 4 for k in floating)
    assert saved * 4 == carried * pdtype.itemsize
    state = {"model": sd, "optimizer": osd, "precision": prec.state_dict()}
    state = torch.load(io.BytesIO(_bytes(state)), weights_only=False)
    resumed, m_resumed, o_resumed = _run(policy, make_opt, 3, state)
    for a, b in zip(m_straight.state_dict().values(), m_resumed.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the optimizer state is held as before (float32 carriers, or 16-bit where lowprec's
    # optimizers keep it): same dtypes and values as the uninterrupted run's
    sa = [v for s in o_straight.state.values() for v in s.values() if torch.is_tensor(v)]
    sb = [v for s in o_resumed.state.values() for v in s.values() if torch.is_tensor(v)]
    assert [v.dtype for v in sa] == [v.dtype for v in sb]
    assert all(torch.equal(a, b) for a, b in zip(sa, sb))
    assert resumed.steps == straight.steps == 6


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_tied_weights_stay_one_tensor_and_fp32_parts_stay_fp32():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(50, 8)
            self.norm = nn.LayerNorm(8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.norm(self.emb(ids)))

    prec = Precision("16-true", overrides={"norm": "32-true"})
    model, _ = prec.setup(Tied())
    sd = prec.checkpoint_state_dict()
    assert sd["emb.weight"] is sd["head.weight"] and sd["emb.weight"].dtype == torch.float16
    assert sd["norm.weight"].dtype == torch.float32  # a per-module override keeps fp32
    assert sd._metadata == model.state_dict()._metadata  # load_state_dict's versions


@pytest.mark.parametrize("policy", ["32-true", "bf16-true", "16-mixed"])
def test_native_and_fp32_tensors_are_left_as_they_are(policy):
    prec = Precision(native(policy) if policy == "bf16-true" else policy)
    model, _ = prec.setup(small_cnn())
    sd = model.state_dict()
    out = prec.checkpoint_state_dict(sd)
    assert all(out[k] is v for k, v in sd.items())


def test_checkpoint_state_dict_needs_a_model():
    with pytest.raises(RuntimeError, match="setup"):
        Precision("16-true").checkpoint_state_dict()


def test_checkpoint_state_dict_given_the_model_says_it_takes_a_state_dict():
    """A new user passed the model itself: an AttributeError from deep inside ('ResNet' object
    has no attribute 'items') before; now a TypeError naming what it takes."""
    prec = Precision("16-true")
    model, _ = prec.setup(small_cnn())
    with pytest.raises(TypeError, match="takes a state_dict .* not a Sequential"):
        prec.checkpoint_state_dict(model)


def test_a_scheduler_on_the_wrapper_still_drives_the_rate_after_loading():
    """torch's load_state_dict replaces the wrapped optimizer's param_groups: the wrapper shares
    the new ones (it kept the old list, which no step read any more)."""
    prec, model, opt = _run("16-true", POLICIES[0][1], 2)
    state = opt.state_dict()
    prec2 = Precision("16-true")
    model2 = small_cnn()
    model2, opt2 = prec2.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.05,
                                                       momentum=0.9))
    opt2.load_state_dict(state)
    sched = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    x, y = _data()
    train_steps(prec2, model2, opt2, x, y, 1)
    sched.step()
    assert opt2.optimizer.param_groups[0]["lr"] == 0.025
    assert opt2.state is opt2.optimizer.state and len(opt2.state) == len(state["optimizer"][
        "state"])
