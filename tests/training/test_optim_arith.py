"""One optimizer arithmetic: the fused C step, the torch path and the written definition agree.

The definition is the operation sequence in the docstrings of ``SGD`` and ``Adam``
(lowprec/training/optim/sgd.py, adam.py): float32 operations, each correctly rounded, with
fused multiply-adds where torch's CPU kernels fuse. Every operation of it is correctly rounded in
both implementations (fmaf / torch's vec::fmadd, IEEE +, -, *, /, and a correctly rounded sqrt on
both sides), so the fused kernel and the torch path must give the same bits, state included: the
tests allow no unit in the last place. The references nobody here wrote: exact rational
arithmetic (``fractions``) for the fused multiply-adds, numpy's IEEE float32 square root and
float16 cast, ml_dtypes' bfloat16 cast.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from helpers import assert_same_bits
from lowprec import parse_format, quantize
from lowprec.numerics import kernel
from lowprec.training.memory import optimizer_bytes
from lowprec.training.optim import SGD, Adam, AdamW, FormatOptimizer
from lowprec.training.optim.base import sqrt_rn

OPTIMIZERS = {
    "sgd": (SGD, dict(lr=0.1)),
    "sgd-momentum-wd": (SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    "sgd-dampening": (SGD, dict(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=3e-2)),
    "sgd-nesterov-wd": (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    "adam": (Adam, dict(lr=1e-2)),
    "adam-l2": (Adam, dict(lr=1e-2, weight_decay=1e-3)),
    "adamw": (AdamW, dict(lr=1e-2, weight_decay=1e-2)),
    # beta1 < 0.5: torch.lerp's weight 1 - beta1 >= 0.5 takes its other branch
    "adam-beta1-0.3": (Adam, dict(lr=3e-3, betas=(0.3, 0.99), eps=1e-6)),
}
# (parameter dtype, parameter format, state format): native 16-bit tensors, emulated formats on
# float32 carriers (e5m2 state: Adam stores sqrt(v)), fixed point, fp32 state, and fp32
# parameters (which keep every float32 bit of the update) with bf16 state
STORAGE = {
    "fp32+bf16": (torch.float32, None, "bf16"),
    "fp16": (torch.float16, None, None),
    "bf16": (torch.bfloat16, None, None),
    "e5m2": (torch.float32, "e5m2", "e5m2"),
    "q6.10+bf16": (torch.float32, "q6.10", "bf16"),
    "bf16+fp32": (torch.bfloat16, None, "fp32"),
    # float32 carriers of float16 / bfloat16 values (emulation's parameters): SGD's whole
    # vectors take the kernel's one-loop path (sgd_f32_fast), the partial one its tiles
    "fp16-in-fp32": (torch.float32, "fp16", "fp16"),
    "bf16-in-fp32": (torch.float32, "bf16", "bf16"),
}
SHAPE = (37, 301)  # 11137 elements: the kernel's tiles are 256, the last one partial
BIG = (229, 307)  # 70303 elements: split between threads (2**15 or more each)


@functools.lru_cache(maxsize=None)
def _grads(step: int, shape=SHAPE) -> torch.Tensor:
    """Gradients over six decades (subnormal moments in fp16, underflow in e5m2)."""
    g = torch.Generator().manual_seed(100 + step)
    scale = torch.pow(10.0, -torch.randint(0, 7, shape, generator=g).float())
    return torch.randn(shape, generator=g) * scale


def _run(cls, kw, dtype, pf, sf, update, fuse: bool, steps: int = 3, shape=SHAPE,
         layout=torch.contiguous_format):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    w = (quantize(w, pf) if pf else w).to(dtype).contiguous(memory_format=layout)
    opt = cls([w], param_format=pf, state_format=sf, update=update,
              generator=torch.Generator().manual_seed(11), **kw)
    if not fuse:
        opt._can_fuse = lambda p, s: False
    for i in range(steps):
        # (laid out as the parameter, as autograd lays out a dense parameter's gradient)
        w.grad = _grads(i, shape).to(dtype, copy=True).contiguous(memory_format=layout)
        opt.step(grad_scale=0.37)
        if fuse:
            assert opt._can_fuse(w, opt.state[w]), "the fused kernel did not run"
    return w, opt.state[w]


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("update", ["nearest", "stochastic"])
@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_step_equals_torch_path_bit_for_bit(name, storage, update):
    """Three steps with grad_scale: parameters and every state tensor, bit for bit (zero units
    in the last place of the storage format; see the module docstring for why none is needed).
    Stochastic write-back draws one seed per tensor per step from the optimizer's generator on
    both paths and hashes the element index with it, so it too is bit-identical."""
    cls, kw = OPTIMIZERS[name]
    dtype, pf, sf = STORAGE[storage]
    w_f, st_f = _run(cls, kw, dtype, pf, sf, update, fuse=True)
    w_t, st_t = _run(cls, kw, dtype, pf, sf, update, fuse=False)
    assert w_f.dtype == w_t.dtype == dtype
    assert_same_bits(w_f, w_t, f"{name} {storage} {update}: parameter")
    assert st_f.keys() == st_t.keys()
    for key, val in st_f.items():
        if torch.is_tensor(val):
            assert val.dtype == st_t[key].dtype, key
            assert_same_bits(val, st_t[key], f"{name} {storage} {update}: {key}")
        else:
            assert val == st_t[key], key


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("storage", ["fp32+bf16", "fp16", "e5m2", "q6.10+bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_step_of_a_channels_last_weight_equals_torch_path(name, storage):
    """A channels-last convolution weight (its gradient and state laid out as it is) takes the
    fused kernel over its memory as it lies, rounding to nearest: parameters and state bit for
    bit the torch path's. Stochastic write-back keeps the torch path there (its random bits
    follow logical indices), and so does a state tensor of another layout (a checkpoint of a
    contiguous model): the kernel would pair a value with another's state."""
    cls, kw = OPTIMIZERS[name]
    dtype, pf, sf = STORAGE[storage]
    shape, cl = (16, 6, 5, 5), torch.channels_last
    w_f, st_f = _run(cls, kw, dtype, pf, sf, "nearest", fuse=True, shape=shape, layout=cl)
    w_t, st_t = _run(cls, kw, dtype, pf, sf, "nearest", fuse=False, shape=shape, layout=cl)
    assert w_f.is_contiguous(memory_format=cl) and not w_f.is_contiguous()
    assert_same_bits(w_f, w_t, f"{name} {storage}: parameter")
    for key, val in st_f.items():
        if torch.is_tensor(val):
            assert_same_bits(val, st_t[key], f"{name} {storage}: {key}")
    opt = cls([w_f], param_format=pf, state_format=sf, update="stochastic", **kw)
    assert not opt._can_fuse(w_f, {})
    moved = {k: (v.contiguous() if torch.is_tensor(v) and v.dim() else v)
             for k, v in st_f.items()}
    if any(torch.is_tensor(v) and v.dim() for v in moved.values()):
        assert not cls([w_f], param_format=pf, state_format=sf, **kw)._can_fuse(w_f, moved)


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam-l2"])
def test_fused_step_split_between_threads_equals_torch_path(name):
    """A tensor large enough for the kernel to split it between threads (shares aligned to its
    tiles; stochastic bits hashed from the element's index, not the thread's). Two threads are
    asked for on any machine (the kernel takes the count from torch): before, the test was
    skipped where torch ran one thread (a one-core runner, OMP_NUM_THREADS=1)."""
    cls, kw = OPTIMIZERS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        w_f, st_f = _run(cls, kw, torch.float16, None, None, "stochastic", fuse=True, shape=BIG)
    finally:
        torch.set_num_threads(threads)
    w_t, st_t = _run(cls, kw, torch.float16, None, None, "stochastic", fuse=False, shape=BIG)
    assert_same_bits(w_f, w_t, f"{name}: parameter")
    for key, val in st_f.items():
        if torch.is_tensor(val):
            assert_same_bits(val, st_t[key], f"{name}: {key}")


def test_sqrt_rn_is_the_correctly_rounded_float32_root():
    """Against numpy's float32 sqrt (IEEE 754 squareRoot, the hardware instruction), on random
    bit patterns over every exponent, subnormals included, and the extremes."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (400_000,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, torch.tensor([0, 1, 2, 0x007FFFFF, 0x00800000, 0x7F7FFFFF])])
    x = bits.to(torch.int32).view(torch.float32)
    assert_same_bits(sqrt_rn(x), torch.from_numpy(np.sqrt(x.numpy())), "sqrt_rn")


# -- the written definition against exact arithmetic -------------------------------------------

def _f32(q: Fraction) -> np.float32:
    """The rational q rounded to float32, to nearest, ties to even (exact: the candidates
    around float(q) are compared with q as rationals)."""
    d = np.float32(float(q))
    cands = [np.nextafter(d, np.float32(-np.inf)), d, np.nextafter(d, np.float32(np.inf))]
    dist = [abs(Fraction(float(c)) - q) for c in cands]
    best = min(dist)
    ties = [c for c, dd in zip(cands, dist) if dd == best]
    return min(ties, key=lambda c: int(np.array(c).view(np.int32)) & 1)


def fma(a, b, c) -> np.ndarray:
    """a * b + c rounded once to float32, elementwise (exact rational arithmetic)."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, dtype=np.float32) for v in (a, b, c)))
    return np.array([_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a.ravel(), b.ravel(), c.ravel())],
                    dtype=np.float32).reshape(a.shape)


def _arrays(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g) * 10.0 ** -torch.randint(0, 5, (n,), generator=g)
    b = torch.randn(n, generator=g)
    return a, b, a.numpy(), b.numpy()


def test_torch_cpu_ops_are_the_fused_multiply_adds_of_the_definition():
    """The torch path relies on these identities (torch's vec::fmadd); a torch build that
    computes them otherwise fails here, not silently in the bit-identity test."""
    a, b, A, B = _arrays()
    f = np.float32
    assert_same_bits(a.add(b, alpha=0.37), torch.from_numpy(fma(B, f(0.37), A)), "add alpha")
    assert_same_bits(a.clone().mul_(0.9).add_(b, alpha=0.7),
                     torch.from_numpy(fma(B, f(0.7), A * f(0.9))), "mul_ add_")
    for wt in (0.1, 0.7):
        wf = f(wt)
        expected = fma(wf, B - A, A) if wt < 0.5 else fma(wf - f(1), B - A, B)
        assert_same_bits(a.clone().lerp_(b, wt), torch.from_numpy(expected), f"lerp {wt}")
    assert_same_bits(a.clone().addcmul_(b, b, value=1e-3),
                     torch.from_numpy(fma(f(1e-3) * B, B, A)), "addcmul")
    d = b.abs() + 0.5
    assert_same_bits(a.addcdiv(b, d, value=-0.01),
                     torch.from_numpy(A + (f(-0.01) * B) / d.numpy()), "addcdiv")


def _round_state(x: np.ndarray, fmt: str) -> np.ndarray:
    dt = np.float16 if fmt == "fp16" else ml_dtypes.bfloat16
    return x.astype(dt).astype(np.float32)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_adam_torch_path_is_the_written_definition(fmt):
    """Two steps of Adam with L2 decay, fp16 (sqrt(v) stored) or bf16 storage, computed from the
    class docstring with numpy float32, exact fused multiply-adds and numpy's casts."""
    lr, b1, b2, eps, wd, gs = 1e-2, 0.9, 0.999, 1e-8, 1e-3, 0.37
    _, _, w0, _ = _arrays(300, seed=3)
    w0 = _round_state(w0, fmt)
    grads = [_arrays(300, seed=10 + i)[2] for i in range(2)]
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    wt = torch.from_numpy(w0).to(dtype)
    opt = Adam([wt], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    opt._can_fuse = lambda p, s: False
    f = np.float32
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, g0 in enumerate(grads, start=1):
        g16 = _round_state(g0, fmt)
        wt.grad = torch.from_numpy(g16).to(dtype)
        opt.step(grad_scale=gs)
        g = g16 * f(gs)
        g = fma(w, f(wd), g)
        m = _round_state(fma(f(1 - b1), g - m, m), fmt)
        if fmt == "fp16":  # v holds sqrt(v) here
            v = _round_state(np.sqrt(fma(f(1 - b2) * g, g, (v * v) * f(b2))), fmt)
            r = v
        else:
            v = _round_state(fma(f(1 - b2) * g, g, v * f(b2)), fmt)
            r = np.sqrt(v)
        d = r / f(math.sqrt(1 - b2**t)) + f(eps)
        w = _round_state(w + (f(-(lr / (1 - b1**t))) * m) / d, fmt)
    key = "exp_avg_sq_sqrt" if fmt == "fp16" else "exp_avg_sq"
    assert_same_bits(opt.state[wt]["exp_avg"], torch.from_numpy(m), "m")
    assert_same_bits(opt.state[wt][key], torch.from_numpy(v), "v")
    assert_same_bits(wt, torch.from_numpy(w), "w")


def test_sgd_torch_path_is_the_written_definition():
    """Two steps of Nesterov SGD with weight decay in fp16, from the class docstring."""
    lr, mom, wd, gs = 0.1, 0.9, 1e-3, 0.37
    _, _, w0, _ = _arrays(300, seed=4)
    w0 = _round_state(w0, "fp16")
    wt = torch.from_numpy(w0).to(torch.float16)
    opt = SGD([wt], lr=lr, momentum=mom, weight_decay=wd, nesterov=True)
    opt._can_fuse = lambda p, s: False
    f = np.float32
    w, buf = w0.copy(), None
    for i in range(2):
        g16 = _round_state(_arrays(300, seed=20 + i)[2], "fp16")
        wt.grad = torch.from_numpy(g16).to(torch.float16)
        opt.step(grad_scale=gs)
        g = fma(w, f(wd), g16 * f(gs))
        buf = g if buf is None else fma(g, f(1.0), buf * f(mom))
        buf = _round_state(buf, "fp16")
        g = fma(buf, f(mom), g)
        w = _round_state(fma(g, f(-lr), w), "fp16")
    assert_same_bits(opt.state[wt]["momentum_buffer"], torch.from_numpy(buf), "buf")
    assert_same_bits(wt, torch.from_numpy(w), "w")


# -- memory accounting from the optimizers' state layouts ----------------------------------------

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


N_PARAMS, N_TENSORS = 20 * 32 + 32 + 32 * 5 + 5, 4


def _one_step(model, opt):
    x, y = torch.randn(4, 20).to(next(model.parameters()).dtype), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.step()


def test_ledger_of_a_lowprec_adam_with_sqrt_storage_and_kahan_by_hand():
    model = _mlp().to(torch.bfloat16)
    opt = Adam(model.parameters(), lr=1e-3, state_format="e5m2", update="kahan")
    p0 = next(model.parameters())
    e5m2, bf16 = parse_format("e5m2"), parse_format("bf16")
    assert opt.state_layout(p0) == {"exp_avg": e5m2, "exp_avg_sq_sqrt": e5m2,
                                    "compensation": bf16}
    # two moments of one byte (e5m2) and a bf16 compensation buffer per element, no master;
    # the layout is known before the first step and unchanged by it
    assert optimizer_bytes(opt) == (N_PARAMS * (1 + 1 + 2), 0)
    _one_step(model, opt)
    assert optimizer_bytes(opt) == (N_PARAMS * (1 + 1 + 2), 0)


def test_ledger_of_a_wrapped_torch_adam_with_master_weights_by_hand():
    model = _mlp().half()
    fo = FormatOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), param_format="fp16",
                         master_format="fp32")
    assert optimizer_bytes(fo) == (0, 4 * N_PARAMS)  # torch creates its state at the first step
    _one_step(model, fo)
    # exp_avg and exp_avg_sq of the fp32 masters, and torch's 0-dim float32 step per tensor
    assert optimizer_bytes(fo) == (2 * 4 * N_PARAMS + 4 * N_TENSORS, 4 * N_PARAMS)


def test_ledger_of_a_wrapped_torch_sgd_with_shadows_by_hand():
    model = _mlp().to(torch.bfloat16)
    fo = FormatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         update="stochastic", generator=torch.Generator().manual_seed(0))
    _one_step(model, fo)
    # the fp32 momentum of the fp32 shadows, and the shadows themselves (no master weights)
    assert optimizer_bytes(fo) == (4 * N_PARAMS + 4 * N_PARAMS, 0)


def _raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bit patterns as they lie (a 16-bit tensor's own bits, not widened)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("storage", ["fp16", "bf16", "fp32+bf16", "e5m2", "fp16-in-fp32",
                                     "bf16-in-fp32"])
@pytest.mark.parametrize("name", ["sgd", "sgd-momentum-wd", "sgd-nesterov-wd", "adam"])
def test_fused_step_with_nonfinite_gradients_equals_torch_path(name, storage):
    """NaN and infinite gradients in a few groups of eight values and in the last, partial tile:
    the fused kernel's float16 loads and stores take F16C's conversions for eight values at a time
    but for a group holding a NaN, which goes through the integer conversions (the instructions
    would keep a float32 NaN's payload bits and quiet a signalling float16 NaN); every stored bit
    pattern, NaN ones included, the torch path's. bfloat16 storage: the same NaN positions and
    every other bit; its NaN patterns are left out, as torch has none of its own (ATen's
    vectorised cast to bfloat16 writes 0xffff for any NaN, its scalar tail 0x7fc0; the kernel
    keeps the sign with 0x7fc0)."""
    cls, kw = OPTIMIZERS[name]
    dtype, pf, sf = STORAGE[storage]

    def run(fuse):
        w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
        w = (quantize(w, pf) if pf else w).to(dtype)
        opt = cls([w], param_format=pf, state_format=sf, **kw)
        if not fuse:
            opt._can_fuse = lambda p, s: False
        for i in range(3):
            g = _grads(i).clone()
            flat = g.view(-1)
            flat[[8 * (5 + i), 8 * 40 + 3, flat.numel() - 2]] = float("nan")
            flat[[8 * 41 + i, 8 * 90 + 7]] = float("inf")
            flat[8 * 91] = -float("inf")
            w.grad = g.to(dtype)
            opt.step()
            assert not fuse or opt._can_fuse(w, opt.state[w]), "the fused kernel did not run"
        return w, opt.state[w]

    def same(a, b, what):
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), what
        assert a.isnan().any() or what.endswith("exp_avg_sq"), f"{what}: no NaN reached it"
        if a.dtype == torch.bfloat16 or "bf16" in str(sf):
            a, b = a.masked_fill(a.isnan(), 0.0), b.masked_fill(b.isnan(), 0.0)
        assert torch.equal(_raw_bits(a), _raw_bits(b)), what

    w_f, st_f = run(True)
    w_t, st_t = run(False)
    same(w_f, w_t, f"{name} {storage}: parameter")
    for key, val in st_f.items():
        if torch.is_tensor(val) and val.dim():
            same(val, st_t[key], f"{name} {storage}: {key}")


def _wrapped_sgd_run(pf, update, fuse, groups, *, layout=torch.contiguous_format, steps=3,
                     grad_scale=0.37, sched=False, sf=None):
    """Three steps of a FormatOptimizer around torch.optim.SGD; ``fuse``: its fused path
    allowed, else forced onto torch's step. Returns the weights and how many fused steps ran."""
    ws = [quantize(torch.randn((16, 6, 5, 5), generator=torch.Generator().manual_seed(7 + i)),
                   pf).contiguous(memory_format=layout) for i in range(len(groups))]
    inner = torch.optim.SGD([dict(params=[w], **g) for w, g in zip(ws, groups)], lr=0.1)
    opt = FormatOptimizer(inner, param_format=parse_format(pf), update=update,
                          state_format=parse_format(sf or pf),
                          generator=torch.Generator().manual_seed(11))
    ran = []
    if not fuse:
        opt._sgd_fuses = lambda: False
    else:
        real = opt._sgd_fuses
        opt._sgd_fuses = lambda: ran.append(real()) or ran[-1]
    scheduler = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5) if sched else None
    for i in range(steps):
        for w in ws:
            w.grad = (_grads(i, (16, 6 * 5 * 5)).reshape(w.shape).clone()  # (scaled in place)
                      .contiguous(memory_format=layout))
        opt.step(grad_scale=grad_scale)
        if scheduler is not None:
            scheduler.step()
    state = [inner.state[w] for w in ws]
    return ws + [s["momentum_buffer"] for s in state if "momentum_buffer" in s], sum(ran)


WRAPPED_SGD = {
    "plain": [dict(weight_decay=1e-3), dict(lr=1, weight_decay=0)],
    "momentum": [dict(momentum=0.9, weight_decay=1e-3), dict(momentum=0.5, dampening=0.3)],
    "nesterov": [dict(momentum=0.9, nesterov=True, weight_decay=1e-4), dict(lr=2)],
}


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("update", ["nearest", "stochastic"])
@pytest.mark.parametrize("kind", list(WRAPPED_SGD))
@pytest.mark.parametrize("pf, sf", [("fp16", None), ("bf16", None), ("e5m2", "fp32"),
                                    ("q6.10", "bf16"), ("fp32", "bf16"), ("fp32", None)])
def test_a_wrapped_torch_sgd_steps_fused_with_torch_steps_bits(pf, sf, kind, update):
    """FormatOptimizer around torch.optim.SGD steps each float32 carrier by the fused kernel
    (update and write-back in one pass): the bits of torch's step and the roundings after it,
    parameters and momentum buffers, with weight decay or none, momentum, dampening, Nesterov,
    two groups of their own settings, a channels-last weight, a grad_scale, an integer rate,
    and a scheduler changing the rate."""
    for layout in (torch.contiguous_format, torch.channels_last):
        if update == "stochastic" and layout == torch.channels_last:
            continue  # (stochastic bits follow logical indices: the torch path, as for SGD)
        for sched in (False, True):
            args = (pf, update)
            kw = dict(layout=layout, sched=sched, sf=sf)
            fused, ran = _wrapped_sgd_run(*args, True, WRAPPED_SGD[kind], **kw)
            plain, _ = _wrapped_sgd_run(*args, False, WRAPPED_SGD[kind], **kw)
            assert ran == 3, "the fused step did not run"
            assert len(fused) == len(plain) == 2 + (kind != "plain") + (kind == "momentum")
            for a, b in zip(fused, plain):
                assert a.stride() == b.stride()
                assert_same_bits(a, b, f"{pf} {sf} {kind} {update} {layout} {sched}")


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
def test_a_wrapped_torch_sgd_steps_as_torch_does_what_the_kernel_does_not_compute():
    """Maximize, a step hook, a closure, a tensor rate, a weight decay float32 has no value
    for, a NaN rate, a rate beyond float32 (torch raises), native fp16 parameters: the wrapped
    optimizer's own step runs (its hooks with it)."""
    import warnings

    for group in (dict(maximize=True), dict(lr=torch.tensor(0.1)), dict(weight_decay=1e-60),
                  dict(lr=float("nan"))):
        _, ran = _wrapped_sgd_run("fp16", "nearest", True, [group])
        assert ran == 0, group
    with pytest.raises(RuntimeError, match="overflow"):  # torch's step refuses the rate
        _wrapped_sgd_run("fp16", "nearest", True, [dict(lr=1e39)])
    w = torch.randn(8, 8).half()
    opt = FormatOptimizer(torch.optim.SGD([w], lr=0.1), param_format=parse_format("fp16"))
    w.grad = torch.randn(8, 8).half()
    assert not opt._sgd_fuses()
    w = quantize(torch.randn(8, 8), "fp16")
    inner = torch.optim.SGD([w], lr=0.1)
    opt = FormatOptimizer(inner, param_format=parse_format("fp16"))
    w.grad = torch.randn(8, 8)
    hooked = []
    handle = inner.register_step_post_hook(lambda *a: hooked.append(1))
    opt.step()
    assert hooked == [1] and not opt._sgd_fuses()
    handle.remove()
    assert opt._sgd_fuses()  # (stepped)
    assert opt.step(closure=lambda: torch.tensor(2.0)) == 2.0  # the closure's loss, torch's step
    from torch.profiler import profile

    with profile() as prof:  # the scope torch's own step opens
        opt.step()
    assert "Optimizer.step#SGD.step" in [e.name for e in prof.events()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        sched = torch.optim.lr_scheduler.StepLR(inner, 1)
        opt.step()
        sched.step()


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("wrapped", [True, False])
@pytest.mark.parametrize("first", ["fp32 override", "empty"])
def test_a_fused_stochastic_write_back_draws_where_the_torch_path_does(first, wrapped):
    """The torch path's write-back draws no seed for an fp32 parameter (nothing to round) nor
    an empty one: neither does the fused kernel's, so the fp16 parameter after them gets the
    same random bits (a review found 451 of 1024 values apart before)."""
    from lowprec.numerics.formats import FP32

    def run(fuse):
        a = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
        a = torch.empty(0) if first == "empty" else a
        b = quantize(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)), "fp16")
        fmts = dict(param_format=parse_format("fp16"), state_format=parse_format("bf16"),
                    update="stochastic", generator=torch.Generator().manual_seed(3),
                    param_formats={id(a): FP32})
        if wrapped:
            opt = FormatOptimizer(torch.optim.SGD([a, b], lr=0.1, momentum=0.9))
            opt.configure_storage(**fmts)
            fused = opt._sgd_fuses
            if not fuse:
                opt._sgd_fuses = lambda: False
        else:
            opt = SGD([a, b], lr=0.1, momentum=0.9)
            opt.configure(**fmts)
            if not fuse:
                opt._can_fuse = lambda p, s: False
        for i in range(2):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(i))
            b.grad = torch.randn(32, 32, generator=torch.Generator().manual_seed(9 + i))
            if wrapped and fuse:
                assert fused()  # (the fused step, run here)
            else:
                opt.step()
        return b

    assert_same_bits(run(True), run(False), f"{first} wrapped={wrapped}")


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
def test_the_fused_wrapped_sgd_leaves_what_torchs_step_leaves():
    """Found by a review: the fused path declines a for-each group (its Nesterov step adds the
    momentum into the gradients), parameters added to the wrapped optimizer behind the
    wrapper's back (torch's path leaves them unrounded), a momentum buffer of another shape
    (torch raises; the kernel would have written past it) and a step the user replaced before a
    scheduler wrapped it; and it moves the version counters, so that a graph saved before the
    step is refused after it, as after torch's."""
    import types

    fp16 = parse_format("fp16")

    def wrapped(params, **kw):
        return FormatOptimizer(torch.optim.SGD(params, lr=0.1, **kw), param_format=fp16)

    w = quantize(torch.randn(4, 4), "fp16")
    w.grad = torch.randn(4, 4)
    assert not wrapped([w], momentum=0.9, nesterov=True, foreach=True)._sgd_fuses()
    opt = wrapped([w])
    extra = torch.randn(4, 4)
    opt.optimizer.add_param_group(dict(params=[extra]))
    extra.grad = torch.randn(4, 4)
    assert not opt._sgd_fuses()
    opt = wrapped([w], momentum=0.9)
    opt.optimizer.state[w]["momentum_buffer"] = torch.zeros(2, 8)
    assert not opt._sgd_fuses()
    with pytest.raises(RuntimeError):
        opt.step()
    calls = []
    inner = torch.optim.SGD([w], lr=0.1)
    inner.step = types.MethodType(
        lambda self, closure=None: calls.append(1) or torch.optim.SGD.step(self, closure), inner)
    torch.optim.lr_scheduler.StepLR(inner, 1)  # wraps the user's step
    FormatOptimizer(inner, param_format=fp16).step()
    assert calls == [1]
    p = torch.nn.Parameter(quantize(torch.randn(4, 4), "fp16"))
    opt = wrapped([p], momentum=0.9)
    x = torch.randn(4, 4, requires_grad=True)
    y = (p * x).sum()  # saves p
    p.grad = torch.randn(4, 4)
    assert opt._sgd_fuses()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.skipif(not kernel.available(), reason="kernel not built")
@pytest.mark.parametrize("pf", ["fp16", "bf16"])
@pytest.mark.parametrize("kw, wrapped", [
    (dict(lr=1.0, weight_decay=0.7), False),
    (dict(lr=1.0, weight_decay=0.7), True),
    (dict(lr=0.75, momentum=0.9, dampening=0.2, weight_decay=0.6), True),
    (dict(lr=0.5, momentum=0.7, nesterov=True, weight_decay=0.9), True)],
    ids=["lowprec-sgd", "torch-sgd", "torch-sgd-momentum", "torch-sgd-nesterov"])
def test_sgd_of_16_bit_values_in_float32_carriers_equals_torch_path(pf, kw, wrapped):
    """The kernel's one-loop SGD step of float32 carriers (sgd_f32_fast: float16 or bfloat16
    parameters and momentum, eight values a vector, its fused multiply-adds and roundings in
    registers) against the torch path, every bit: 2**16 + 5 values (a partial vector last), a
    large weight decay and rate (so that a multiply-add computed as two roundings would move
    some stored value: the fused one is what torch's CPU add with alpha computes), NaNs with
    payload bits float16 and bfloat16 cannot hold (the stored carrier keeps the float32 NaN's
    bits, as quantize does), infinities, and values past float16's range. lowprec's SGD updates
    from the rounded momentum, a wrapped torch.optim.SGD from the raw one. (lowprec's SGD with
    momentum, kept in a 16-bit dtype, is left to the nonfinite test's plain NaNs: its torch path
    carries a payload NaN through that dtype otherwise than the kernel, tiles or loop, whose two
    paths tests/numerics/test_kernel_paths.py compares.)"""
    n = 2**16 + 5
    gen = torch.Generator().manual_seed(3)
    w0 = quantize(torch.randn(n, generator=gen) * 4, pf)
    payload = torch.tensor([0x7FC00001, 0x7FC01234, -0x3FF0000], dtype=torch.int32).view(
        torch.float32)  # (the last: a negative quiet NaN, 0xfc010000)

    def grads(i):
        g = torch.randn(n, generator=torch.Generator().manual_seed(50 + i)) * 3
        g[[17 + i, 1000, n - 1]] = payload
        g[[40 + i, 2001]] = float("inf")
        g[[41, n - 3]] = -float("inf")
        g[[60 + i, 61]] = 7e4  # past float16's largest, 65504
        return g

    def run(fuse):
        w = w0.clone()
        if wrapped:
            inner = torch.optim.SGD([w], **kw)
            opt = FormatOptimizer(inner, param_format=parse_format(pf),
                                  state_format=parse_format(pf))
            if not fuse:
                opt._sgd_fuses = lambda: False
            state = inner.state
        else:
            opt = SGD([w], param_format=pf, state_format=pf, **kw)
            if not fuse:
                opt._can_fuse = lambda p, s: False
            state = opt.state
        for i in range(3):
            w.grad = grads(i)
            opt.step()
            if fuse and not wrapped:
                assert opt._can_fuse(w, opt.state[w]), "the fused kernel did not run"
        return [w] + [v for v in state[w].values() if torch.is_tensor(v) and v.dim()]

    fused, plain = run(True), run(False)
    assert len(fused) == len(plain) == 1 + ("momentum" in kw)
    for a, b in zip(fused, plain):
        assert a.isnan().any()
        assert_same_bits(a, b, f"{pf} {kw} wrapped={wrapped}")
