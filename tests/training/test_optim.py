"""lowprec's optimizers and the FormatOptimizer wrapper: fp32 equality with torch, 16-bit
write-back, state, the fused kernel."""

import copy

import pytest
import torch
from helpers import small_mlp
from torch import nn

from lowprec import Precision, quantize
from lowprec.training.optim import SGD, Adam, AdamW, FormatOptimizer


def _step_each(pairs, x, y) -> None:
    """One cross-entropy training step of each (model, optimizer) pair on (x, y)."""
    for m, o in pairs:
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()


@pytest.mark.parametrize("ours,theirs,kw", [
    (SGD, torch.optim.SGD, dict(lr=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.0)),
    (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
])
def test_fp32_optimizers_equal_torch_bit_for_bit(ours, theirs, kw, device):
    a, b = small_mlp(0).to(device), small_mlp(0).to(device)
    oa, ob = ours(a.parameters(), **kw), theirs(b.parameters(), **kw)
    x, y = torch.randn(32, 20).to(device), torch.randint(0, 5, (32,)).to(device)
    for _ in range(5):
        _step_each(((a, oa), (b, ob)), x, y)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def _mlp_small_grads(seed=0):
    model = small_mlp(seed, d_in=8, hidden=16, d_out=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, generator=g)
    y = torch.randn(64, 1, generator=g) * 0.01
    return model, x, y


def test_torch_adam_fails_in_pure_fp16_and_lowprec_adam_does_not():
    """eps=1e-8 is 0 in fp16 and g**2 underflows: torch's Adam on fp16 parameters divides by 0."""
    results = {}
    for name, make in [("torch", lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-8)),
                       ("lowprec", lambda ps: Adam(ps, lr=1e-3, eps=1e-8))]:
        model, x, y = _mlp_small_grads()
        prec = Precision("p=fp16,c=fp16,g=fp16,o=fp16,b=native")
        model, opt = prec.setup(model, make(model.parameters()))
        assert next(model.parameters()).dtype == torch.float16
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y) * 1e-3  # small gradients
            prec.backward(loss)
            prec.step(opt)
            losses.append(nn.functional.mse_loss(model(x).float(), y).item())
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        results[name] = (finite, losses)
    assert not results["torch"][0], "torch.optim.Adam in fp16 should have produced Inf/NaN"
    ok, losses = results["lowprec"]
    assert ok and losses[-1] < losses[0]


@pytest.mark.parametrize("opt_cls", [SGD, torch.optim.SGD], ids=["lowprec", "torch"])
@pytest.mark.parametrize("backend", ["native", "emulated"])
def test_bf16_small_lr_nearest_loses_every_update(backend, opt_cls, device):
    """At a learning rate where |lr * g| < ulp(w) / 2 everywhere, nearest rounding changes
    nothing; stochastic and Kahan write-back still lower the loss."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 20).to(device), torch.randn(256, 1).to(device)
    base = nn.Sequential(nn.Linear(20, 1)).to(device)
    with torch.no_grad():
        base[0].weight.fill_(1.0)  # ulp(1) in bf16 is 2**-7
        base[0].bias.fill_(1.0)
    finals = {}
    for update in ["nearest", "stochastic", "kahan"]:
        model = copy.deepcopy(base)
        prec = Precision(f"p=bf16:{update},b={backend}", seed=0)
        model, opt = prec.setup(model, opt_cls(model.parameters(), lr=1e-4))
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(200):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss)
            prec.step(opt)
        finals[update] = nn.functional.mse_loss(model(x).float(), y).item()
        if update == "nearest":
            for p, s in zip(model.parameters(), start):
                assert torch.equal(p, s), "nearest should lose every update"
            first = finals["nearest"]
    assert finals["stochastic"] < first - 1e-3
    assert finals["kahan"] < first - 1e-3


def test_optimizer_state_dict_round_trip_with_master_and_compensation():
    for update, master in [("kahan", None), ("nearest", "fp32")]:
        model = small_mlp(0)
        opt = Adam(model.parameters(), lr=1e-2, param_format="bf16", state_format="bf16",
                   master_format=master, update=update)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(quantize(p, "bf16"))
        x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        key = "master" if master else "compensation"
        st = opt.state_dict()
        assert all(key in s for s in st["state"].values())
        opt2 = Adam(model.parameters(), lr=1e-2, param_format="bf16", state_format="bf16",
                    master_format=master, update=update)
        opt2.load_state_dict(copy.deepcopy(st))
        for p in model.parameters():
            for k, v in opt.state[p].items():
                v2 = opt2.state[p][k]
                assert (torch.equal(v, v2) if torch.is_tensor(v) else v == v2), k
                if torch.is_tensor(v):
                    assert v2.dtype == v.dtype  # fp32 master weights stay fp32
    # the wrapper of a torch optimizer
    model = small_mlp(0)
    fo = FormatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         param_format="fp16", master_format="fp32")
    nn.functional.cross_entropy(model(torch.randn(4, 20)), torch.tensor([0, 1, 2, 3])).backward()
    fo.step()
    st = fo.state_dict()
    fo2 = FormatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                          param_format="fp16", master_format="fp32")
    fo2.load_state_dict(st)
    for a, b in zip(fo.masters, fo2.masters):
        assert torch.equal(a, b)


def test_adam_stores_sqrt_of_second_moment_in_narrow_formats():
    model = small_mlp(0)
    opt = Adam(model.parameters(), lr=1e-3, param_format="fp16", state_format="fp16")
    nn.functional.cross_entropy(model(torch.randn(4, 20)), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    st = opt.state[next(model.parameters())]
    assert "exp_avg_sq_sqrt" in st and st["exp_avg"].dtype == torch.float16
    opt_bf = Adam(small_mlp(0).parameters(), state_format="bf16")
    assert "exp_avg_sq" in opt_bf.state_layout(next(iter(opt_bf.param_groups[0]["params"])))


@pytest.mark.parametrize("cls,kw", [
    (SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (SGD, dict(lr=0.1)),
    (Adam, dict(lr=1e-2, weight_decay=1e-3)),
    (AdamW, dict(lr=1e-2, weight_decay=1e-2)),
])
@pytest.mark.parametrize("dtype,pf,sf", [(torch.bfloat16, None, None), (torch.float16, None, None),
                                         (torch.float32, "fp16", "fp16"),
                                         (torch.float32, "e4m3fn", "bf16")])
def test_fused_cpu_kernel_agrees_with_the_torch_path(cls, kw, dtype, pf, sf):
    """The fused step and the torch-op path implement one per-element definition (see the SGD
    and Adam docstrings; more cases in test_optim_arith.py): the same bits."""
    from lowprec.numerics import kernel as _kernel
    if not _kernel.available():
        pytest.skip("kernel not built")
    w0 = torch.randn(200, 300).to(dtype)
    if pf:
        w0 = quantize(w0, pf)
    res = []
    for fuse in (True, False):
        w = w0.clone()
        opt = cls([w], param_format=pf, state_format=sf, **kw)
        if not fuse:
            opt._can_fuse = lambda p, s: False
        for i in range(4):
            w.grad = (torch.randn(200, 300, generator=torch.Generator().manual_seed(i)) * 0.1
                      ).to(dtype)
            opt.step(grad_scale=0.5)
        res.append(w.float().clone())
        if fuse:
            assert opt._can_fuse(w, opt.state[w])
    assert torch.equal(res[0].view(torch.int32), res[1].view(torch.int32))


def test_a_wrapped_torch_optimizer_keeps_its_state_on_the_state_format():
    """FormatOptimizer rounds a torch optimizer's floating state onto the state format after
    each step (in place): the momentum of torch's own SGD, cast to bf16 and back by torch,
    step after step."""
    model = small_mlp(0)
    ref = copy.deepcopy(model)
    fo = FormatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         state_format="bf16")
    topt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 20, generator=g), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        _step_each(((model, fo), (ref, topt)), x, y)
        for p, q in zip(model.parameters(), ref.parameters()):
            b = topt.state[q]["momentum_buffer"]
            b.copy_(b.to(torch.bfloat16).float())  # the reference's buffer, as stored
            assert fo.state[p]["momentum_buffer"].dtype == torch.float32
            assert torch.equal(fo.state[p]["momentum_buffer"], b)
            assert torch.equal(p, q)
