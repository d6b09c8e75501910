"""Time per training step and ledger bytes of every policy, relative to 32-true, in one run.

Three models: a LeNet-5-style CNN and an MLP (784-512-512-10) on MNIST-shaped batches, and a
small pre-norm transformer (2 layers, d=128, 4 heads, 64 tokens, vocabulary 256). Policies
are measured in interleaved rounds (every policy once per round, the median over rounds), so a
slow moment of the machine hits all of them alike.

    python benchmarks/train_step.py [--batch 256] [--rounds 7] [--steps 10] \
        [--layout runner|contiguous]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import lowprec
from lowprec import POLICIES, Precision
from lowprec.training.optim import SGD

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# the pre-norm block of the fidelity tests (functional attention, residual adds)
from training.test_fidelity import Block  # noqa: E402


def lenet():
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 2, heads: int = 4,
                 ctx: int = 64) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)).flatten(0, 1)  # (tokens, vocab) for cross-entropy


class LSTMNet(nn.Module):
    """The 28 rows of a 28x28 image as a sequence: one LSTM layer (hidden 128), the last
    hidden state classified."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(28, 128, batch_first=True), nn.Linear(128, 10)

    def forward(self, x):
        out, _ = self.lstm(x.flatten(1, 2))
        return self.head(out[:, -1])


def zoo(name: str):
    """A model of the yun2023 preset, as ``lowprec compare`` builds it (MNIST-shaped)."""
    from lowprec.experiments.models import build_model

    return lambda: build_model(name, (1, 28, 28), 10)


class Runner:
    def __init__(self, make, policy: str, batch: int, layout: str = "runner") -> None:
        from lowprec.experiments.models import channels_last

        torch.manual_seed(0)
        model = make()
        if layout == "runner":  # convolutional models channels-last, as lowprec compare
            channels_last(model)
        self.prec = Precision(policy, seed=0)
        self.model, self.opt = self.prec.setup(model, SGD(model.parameters(), lr=0.01,
                                                          momentum=0.9))
        g = torch.Generator().manual_seed(1)
        if isinstance(model, Transformer):  # batch // 8 sequences of 64 tokens
            self.x = torch.randint(0, 256, (max(batch // 8, 1), 64), generator=g)
            self.y = torch.randint(0, 256, (self.x.numel(),), generator=g)
        else:
            self.x = torch.randn(batch, 1, 28, 28, generator=g)
            self.y = torch.randint(0, 10, (batch,), generator=g)
        self.loss_fn = nn.CrossEntropyLoss()

    def step(self) -> None:
        self.opt.zero_grad()
        with self.prec.autocast():
            loss = self.loss_fn(self.model(self.x).float(), self.y)
        self.prec.backward(loss)
        self.prec.step(self.opt)

    def time(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t0) / steps

    def ledger(self):
        return self.prec.memory(self.model, (self.x, self.y), self.loss_fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policies", default=None,
                    help="comma-separated policies (default: every named policy)")
    ap.add_argument("--models", default="cnn,mlp,transformer",
                    help="comma-separated: cnn, mlp, transformer, resnet20, vgg, mobilenet, lstm")
    ap.add_argument("--layout", choices=("runner", "contiguous"), default="runner",
                    help="runner (default): models with 2-d convolutions channels-last, as "
                         "lowprec compare trains them; contiguous: as built")
    args = ap.parse_args()
    from lowprec.experiments.config import split_policies
    from lowprec.experiments.system import tune_cpu_allocator

    tune_cpu_allocator()  # as the lowprec command does; the same for every policy measured
    names = split_policies(args.policies) if args.policies else list(POLICIES)
    if "32-true" not in names:
        names.insert(0, "32-true")
    models = [m for m in [("LeNet-5 CNN", lenet, "cnn"), ("MLP 784-512-512-10", mlp, "mlp"),
                          ("Transformer 2x128, 64 tokens", Transformer, "transformer"),
                          ("ResNet-20", zoo("resnet20"), "resnet20"),
                          ("VGG-style", zoo("vgg"), "vgg"),
                          ("MobileNetV2-style", zoo("mobilenet"), "mobilenet"),
                          ("LSTM 28x28 rows, hidden 128", LSTMNet, "lstm")]
              if m[2] in args.models.split(",")]
    print(f"lowprec {lowprec.__version__}, torch {torch.__version__}, "
          f"{platform.machine()}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"median of {args.rounds} interleaved rounds of {args.steps} steps, layout "
          f"{args.layout}")
    for model_name, make, _ in models:
        runners, failed = {}, {}
        for name in names:
            try:
                r = Runner(make, name, args.batch, args.layout)
                r.time(3)  # warm-up: oneDNN primitives, allocator
                runners[name] = r
            except Exception as err:  # noqa: BLE001 (e.g. oneDNN has no bf16 LSTM on AVX2)
                failed[name] = " ".join(str(err).split())[:100]
        times = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, r in runners.items():
                times[name].append(r.time(args.steps))
        base_t = statistics.median(times["32-true"])
        base_m = runners["32-true"].ledger()
        print(f"\n{model_name}: 32-true step {1000 * base_t:.2f} ms, ledger "
              f"{base_m.total / 1e6:.2f} MB")
        print(f"{'policy':<12} {'backend':<9} {'ms/step':>8} {'time/fp32':>9} {'ledger MB':>9} "
              f"{'mem/fp32':>8}  params/grads/state/master/activations (KB)")
        for name, r in runners.items():
            t = statistics.median(times[name])
            led = r.ledger()
            parts = "/".join(f"{v / 1e3:.0f}" for v in (led.params, led.grads,
                                                         led.optimizer_state, led.master,
                                                         led.activations))
            print(f"{name:<12} {r.prec.backend:<9} {1000 * t:8.2f} {t / base_t:9.2f} "
                  f"{led.total / 1e6:9.2f} {led.ratio_to(base_m):8.2f}  {parts}")
        for name, why in failed.items():
            print(f"{name:<12} failed: {why}")


if __name__ == "__main__":
    main()
