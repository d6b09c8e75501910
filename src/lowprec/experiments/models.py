"""Models: one definition serves every policy (no ``vgg_low.py`` beside ``vgg.py``).

``build_model(name, input_shape, num_classes)`` with name one of ``mlp``, ``lenet5``,
``resnet20``, ``vgg``, ``cnn1d``, ``transformer``, ``mobilenet``, ``chartransformer`` (the
``text`` data's language model), or ``module:function`` for your own
(called as ``function(input_shape, num_classes)``, returning an ``nn.Module``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..training.tree import map_floating
from .util import USER_ERRORS, describe_error, import_callable, short

__all__ = ["build_model", "build_checked_model", "check_model", "channels_last", "layout_of",
           "MODELS", "MLP", "LeNet5",
           "ResNet20", "SmallVGG", "CNN1d", "TransformerClassifier", "MobileNetV2Small",
           "CharTransformer"]


class MLP(nn.Sequential):
    def __init__(self, input_shape, num_classes, hidden=(256, 128)):
        layers: list[nn.Module] = [nn.Flatten()]
        d = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, num_classes))
        super().__init__(*layers)


def _flat_size(features: nn.Module, input_shape) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).numel())


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU: conv 6@5x5 (padded), pool, conv 16@5x5, pool,
    120-84-classes. Max-pooling, as modern LeNet-5 variants use; small inputs (8x8 digits) get a
    padded second convolution so that the shapes stay valid."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        c, h = input_shape[0], input_shape[-1]
        pad2 = 0 if h >= 16 else 2
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=pad2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        n = _flat_size(self.features, input_shape)
        self.classifier = nn.Sequential(nn.Linear(n, 120), nn.ReLU(), nn.Linear(120, 84),
                                        nn.ReLU(), nn.Linear(84, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu2 = nn.ReLU()

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(out + self.shortcut(x))


class ResNet20(nn.Module):
    """The CIFAR ResNet-20 of He et al. (2016): 3 stages of 3 basic blocks, 16/32/64 channels,
    BatchNorm; the paper behind this project trains it on CIFAR-10 in pure fp16."""

    def __init__(self, input_shape, num_classes, width=16):
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(3):
                blocks.append(_Block(cin, cout, 2 if (i == 0 and stage > 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class SmallVGG(nn.Module):
    """A small VGG (Simonyan & Zisserman 2015): two 3x3 conv stages of 32 and 64 channels with
    BatchNorm, then 256-classes."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        c = input_shape[0]

        def stage(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                    nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                    nn.MaxPool2d(2)]

        self.features = nn.Sequential(*stage(c, 32), *stage(32, 64), nn.Flatten())
        n = _flat_size(self.features, input_shape)
        self.classifier = nn.Sequential(nn.Linear(n, 256), nn.ReLU(), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class CNN1d(nn.Module):
    """A 1-D CNN for MNIST-1D (Greydanus 2020): three conv layers of 25 channels."""

    def __init__(self, input_shape, num_classes, channels=25):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv1d(c, channels, 5, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten())
        n = _flat_size(self.features, input_shape)
        self.classifier = nn.Linear(n, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


class TransformerClassifier(nn.Module):
    """A small transformer encoder (Vaswani et al. 2017): the rows of an image (or the positions
    of a 1-D signal) are tokens; 2 layers, 4 heads, width 64, mean pooling."""

    def __init__(self, input_shape, num_classes, d_model=64, layers=2, heads=4):
        super().__init__()
        if len(input_shape) == 3:
            c, h, w = input_shape
            self.tokens, feat = h, c * w
        else:
            c, length = input_shape
            self.tokens, feat = length, c
        self.embed = nn.Linear(feat, d_model)
        self.pos = nn.Parameter(torch.zeros(1, self.tokens, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x):
        if x.dim() == 4:  # (N, C, H, W) -> (N, H, C*W)
            x = x.permute(0, 2, 1, 3).flatten(2)
        else:  # (N, C, L) -> (N, L, C)
            x = x.transpose(1, 2)
        z = self.encoder(self.embed(x) + self.pos)
        return self.head(self.norm(z.mean(dim=1)))


class _InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, 3x3 depthwise, 1x1 linear projection (no ReLU after
    it: a ReLU in the low-dimensional bottleneck destroys information, Sandler et al. 2018,
    section 3.2); a residual connection when the shapes allow it."""

    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                   nn.BatchNorm2d(hidden), nn.ReLU6(),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2Small(nn.Module):
    """A MobileNetV2 (Sandler et al. 2018) for small images: inverted residual blocks with
    depthwise convolutions and ReLU6, scaled down for 28x28 or 32x32 inputs (stem of stride
    1; stages (expansion, channels, blocks, stride) = (1, 16, 1, 1), (4, 24, 2, 2),
    (4, 32, 2, 2), (4, 64, 2, 1); a 1x1 convolution to 128 channels, average pooling, linear).
    Depthwise convolutions are the layers the paper's MobileNet results stress: few weights
    each, so few accumulations per output."""

    STAGES = ((1, 16, 1, 1), (4, 24, 2, 2), (4, 32, 2, 2), (4, 64, 2, 1))

    def __init__(self, input_shape, num_classes, width=16, head=128):
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU6())
        blocks, cin = [], width
        for expand, cout, n, stride in self.STAGES:
            for i in range(n):
                blocks.append(_InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Conv2d(cin, head, 1, bias=False), nn.BatchNorm2d(head),
                                  nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(head, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class CharTransformer(nn.Module):
    """A small character-level language model for the ``text`` data: the window's character
    ids (float features, (N, 1, L)) embedded, a learned position embedding, 2 causal pre-norm
    transformer layers (4 heads, width 48, GELU), and the next character read from the last
    position. The ids index the embedding, so they must reach it as integers: under a pure
    policy whose compute format has fewer than 8 significand bits they would not."""

    def __init__(self, input_shape, num_classes, d_model=48, layers=2, heads=4):
        super().__init__()
        if len(input_shape) != 2 or input_shape[0] != 1:
            raise ValueError(f"chartransformer takes (1, length) character ids, got input "
                             f"shape {tuple(input_shape)}: use it with --data text")
        self.length, self.vocab = input_shape[1], num_classes
        self.embed = nn.Embedding(num_classes, d_model)
        self.pos = nn.Parameter(torch.zeros(1, self.length, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(
            self.length), persistent=False)

    def forward(self, x):
        ids = x[:, 0].round().long().clamp(0, self.vocab - 1)
        z = self.encoder(self.embed(ids) + self.pos, mask=self.causal, is_causal=True)
        return self.head(self.norm(z[:, -1]))


MODELS = {"mlp": MLP, "lenet5": LeNet5, "resnet20": ResNet20, "vgg": SmallVGG, "cnn1d": CNN1d,
          "transformer": TransformerClassifier, "mobilenet": MobileNetV2Small,
          "chartransformer": CharTransformer}
_ACCEPTED = ", ".join(MODELS) + ", module:function"


def build_model(name: str, input_shape, num_classes: int) -> nn.Module:
    if not isinstance(name, str):
        raise ValueError(f"model {name!r}; accepted: {_ACCEPTED}")
    key = name.strip().lower()
    if key in MODELS:
        return MODELS[key](tuple(input_shape), num_classes)
    _, sep, fn_name = name.partition(":")
    if sep and fn_name.isidentifier():
        fn = import_callable(name, "model")
        try:
            model = fn(tuple(input_shape), num_classes)
        except USER_ERRORS as err:  # a wrong signature, or the user's code failing
            raise ValueError(f"model {short(name)}: {fn_name}(input_shape, num_classes) raised "
                             f"{describe_error(err)}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"model {name!r}: {fn_name}() returned {type(model).__name__}, "
                             "not an nn.Module")
        return model
    raise ValueError(f"unknown model {short(name)}; accepted: {_ACCEPTED}")


def check_model(model: nn.Module, name: str, data) -> None:
    """The model has trainable parameters and maps 2 examples of ``data`` to (2, classes)
    logits; ValueError in one line otherwise. Leaves no trace: no RNG draw, no statistics."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model {short(name)} has no trainable parameters")
    x = data.x_train[:2].clone()
    was = model.training
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(x)
    except USER_ERRORS as err:  # the user's forward, sys.exit() included
        raise ValueError(f"model {short(name)} does not fit {data}: {describe_error(err)}"
                         ) from None
    finally:
        model.train(was)
        model.load_state_dict(state)
    if not torch.is_tensor(out) or tuple(out.shape) != (2, data.num_classes):
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ValueError(f"model {short(name)} gives outputs of shape {got} for 2 examples; "
                         f"{data.name} needs (2, {data.num_classes}): one logit per class")


def build_checked_model(name: str, data) -> nn.Module:
    """:func:`build_model` for ``data``, then :func:`check_model`."""
    try:
        model = build_model(name, data.input_shape, data.num_classes)
    except ValueError:
        raise
    except USER_ERRORS as err:  # a built-in model refusing the input shape (RuntimeError...)
        raise ValueError(f"model {short(name)} does not fit {data}: {describe_error(err)}"
                         ) from None
    check_model(model, name, data)
    return model


def _to_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def channels_last(model: nn.Module) -> bool:
    """Lay a model with 2-d convolutions out channels-last (NHWC), its 4-d floating inputs
    too (a forward pre-hook), as PyTorch's CPU performance guide advises: oneDNN's CPU
    convolutions run NHWC without reordering. The runner applies it to the built-in models
    only: a user's model may ``.view()`` a convolution's output, which NHWC refuses. It makes
    the built-in CNNs' fp32 training steps faster (benchmarks/RESULTS.md, figure F21). Every
    policy of a comparison trains
    the same layout; the emulated backend rounds channels-last tensors in place of their
    layout (:func:`lowprec.numerics.quantize.memory_order`). Returns whether it changed the
    model (False without ``nn.Conv2d``)."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return False
    model.to(memory_format=torch.channels_last)
    if getattr(model, "_lowprec_channels_last", False):
        return True  # its inputs are converted already
    model._lowprec_channels_last = True
    model.register_forward_pre_hook(
        lambda m, args, kwargs: (map_floating(args, _to_channels_last),
                                 map_floating(kwargs, _to_channels_last)), with_kwargs=True)
    return True


def layout_of(model: nn.Module) -> str:
    """``"channels_last"`` where the model's 4-d parameters are laid out so (and not also
    contiguous, as 1x1 kernels of one channel are), else ``"contiguous"``: what a run records."""
    four = [p for p in model.parameters() if p.dim() == 4]
    cl = [p for p in four if not p.is_contiguous()
          and p.is_contiguous(memory_format=torch.channels_last)]
    return "channels_last" if cl else "contiguous"
