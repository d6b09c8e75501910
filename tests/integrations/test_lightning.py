"""LowprecPrecision in a real Lightning Trainer: a LightningModule trains on the digits under
Lightning's policy names and lowprec's own, clips unscaled gradients, and resumes from a
checkpoint with its loss scale (the resumed run ends where an uninterrupted one does). Under
emulated 16-true the checkpoint holds fp16 tensors, the size of Lightning's own 16-true
checkpoint, and resumes bit for bit."""

import io
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")
datasets = pytest.importorskip("sklearn.datasets")

from lowprec import quantize  # noqa: E402
from lowprec.integrations.lightning import (  # noqa: E402
    LowprecFabricPrecision, LowprecPrecision, Trainer)


def digits(n=512):
    x, y = datasets.load_digits(return_X_y=True)
    x = torch.tensor(x[:n] / 16.0, dtype=torch.float32)
    return torch.utils.data.TensorDataset(x, torch.tensor(y[:n]))


class Digits(L.LightningModule):
    def __init__(self, lr=0.2):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.lr = lr
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)


def trainer(precision, epochs, **kw):
    """lowprec's Trainer: ``precision`` a policy name, a compact spec or a plugin."""
    return Trainer(precision=precision, max_epochs=epochs, **QUIET, **kw)


def loader():
    return torch.utils.data.DataLoader(digits(), batch_size=32, shuffle=False)


GRIDS = {"16-true": "fp16", "bf16-true": "bf16", "p=bf16:kahan": "bf16"}


@pytest.mark.parametrize("policy", ["32-true", "16-true", "bf16-true", "16-mixed",
                                    "p=bf16:kahan"])
def test_trains_two_epochs_on_digits(policy):
    model = Digits()
    plugin = LowprecPrecision(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes about workers and logging
        # the plugin, or the policy string itself through lowprec's Trainer
        t = trainer(plugin if policy != "p=bf16:kahan" else policy, 2, enable_checkpointing=False,
                    gradient_clip_val=1.0)
        plugin = t.precision_plugin
        t.fit(model, loader())
    assert len(model.losses) == 32 and all(map(lambda v: v == v, model.losses))
    first, last = sum(model.losses[:16]) / 16, sum(model.losses[16:]) / 16
    assert last < 0.7 * first, model.losses
    assert plugin.lowprec.steps == 32
    # the scheduler (built on the user's optimizer) set the rate the wrapped step used
    opt = model.trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5**2)
    if policy in GRIDS:
        for p in model.parameters():
            assert torch.equal(p.float(), quantize(p.float(), GRIDS[policy])), policy


@pytest.mark.parametrize("policy", ["16-master", "16-true"])
def test_resumes_from_a_checkpoint_with_its_loss_scale(tmp_path, policy):
    ls = "dynamic:init=65536,interval=4"
    straight = Digits()
    p_straight = LowprecPrecision(policy, loss_scale=ls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(p_straight, 2, enable_checkpointing=False).fit(straight, loader())
        first = Digits()
        p_first = LowprecPrecision(policy, loss_scale=ls)
        t1 = trainer(p_first, 1, default_root_dir=tmp_path)
        t1.fit(first, loader())
        ckpt = tmp_path / "one.ckpt"
        t1.save_checkpoint(ckpt)
        whole = torch.load(ckpt, weights_only=False)
        saved = whole["LowprecPrecision"]
        assert saved["loss_scale"]["scale"] == p_first.lowprec.loss_scale.scale
        # fp16 parameters (emulated on CPU) saved in fp16, resumed from those bit for bit
        assert {v.dtype for v in whole["state_dict"].values()} == {torch.float16}
        assert p_first.lowprec.skipped >= 1  # 65536 overflowed fp16 at least once
        resumed = Digits()
        p_resumed = LowprecPrecision(policy, loss_scale=ls)
        trainer(p_resumed, 2, default_root_dir=tmp_path).fit(resumed, loader(), ckpt_path=ckpt)
    assert p_resumed.lowprec.loss_scale.scale == p_straight.lowprec.loss_scale.scale
    # the trace is not in the checkpoint (constant size): the resumed run traces its own steps,
    # numbered on from the restored count, the same as the uninterrupted run's last epoch
    tail = p_resumed.lowprec.trace
    assert len(tail) == 16 and tail == p_straight.lowprec.trace[-16:]
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    opt_a, opt_b = straight.trainer.optimizers[0], resumed.trainer.optimizers[0]
    for sa, sb in zip(opt_a.state_dict()["optimizer"]["state"].values(),
                      opt_b.state_dict()["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _fit_and_save(path, **trainer_kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET, **trainer_kw)
        model = Digits()
        t.fit(model, loader())
        t.save_checkpoint(path)
    return model, torch.load(path, weights_only=False)


def test_emulated_16_true_checkpoint_is_fp16_like_lightnings_own(tmp_path):
    """Measured here: fp32 23,949 B; Lightning's precision="16-true" 14,349 B; lowprec's
    emulated 16-true 14,605 B (its plugin state: loss scale and counts), was 24,653 B."""
    sizes, ckpts = {}, {}
    for name, kw in (("fp32", dict(precision="32-true")),
                     ("native", dict(precision="16-true")),
                     ("lowprec", dict(plugins=[LowprecPrecision("16-true")]))):
        model, ckpts[name] = _fit_and_save(tmp_path / f"{name}.ckpt", **kw)
        sizes[name] = (tmp_path / f"{name}.ckpt").stat().st_size
    # the weights and the momentum in fp16, as Lightning's own 16-true saves them
    for name in ("native", "lowprec"):
        assert {v.dtype for v in ckpts[name]["state_dict"].values()} == {torch.float16}, name
    momentum = ckpts["lowprec"]["optimizer_states"][0]["optimizer"]["state"]
    assert {s["momentum_buffer"].dtype for s in momentum.values()} == {torch.float16}
    assert sizes["lowprec"] < 0.65 * sizes["fp32"], sizes  # about half the fp32 bytes
    assert sizes["lowprec"] < 1.05 * sizes["native"], sizes
    # the file's fp16 values are the trained fp32 carriers, exactly
    for k, p in model.state_dict().items():
        assert torch.equal(ckpts["lowprec"]["state_dict"][k].float(), p), k
    # and load_from_checkpoint gives them back into a fresh fp32 module bit for bit
    back = Digits.load_from_checkpoint(tmp_path / "lowprec.ckpt")
    for a, b in zip(model.parameters(), back.parameters()):
        assert b.dtype == torch.float32 and torch.equal(a, b)


def test_plugin_state_does_not_grow_with_the_run(tmp_path):
    """The plugin's entry in the checkpoint is the same size after 16 steps and after 96 (it
    carried a dict per step: the trace stays in memory, ``plugin.lowprec.trace``)."""
    sizes = []
    for epochs in (1, 6):
        plugin = LowprecPrecision("16-true", loss_scale="dynamic:init=1024,interval=4")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = trainer(plugin, epochs, enable_checkpointing=False)
            t.fit(Digits(), loader())
            t.save_checkpoint(tmp_path / f"{epochs}.ckpt")
        state = torch.load(tmp_path / f"{epochs}.ckpt", weights_only=False)["LowprecPrecision"]
        assert state["steps"] == 16 * epochs and "trace" not in state
        assert len(plugin.lowprec.trace) == 16 * epochs  # in memory, whole
        buf = io.BytesIO()
        torch.save(state, buf)
        sizes.append(len(buf.getvalue()))
    assert sizes[0] == sizes[1], sizes


def test_trainer_takes_any_policy_and_the_plugin_names_its_policy():
    with pytest.raises(ValueError, match="is invalid"):  # Lightning's own Trainer
        L.Trainer(precision="p=bf16:kahan", **QUIET)
    plugin = LowprecPrecision("p=bf16:kahan")
    assert repr(plugin) == "LowprecPrecision('p=bf16:kahan,c=bf16,g=bf16,o=bf16,m=none," \
        "ls=none,b=auto,s=all')"
    assert repr(LowprecPrecision("16-true")) == "LowprecPrecision('16-true')"
    with pytest.raises(ValueError, match=r"plugins=LowprecPrecision\('16-true'\)"):
        L.Trainer(precision="16-mixed", plugins=[LowprecPrecision("16-true")], **QUIET)
    for precision in ("p=bf16:kahan", plugin, "16-master", 32):
        t = Trainer(precision=precision, **QUIET)
        assert isinstance(t, L.Trainer) and isinstance(t.precision_plugin, LowprecPrecision)
    assert str(t.precision_plugin.lowprec.policy) == "32-true"  # Lightning's 32 alias
    assert Trainer(precision=plugin, **QUIET).precision_plugin is plugin
    with pytest.raises(TypeError, match="precision="):
        Trainer(precision=1.5, **QUIET)


def test_fabric_plugin_trains():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LowprecFabricPrecision("16-master")])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    data = fabric.setup_dataloaders(loader())
    losses = []
    for _ in range(2):
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).float(), y)
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            assert not torch.isfinite(norm) or norm <= 1.0 + 1e-3  # unscaled, then clipped
            opt.step()
            losses.append(loss.item())
    assert sum(losses[16:]) < 0.7 * sum(losses[:16])
    for p in model.parameters():
        assert torch.equal(p, quantize(p, "fp16"))


def test_loss_scale_and_skipped_steps_reach_lightnings_logger(tmp_path):
    """Live logging through the Trainer's own logger (a CSVLogger here): after each optimizer
    step the scale the next step will use and the running counts, the same numbers as the
    Precision's per-step trace. A scale of 2^30 overflows fp16 gradients: steps are skipped
    and the scale backs off, and the log shows it as it happens."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    model = Digits()
    plugin = LowprecPrecision("16-true", loss_scale="dynamic:init=1073741824,interval=4")
    kw = {k: v for k, v in QUIET.items() if k != "logger"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = Trainer(precision=plugin, max_epochs=1, logger=CSVLogger(tmp_path, name="log"),
                    log_every_n_steps=1, enable_checkpointing=False, **kw)
        t.fit(model, loader())
    with open(t.logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("lowprec/loss_scale")]
    trace = plugin.lowprec.trace
    assert len(rows) == len(trace) == 16
    after = [e["scale"] for e in trace[1:]] + [plugin.lowprec.loss_scale.scale]
    assert [float(r["lowprec/loss_scale"]) for r in rows] == after
    skipped = [sum(e["skipped"] for e in trace[:i + 1]) for i in range(len(trace))]
    assert [float(r["lowprec/skipped_steps"]) for r in rows] == skipped
    assert 0 < skipped[-1] < 16 and after[-1] < 2**30
    assert [float(r["lowprec/steps"]) for r in rows] == list(range(1, 17))


def _fit_logged(model, plugin, tmp_path):
    """One epoch under lowprec's Trainer with a CSVLogger; the Trainer."""
    from lightning.pytorch.loggers import CSVLogger

    kw = {k: v for k, v in QUIET.items() if k != "logger"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = Trainer(precision=plugin, max_epochs=1, logger=CSVLogger(tmp_path), **kw,
                    enable_checkpointing=False)
        t.fit(model, loader())
    return t


@pytest.mark.parametrize("on", [True, False])
def test_logging_can_be_turned_off(on, tmp_path):
    t = _fit_logged(Digits(), LowprecPrecision("16-true", log_metrics=on), tmp_path)
    assert any(k.startswith("lowprec/") for k in t.logged_metrics) == on


def test_nothing_is_logged_without_a_logger():
    """logger=False: no metrics, and none of Lightning's "no logger configured" warnings."""
    model = Digits()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(LowprecPrecision("16-true"), 1, enable_checkpointing=False)
        t.fit(model, loader())
    assert not any(k.startswith("lowprec/") for k in t.logged_metrics)
    assert not any("lowprec/" in str(w.message) for w in caught)


class ManualEpochEnd(Digits):
    """Manual optimization whose optimizer steps once more in on_train_epoch_end, a hook in
    which Lightning forbids per-step logging."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, _):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def on_train_epoch_end(self):
        opt = self.optimizers()
        x, y = next(iter(loader()))
        opt.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self.net(x).float(), y))
        opt.step()


def test_a_step_from_a_hook_that_may_not_log_trains_on(tmp_path):
    plugin = LowprecPrecision("16-true")
    _fit_logged(ManualEpochEnd(), plugin, tmp_path)
    assert plugin.lowprec.steps == 17
