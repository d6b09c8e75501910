"""Checkpoint sizes: fp32, native 16-true and lowprec's emulated 16-true, side by side.

Lightning (a digits MLP, SGD with momentum, one epoch, ``trainer.save_checkpoint``: fp32,
Lightning's own ``precision="16-true"``, ``LowprecPrecision("16-true")``), the Hugging Face
Trainer (a tiny random BERT, one epoch, the files of ``checkpoint-4``: fp32, native fp16
parameters ``b=native``, emulated 16-true) and ``lowprec compare`` run folders (the MLP, the
checkpoint of the first epoch). Prints bytes and the dtypes stored. Needs lightning,
transformers and accelerate (``pip install lowprec[integrations]``); nothing is downloaded.

    PYTHONPATH=src python benchmarks/checkpoint_sizes.py [lightning] [hf] [runs]
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

NATIVE_16 = "p=fp16,c=fp16,g=fp16,o=fp16,b=native"


def lightning(tmp: Path) -> None:
    import lightning as L
    from sklearn import datasets

    from lowprec.integrations.lightning import LowprecPrecision

    x, y = datasets.load_digits(return_X_y=True)
    data = torch.utils.data.TensorDataset(torch.tensor(x[:512] / 16.0, dtype=torch.float32),
                                          torch.tensor(y[:512]))

    class Digits(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

        def training_step(self, batch, _):
            return nn.functional.cross_entropy(self.net(batch[0]).float(), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    for name, kw in (("fp32 (precision='32-true')", dict(precision="32-true")),
                     ("native (Lightning's '16-true')", dict(precision="16-true")),
                     ("lowprec emulated 16-true", dict(plugins=[LowprecPrecision("16-true")]))):
        t = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, **kw)
        t.fit(Digits(), torch.utils.data.DataLoader(data, batch_size=32))
        path = tmp / "lightning.ckpt"
        t.save_checkpoint(path)
        dtypes = sorted({str(v.dtype) for v in torch.load(path, weights_only=False)[
            "state_dict"].values()})
        print(f"lightning   {name:32s} {path.stat().st_size:9,d} B   weights {dtypes}")


def hugging_face(tmp: Path) -> None:
    import transformers

    from lowprec.integrations.huggingface import LowprecTrainer

    class Toy(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(1, 100, (64, 12), generator=g)
            self.labels = (self.ids[:, 0] > 50).long()

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    for name, policy in (("fp32", "32-true"), ("native (b=native)", NATIVE_16),
                         ("lowprec emulated 16-true", "16-true")):
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=32, num_labels=2)
        out = tmp / f"hf-{policy.replace(',', '_').replace('=', '-')}"
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=16, num_train_epochs=1,
            report_to=[], save_strategy="epoch", use_cpu=True, disable_tqdm=True, seed=0)
        LowprecTrainer(policy=policy, model=transformers.BertForSequenceClassification(cfg),
                       args=args, train_dataset=Toy()).train()
        ck = out / "checkpoint-4"
        files = "  ".join(f"{f} {(ck / f).stat().st_size:,d} B" for f in
                          ("model.safetensors", "optimizer.pt", "scaler.pt"))
        dtype = json.loads((ck / "config.json").read_text()).get("dtype")
        print(f"hf          {name:32s} {files}   config dtype {dtype}")


def run_folders(tmp: Path) -> None:
    from lowprec.experiments import CompareConfig, run_compare, runner

    save, sizes = runner.atomic_save, {}

    def measured(obj, path):
        save(obj, path)
        if obj["epoch"] == 0:
            sizes[path.name.split("_seed")[0]] = path.stat().st_size

    runner.atomic_save = measured
    try:
        run_compare(CompareConfig(out=str(tmp / "run"), data="digits", model="mlp",
                                  policies=("32-true", NATIVE_16, "16-true"), seeds=(0,),
                                  epochs=1, batch_size=64, train_subset=128, quiet=True))
    finally:
        runner.atomic_save = save
    for name, size in sizes.items():
        print(f"run folder  {name:40s} {size:9,d} B")


def main() -> None:
    parts = sys.argv[1:] or ["lightning", "hf", "runs"]
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as d:
        for part, fn in (("lightning", lightning), ("hf", hugging_face), ("runs", run_folders)):
            if part in parts:
                fn(Path(d))


if __name__ == "__main__":
    main()
