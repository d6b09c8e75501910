"""The model zoo: real architectures nobody here wrote, tiny configs, random init, nothing
downloaded. Each entry builds a model, a fixed batch (inputs as the model takes them: a tensor,
a dict of keyword inputs, or a tuple of positional ones) and a loss on the model's output
tensor (found by :func:`lowprec.training.tree.output_tensor`: ``logits``, else the first
tensor). Hugging Face models come from ``transformers`` configs; the rest from ``torch.nn``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

N = 8  # batch size
L = 6  # sequence length
VOCAB = 50


@dataclass
class Entry:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple]  # (inputs, targets)
    loss: Callable  # loss(output_tensor, targets)
    lr: float = 1e-2


def _ce(out, y):
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def _lm_loss(logits, ids):
    # next-token prediction, as GPT2LMHeadModel computes it from labels
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _ids(seed=0):
    return torch.randint(1, VOCAB, (N, L), generator=_gen(seed))


# -- transformers ----------------------------------------------------------------------------
def bert():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def bert_batch():
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[:2, -2:] = 0  # padded positions
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (N,), generator=_gen(1))


def gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1,
                                  n_head=2, tie_word_embeddings=True,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def gpt2_batch():
    ids = _ids(2)
    return {"input_ids": ids}, ids


def vit():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, num_labels=3)
    return transformers.ViTForImageClassification(cfg)


def image_batch(size=8):
    x = torch.randn(N, 3, size, size, generator=_gen(3))
    return {"pixel_values": x}, torch.randint(0, 3, (N,), generator=_gen(4))


def resnet():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                    depths=[1, 1], layer_type="basic", hidden_act="relu",
                                    num_labels=3)
    return transformers.ResNetForImageClassification(cfg)


# -- torch.nn --------------------------------------------------------------------------------
class Encoder(nn.Module):
    """nn.TransformerEncoder with a padding mask passed by keyword."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids, *, src_key_padding_mask):
        h = self.enc(self.emb(ids), src_key_padding_mask=src_key_padding_mask)
        keep = (~src_key_padding_mask).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def encoder_batch():
    ids = _ids(5)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[:3, -2:] = True
    return {"ids": ids, "src_key_padding_mask": pad}, torch.randint(0, 3, (N,), generator=_gen(6))


class LSTMNet(nn.Module):
    """An LSTM returning its (output, (h, c)) tuple; the model returns it too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(4, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]), (h, c)


class PackedGRU(nn.Module):
    """A GRU over a PackedSequence of variable-length sequences (lengths stay integers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gru = nn.GRU(4, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(h[-1])


def seq_batch():
    x = torch.randn(N, L, 4, generator=_gen(7))
    return x, torch.randint(0, 3, (N,), generator=_gen(8))


def packed_batch():
    x, y = seq_batch()
    lengths = torch.tensor([L, L - 1, L - 2, 3, L, 2, L - 1, 4])
    return (x, lengths), y  # a tuple: positional inputs


class DictInput(nn.Module):
    """forward(batch) takes one dict of tensors, as many training scripts do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.num = nn.Sequential(nn.Linear(5, 16), nn.GELU())
        self.cat = nn.Embedding(7, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, batch):
        return self.head(self.num(batch["numeric"]) + self.cat(batch["category"]))


def dict_batch():
    g = _gen(9)
    inputs = {"numeric": torch.randn(N, 5, generator=g),
              "category": torch.randint(0, 7, (N,), generator=g)}
    return (inputs,), torch.randint(0, 3, (N,), generator=g)


class KeywordDictOutput(nn.Module):
    """Keyword-only inputs, a dict output with the logits and an auxiliary tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.SiLU())
        self.head = nn.Linear(16, 3)

    def forward(self, *, features, scale):
        h = self.body(features) * scale
        return {"aux": h.mean(), "logits": self.head(h)}


def kw_batch():
    g = _gen(10)
    return ({"features": torch.randn(N, 6, generator=g), "scale": torch.tensor(1.5)},
            torch.randint(0, 3, (N,), generator=g))


class TiedLM(nn.Module):
    """A language model whose output projection is its embedding matrix (weight tying)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids))))


def tied_batch():
    ids = _ids(11)
    return ids, ids


ZOO = {
    "bert": Entry("bert", bert, bert_batch, _ce),
    "gpt2": Entry("gpt2", gpt2, gpt2_batch, _lm_loss),
    "vit": Entry("vit", vit, image_batch, _ce),
    "resnet": Entry("resnet", resnet, lambda: image_batch(16), _ce),
    "encoder": Entry("encoder", Encoder, encoder_batch, _ce),
    "lstm": Entry("lstm", LSTMNet, seq_batch, _ce),
    "gru-packed": Entry("gru-packed", PackedGRU, packed_batch, _ce),
    "dict-input": Entry("dict-input", DictInput, dict_batch, _ce),
    "kw-dict-output": Entry("kw-dict-output", KeywordDictOutput, kw_batch, _ce),
    "tied-lm": Entry("tied-lm", TiedLM, tied_batch, _lm_loss),
}
