"""lowprec's warnings name the user's line (the first frame outside lowprec and torch), whatever
depth of lowprec's own code raised them: a fixed stacklevel named a file of lowprec's whenever
lowprec itself made the call (the GradScaler facade's step, lowprec's runner calling setup)."""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

import lowprec
from lowprec import Precision
from lowprec.integrations.gradscaler import GradScaler
from lowprec.training.caller import warn
from lowprec.training.precision import OptimizerPrecisionWarning


def _as_lowprec_file(source: str, **names) -> dict:
    """``source`` compiled as a file inside the installed package (what lowprec's own modules
    are to the warning machinery), its functions in the returned namespace."""
    inner = os.path.join(os.path.dirname(lowprec.__file__), "experiments", "_inside.py")
    ns = dict(names)
    exec(compile(source, inner, "exec"), ns)  # noqa: S102
    return ns


def _caught(fn) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return caught


def test_warn_skips_lowprecs_and_torchs_frames():
    ns = _as_lowprec_file(
        "class Inner(nn.Module):\n"
        "    def forward(self, x):\n"
        "        deeper()\n"
        "        return x\n"
        "def deeper():\n"
        "    warn('from inside', RuntimeWarning)\n", nn=nn, warn=warn)
    # the forward runs under torch's Module.__call__ (torch's frames), itself called here
    caught = _caught(lambda: ns["Inner"]()(torch.ones(1)))
    assert [(w.category, str(w.message), w.filename) for w in caught] == [
        (RuntimeWarning, "from inside", __file__)]


def test_a_step_without_gradients_through_the_gradscaler_facade_names_the_users_line():
    scaler = GradScaler("cpu", policy="16-mixed")
    net = nn.Linear(4, 2)
    model, opt = scaler.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    caught = [w for w in _caught(lambda: scaler.step(opt)) if "no gradients" in str(w.message)]
    assert len(caught) == 1 and caught[0].filename == __file__, [
        (w.filename, w.lineno) for w in caught]


def test_an_optimizer_warning_of_a_setup_lowprec_made_names_the_users_line():
    ns = _as_lowprec_file(
        "def set_up():\n"
        "    model = nn.Linear(4, 2)\n"
        "    Precision('p=bf16,c=bf16,o=fp32,b=native').setup(\n"
        "        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))\n",
        nn=nn, torch=torch, Precision=Precision)
    caught = [w for w in _caught(ns["set_up"]) if w.category is OptimizerPrecisionWarning]
    assert len(caught) == 1 and caught[0].filename == __file__, [
        (w.filename, w.lineno, str(w.message)) for w in caught]


def test_a_warning_raised_while_torch_compile_traces_adds_no_dynamo_warning():
    """warn() walks frames with sys._getframe, which Dynamo cannot trace (it warned of that
    too): while compiling it warns at its caller, lowprec's one warning alone."""
    from lowprec.training.emulation.engine import _warn_if_compiling  # noqa: F401 (exists)

    torch._dynamo.reset()
    model = nn.Linear(4, 2)
    Precision("p=q6.10,c=q6.10,g=q6.10,b=emulated").setup(model)
    compiled = torch.compile(model, backend="eager")
    caught = _caught(lambda: compiled(torch.ones(3, 4)))
    texts = [str(w.message) for w in caught]
    assert any("runs the model eagerly under torch.compile" in t for t in texts), texts
    assert not any("_getframe" in t for t in texts), texts
