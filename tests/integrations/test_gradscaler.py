"""lowprec's GradScaler against PyTorch's own scaling test case (torch/testing/_internal/
common_cuda.py ``_create_scaling_case`` and test/test_cuda.py ``_run_scaling_case``): two
Linear(8, 8), SGD with lr 1, scale 128 grown by 2 every step, an Inf injected into the
gradients at iteration 2; the run with scaling must end with the control run's parameters,
gradients and optimizer state, and the scale 128 * 2**3 * 0.5."""

import io
import warnings

import pytest
import torch

import lowprec
from lowprec.integrations import GradScaler

from helpers import native


def scaling_case(dtype=torch.float32, optimizer_kwargs=None):
    torch.manual_seed(0)
    data = [(torch.randn(8, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)) for _ in range(4)]
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(dtype)
    scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(dtype)
    with torch.no_grad():
        for c, s in zip(control.parameters(), scaling.parameters()):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (control, scaling, torch.optim.SGD(control.parameters(), **kwargs),
            torch.optim.SGD(scaling.parameters(), **kwargs), data, torch.nn.MSELoss(), 2)


def run_plain(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                with torch.no_grad():
                    model[1].weight.grad.fill_(float("inf"))
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if not scaler.is_enabled() or i != skip_iter:
                optimizer.step()


def run_clipping(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    """test_grad_scaling_clipping_separate_unscale: clip the unscaled gradients."""
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                with torch.no_grad():
                    model[1].weight.grad.fill_(float("inf"))
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not scaler.is_enabled() or i != skip_iter:
                optimizer.step()


def run_scaling_case(run, make_scaler, dtype, unskipped=3, skipped=1, optimizer_kwargs=None):
    # torch's tolerances for fp32; fp16 parameters: a few fp16 ulps (eps 2**-10)
    tol = {"atol": 1e-7, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    for enabled in (True, False):
        control, scaling, opt_c, opt_s, data, loss_fn, skip_iter = scaling_case(
            dtype, optimizer_kwargs)
        scaler = make_scaler(enabled)
        run(data, control, opt_c, scaler, loss_fn, skip_iter, False)
        run(data, scaling, opt_s, scaler, loss_fn, skip_iter, True)
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(control.parameters(), scaling.parameters()):
            assert s.dtype == dtype
            torch.testing.assert_close(s.grad, c.grad, **tol)
            for k in opt_c.state[c]:
                torch.testing.assert_close(opt_s.state[s][k], opt_c.state[c][k], **tol)
            torch.testing.assert_close(s, c, **tol)


def ours(policy="32-true"):
    return lambda enabled: GradScaler(policy, init_scale=128.0, growth_factor=2.0,
                                      growth_interval=1, enabled=enabled)


@pytest.mark.parametrize("run", [run_plain, run_clipping], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16-params"])
def test_pytorch_scaling_case(run, dtype):
    run_scaling_case(run, ours(), dtype, optimizer_kwargs={"momentum": 0.9})


def test_the_reference_itself_matches_torch_gradscaler_on_fp32():
    """The same case through torch.amp.GradScaler on the CPU: the harness is torch's."""
    torch_scaler = lambda enabled: torch.amp.GradScaler(  # noqa: E731
        "cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1, enabled=enabled)
    run_scaling_case(run_plain, torch_scaler, torch.float32)


def test_torch_refuses_fp16_gradients_and_lowprec_does_not():
    control, scaling, _, opt_s, data, loss_fn, _ = scaling_case(torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    scaler.scale(loss_fn(scaling(data[0][0]), data[0][1])).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(opt_s)
    mine = GradScaler(init_scale=128.0)
    mine.unscale_(opt_s)  # the gradients above, still scaled by 128
    mine.step(opt_s)
    mine.update()


def test_same_trajectory_as_torch_gradscaler_with_clipping():
    """Bit for bit against torch.amp.GradScaler on fp32 parameters: scale, gradients, weights."""
    _, a, _, opt_a, data, loss_fn, _ = scaling_case()
    _, b, _, opt_b, _, _, _ = scaling_case()
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    mine = GradScaler(init_scale=2.0**16, growth_interval=2)
    for i, (x, y) in enumerate(data * 2):
        for model, opt, sc in ((a, opt_a, ref), (b, opt_b, mine)):
            opt.zero_grad()
            sc.scale(loss_fn(model(x), y) * (1e6 if i == 3 else 1)).backward()
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, error_if_nonfinite=False)
            sc.step(opt)
            sc.update()
        assert mine.get_scale() == ref.get_scale()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_call_order_errors_as_torch():
    _, model, _, opt, data, loss_fn, _ = scaling_case()
    scaler = GradScaler(init_scale=8.0)
    scaler.scale(loss_fn(model(data[0][0]), data[0][1])).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: None)
    scaler.update()


def test_state_dict_round_trips_with_torch_gradscaler():
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_factor=4.0, backoff_factor=0.25,
                               growth_interval=7)
    mine = GradScaler()
    mine.load_state_dict(ref.state_dict())
    assert (mine.get_scale(), mine.get_growth_factor(), mine.get_backoff_factor(),
            mine.get_growth_interval()) == (512.0, 4.0, 0.25, 7)
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(mine.state_dict())
    assert back.get_scale() == 512.0 and back.get_growth_interval() == 7
    assert GradScaler(enabled=False).state_dict() == {}


@pytest.mark.parametrize("policy", ["16-true", "16-master", "p=bf16:kahan"])
def test_scaler_over_lowprec_policies_trains_fp16_params(policy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    scaler = GradScaler(policy, init_scale=2.0**12)
    prec = scaler.precision
    model, opt = scaler.setup(model, lowprec.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        with prec.autocast():
            loss = torch.nn.functional.cross_entropy(model(prec.convert_input(x)).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(map(lambda v: v == v, losses))
    assert prec.steps == 20


# -- torch's constraints; init_scale with a Precision (hostile-tester findings) -----------------

_BAD_SCALER_CALLS = [
    ("update(new_scale=-1)", lambda s: s.update(new_scale=-1.0)),
    ("update(new_scale=0)", lambda s: s.update(new_scale=0.0)),
    ("update(new_scale=nan)", lambda s: s.update(new_scale=float("nan"))),
    ("update(new_scale=inf)", lambda s: s.update(new_scale=float("inf"))),
    ("update(new_scale='8')", lambda s: s.update(new_scale="8")),
    ("update(new_scale=2-element)", lambda s: s.update(new_scale=torch.ones(2))),
    ("set_growth_factor(0.5)", lambda s: s.set_growth_factor(0.5)),
    ("set_growth_factor(1)", lambda s: s.set_growth_factor(1.0)),
    ("set_backoff_factor(1.5)", lambda s: s.set_backoff_factor(1.5)),
    ("set_backoff_factor(0)", lambda s: s.set_backoff_factor(0.0)),
    ("set_growth_interval(0)", lambda s: s.set_growth_interval(0)),
    ("set_growth_interval(2.5)", lambda s: s.set_growth_interval(2.5)),
    ("load_state_dict(scale=nan)", lambda s: s.load_state_dict({"scale": float("nan")})),
    ("load_state_dict(growth_factor=0.1)",
     lambda s: s.load_state_dict({"scale": 8.0, "growth_factor": 0.1})),
    ("load_state_dict(_growth_tracker=-1)",
     lambda s: s.load_state_dict({"scale": 8.0, "_growth_tracker": -1})),
]


@pytest.mark.parametrize("call", [c[1] for c in _BAD_SCALER_CALLS],
                         ids=[c[0] for c in _BAD_SCALER_CALLS])
def test_out_of_range_settings_are_refused_and_change_nothing(call):
    scaler = GradScaler("16-true", init_scale=64.0, growth_interval=3)
    before = {k: v for k, v in scaler.state_dict().items() if k != "lowprec"}
    with pytest.raises(ValueError) as err:
        call(scaler)
    assert "\n" not in str(err.value)
    assert {k: v for k, v in scaler.state_dict().items() if k != "lowprec"} == before


@pytest.mark.parametrize("kwargs", [dict(init_scale=-1.0), dict(init_scale=float("nan")),
                                    dict(growth_factor=0.5), dict(backoff_factor=1.0),
                                    dict(growth_interval=0), dict(growth_interval=1.5)])
def test_constructor_follows_torch_constraints(kwargs):
    with pytest.raises(ValueError):
        GradScaler("16-true", **kwargs)


def test_new_scale_as_a_one_element_tensor_as_torch():
    scaler = GradScaler("16-true")
    scaler.update(new_scale=torch.tensor([4.0]))
    assert scaler.get_scale() == 4.0


def test_init_scale_with_a_precision_starts_there_and_follows_torch():
    """GradScaler(Precision(...), init_scale=8.0) used to keep the policy's 2**16."""
    assert GradScaler(lowprec.Precision("16-mixed"), init_scale=8.0).get_scale() == 8.0
    finfo = torch.finfo(torch.float32)
    prec = lowprec.Precision("32-true", loss_scale=lowprec.training.loss_scale.DynamicLossScale(
        min=finfo.tiny, max=finfo.max))
    mine = GradScaler(prec, init_scale=8.0, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    _, a, _, opt_a, data, loss_fn, _ = scaling_case()
    _, b, _, opt_b, _, _, _ = scaling_case()
    for i, (x, y) in enumerate(data * 2):
        for model, opt, sc in ((a, opt_a, ref), (b, opt_b, mine)):
            opt.zero_grad()
            sc.scale(loss_fn(model(x), y) * (1e38 if i == 3 else 1)).backward()
            sc.step(opt)
            sc.update()
        assert mine.get_scale() == ref.get_scale()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("policy", ["32-true", "p=fp16,ls=static:64"])
def test_init_scale_with_a_precision_without_dynamic_scale_is_refused(policy):
    with pytest.raises(ValueError, match="not dynamic"):
        GradScaler(lowprec.Precision(policy), init_scale=8.0)
    GradScaler(lowprec.Precision(policy))  # no scale argument: its own loss scale


# -- torch's signature, the set-up warning, autocast, a float32 scale (issue 22) ---------------

def lockstep(ref, mine, steps, factor=lambda i: 1.0):
    """Train two copies of torch's scaling case, one under each scaler, comparing the scale
    and every weight after each step; ``factor(i)`` multiplies the loss of step i."""
    _, a, _, opt_a, data, loss_fn, _ = scaling_case()
    _, b, _, opt_b, _, _, _ = scaling_case()
    scales = []
    for i in range(steps):
        x, y = data[i % len(data)]
        for model, opt, sc in ((a, opt_a, ref), (b, opt_b, mine)):
            opt.zero_grad()
            sc.scale(loss_fn(model(x), y) * factor(i)).backward()
            sc.step(opt)
            sc.update()
        assert mine.get_scale() == ref.get_scale(), (i, mine.get_scale(), ref.get_scale())
        scales.append(ref.get_scale())
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), i
    return scales


def test_torchs_signature_device_first():
    for device in ("cuda", "cpu", "cuda:1", "xpu", "mps", torch.device("cpu")):
        s = GradScaler(device)
        assert s.device == torch.device(device) and str(s.precision.policy) == "32-true"
    s = GradScaler("cpu", 2.0**10, 4.0, 0.25, 7, True)  # torch's positional order
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(),
            s.get_growth_interval(), s.is_enabled()) == (1024.0, 4.0, 0.25, 7, True)
    s = GradScaler(device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                   growth_interval=2000, enabled=True)
    assert s.get_scale() == 2.0**16 and s.device.type == "cuda"
    assert GradScaler().device == torch.device("cuda")  # torch's default
    s = GradScaler("cuda", policy="16-true")
    assert str(s.precision.policy) == "16-true"
    assert repr(s) == "GradScaler('cuda', policy='16-true', scale=65536, enabled=True)"
    # the earlier signature: a policy first
    s = GradScaler("16-true", init_scale=8.0)
    assert str(s.precision.policy) == "16-true" and s.device is None and s.get_scale() == 8.0
    prec = lowprec.Precision("16-mixed")
    assert GradScaler(prec).precision is prec
    assert GradScaler("cpu", policy=prec).precision is prec
    with pytest.raises(TypeError, match="policy twice"):
        GradScaler("16-true", policy="bf16-true")
    with pytest.raises(TypeError, match=r"policy is a keyword.*policy='16-true'"):
        GradScaler("cuda", "16-true")
    with pytest.raises(ValueError, match="unknown policy 'cuda0'"):
        GradScaler("cuda0")  # not a device torch knows: read as a policy, refused as one
    with pytest.raises(TypeError, match="device"):
        GradScaler(3)


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 8), \
        torch.randint(0, 4, (32,))


def _loop(scaler, model, opt, x, y, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        with scaler.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_a_policy_without_setup_warns_once():
    model, opt, x, y = _tiny()
    scaler = GradScaler("cpu", policy="16-true")
    with pytest.warns(UserWarning, match="no model was set up") as caught:
        _loop(scaler, model, opt, x, y)
    assert len([w for w in caught if "no model was set up" in str(w.message)]) == 1
    for scaler in (GradScaler("cpu"), GradScaler("cpu", policy="16-true")):
        model, opt, x, y = _tiny()
        if str(scaler.precision.policy) != "32-true":
            model, opt = scaler.setup(model, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _loop(scaler, model, opt, x, y)
        assert scaler.precision.steps == 3


def test_autocast_runs_the_policy_as_torch_autocast_runs():
    # 16-mixed on the CPU: emulated, a linear layer's output on the fp16 grid inside only
    model, opt, x, y = _tiny()
    scaler = GradScaler("cpu", policy="16-mixed")
    model, opt = scaler.setup(model, opt)
    with scaler.autocast():
        inside = model[0](x)
    with scaler.autocast("cpu", dtype=torch.float16, cache_enabled=True):
        again = model[0](x)
    with scaler.autocast(enabled=False):
        outside = model[0](x)
    assert torch.equal(inside, lowprec.quantize(inside, "fp16")) and torch.equal(inside, again)
    assert not torch.equal(outside, lowprec.quantize(outside, "fp16"))
    with pytest.raises(ValueError, match="computes in fp16"):
        scaler.autocast(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="on cpu"):
        scaler.autocast("cuda")
    # bf16-mixed run natively on the CPU: torch.autocast itself
    model, opt, x, y = _tiny()
    scaler = GradScaler("cpu", policy=native("bf16-mixed"))
    model, opt = scaler.setup(model, opt)
    with scaler.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    with scaler.autocast():
        out = model(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    _loop(scaler, model, opt, x, y)
    # fp32: nothing to do, as torch's loop with autocast left out
    with GradScaler("cpu").autocast():
        assert model[0](x).dtype == torch.float32


def test_scale_at_the_top_of_float32_follows_torch():
    """2**127 * 2 is Inf in float32: torch keeps 2**127 (a double would have grown, clamped
    to float32's max 3.4028e38)."""
    kw = dict(init_scale=2.0**127, growth_interval=1)
    scales = lockstep(torch.amp.GradScaler("cpu", **kw), GradScaler("cpu", **kw), 6,
                      factor=lambda i: 1e-30 if i < 3 else 1e3)
    assert scales[0] == 2.0**127  # grown to Inf: not applied
    assert scales[-1] < 2.0**127  # the larger losses overflowed and backed off


@pytest.mark.parametrize("growth,backoff,init", [(1.7, 0.3, 3.0), (1.1, 0.9, 1000.1),
                                                 (3.0, 0.7, 2.0**-100)])
def test_non_power_of_two_factors_follow_torch_in_float32(growth, backoff, init):
    kw = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=1)
    scales = lockstep(torch.amp.GradScaler("cpu", **kw), GradScaler("cpu", **kw), 24,
                      factor=lambda i: 1e38 if i % 5 == 4 else 1.0)
    # the same steps in double arithmetic leave torch's float32 values: the test can tell
    double, ref = init, []
    for i in range(24):
        double = double * backoff if i % 5 == 4 else double * growth
        ref.append(double)
    assert any(s != d for s, d in zip(scales, ref))


def test_loss_scale_rounds_to_float32_as_torchs_kernel():
    from lowprec.training.loss_scale import DynamicLossScale, to_f32

    ls = DynamicLossScale(init=2.0**127, growth=2.0, interval=1, max=torch.finfo().max)
    ls.update(False)
    assert ls.scale == 2.0**127  # Inf in float32: not applied
    scale = torch.full((), 2.0**127)
    torch._amp_update_scale_(scale, torch.zeros((), dtype=torch.int32), torch.zeros(()),
                             2.0, 0.5, 1)
    assert scale.item() == 2.0**127
    assert DynamicLossScale(init=0.1).scale == to_f32(0.1) != 0.1
    with pytest.raises(ValueError, match="float32"):
        DynamicLossScale(init=1e39, max=1e39)


def test_scaler_state_does_not_grow_from_step_10_to_100():
    model, opt, x, y = _tiny()
    scaler = GradScaler("cpu", policy="16-true", init_scale=2.0**10, growth_interval=7)
    model, opt = scaler.setup(model, opt)
    sizes = {}
    for step in range(1, 101):
        _loop(scaler, model, opt, x, y, steps=1)
        if step in (10, 100):
            buf = io.BytesIO()
            torch.save(scaler.state_dict(), buf)
            sizes[step] = len(buf.getvalue())
    assert sizes[10] == sizes[100], sizes
    assert len(scaler.precision.trace) == 100  # kept in memory, whole


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, [], 0.0])
def test_enabled_takes_a_bool_only(value):
    """enabled="no" is truthy: it would turn the scaler on. A switch is True or False."""
    with pytest.raises(TypeError, match=r"enabled=.* is not a bool; accepted: True, False"):
        GradScaler(enabled=value)
    with pytest.raises(TypeError, match="is not a bool"):
        with GradScaler().autocast(enabled=value):
            pass
    assert GradScaler(enabled=False).is_enabled() is False
