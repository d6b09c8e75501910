"""LowprecPrecision in a real Lightning Trainer: a LightningModule trains on the digits under
Lightning's policy names and lowprec's own, clips unscaled gradients, and resumes from a
checkpoint with its loss scale (the resumed run ends where an uninterrupted one does)."""

import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")
datasets = pytest.importorskip("sklearn.datasets")

from lowprec import quantize  # noqa: E402
from lowprec.integrations.lightning import LowprecFabricPrecision, LowprecPrecision  # noqa: E402


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


def trainer(plugin, epochs, **kw):
    return L.Trainer(plugins=[plugin], max_epochs=epochs, accelerator="cpu", devices=1,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, deterministic=True, **kw)


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
        trainer(plugin, 2, enable_checkpointing=False, gradient_clip_val=1.0).fit(model, loader())
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


def test_resumes_from_a_checkpoint_with_its_loss_scale(tmp_path):
    policy, ls = "16-master", "dynamic:init=65536,interval=4"
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
        saved = torch.load(ckpt, weights_only=False)["LowprecPrecision"]
        assert saved["loss_scale"]["scale"] == p_first.lowprec.loss_scale.scale
        assert p_first.lowprec.skipped >= 1  # 65536 overflowed fp16 at least once
        resumed = Digits()
        p_resumed = LowprecPrecision(policy, loss_scale=ls)
        trainer(p_resumed, 2, default_root_dir=tmp_path).fit(resumed, loader(), ckpt_path=ckpt)
    assert p_resumed.lowprec.loss_scale.scale == p_straight.lowprec.loss_scale.scale
    assert p_resumed.lowprec.trace == p_straight.lowprec.trace
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


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
