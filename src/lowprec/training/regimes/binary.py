"""BinaryNet (Courbariaux, Hubara, Soudry, El-Yaniv, Bengio 2016): binary weights and activations.

* ``BinaryLinear`` / ``BinaryConv2d`` keep real-valued *latent* weights, clipped to [-1, 1]
  after every update, and compute with their binarization: deterministic sign (0 maps to +1),
  or stochastic, +1 with probability p = clip((w + 1) / 2, 0, 1) (so E[w_b] = w).
* ``BinaryActivation`` outputs sign(x); its straight-through gradient is cancelled where
  |x| > 1 (the derivative of hard tanh), as in the paper's Algorithm 1.
* ``binarize(model)`` replaces, in place, every linear and convolution layer by its binary
  version (sharing the latent weights) followed by BatchNorm, and every activation by
  ``BinaryActivation``; the first layer therefore sees the real inputs, the others binary ones,
  and the output layer is real-valued. A batch with one value per channel (a last batch of one
  example) is normalised with the batch norm's running statistics, which it leaves unchanged.

:class:`BinaryRegime` plugs this into ``Precision`` for policies whose compute format is
``binary``: it binarizes the model at set-up, gives the optimizer the added BatchNorm
parameters and, with optimizers that honour ``lr_scale`` (lowprec's), scales each layer's
latent-weight learning rate by the inverse of its Glorot coefficient, as the paper does; after
every step it clips the latent weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ...numerics.formats import BinaryFormat
from ...numerics.rounding import check_generator
from .base import Regime, register_regime

__all__ = ["BinaryRegime", "BinaryLinear", "BinaryConv2d", "BinaryActivation", "FeatureBatchNorm",
           "BinaryBatchNorm2d",
           "binarize", "binarize_weights",
           "sign_ste", "clip_latent_weights", "binary_layers", "glorot_lr_scales",
           "apply_lr_scales"]


class _SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stochastic, generator):
        ctx.save_for_backward(x)
        if stochastic:
            p = ((x + 1) / 2).clamp(0, 1)
            u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device) \
                if generator is None or generator.device == x.device else torch.rand(
                    x.shape, generator=generator, dtype=x.dtype).to(x.device)
            return torch.where(u < p, 1.0, -1.0).to(x.dtype)
        return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)  # sign, 0 -> +1

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        # hard-tanh straight-through estimator: pass where |x| <= 1, cancel elsewhere
        return grad * (x.abs() <= 1).to(grad.dtype), None, None


def sign_ste(x: torch.Tensor, stochastic: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor:
    return _SignSTE.apply(x, stochastic, generator)


def binarize_weights(w: torch.Tensor, stochastic: bool = False,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    return sign_ste(w, stochastic, generator)


class BinaryActivation(nn.Module):
    def forward(self, x):
        return sign_ste(x)


class _BinaryMixin:
    stochastic: bool = False
    generator: torch.Generator | None = None

    def binary_weight(self) -> torch.Tensor:
        # the forward pass uses stochastic binarization only while training
        return binarize_weights(self.weight, self.stochastic and self.training, self.generator)


    def _after(self, y):
        # the BatchNorm binarize() attaches as a child (``bn``), so that the layer keeps its
        # own attributes (``weight``, which e.g. Hugging Face's ViT reads for its input dtype)
        bn = self._modules.get("bn")
        return bn(y) if bn is not None else y


class BinaryLinear(_BinaryMixin, nn.Linear):
    def forward(self, x):
        return self._after(nn.functional.linear(x, self.binary_weight(), self.bias))


class BinaryConv2d(_BinaryMixin, nn.Conv2d):
    def forward(self, x):
        return self._after(self._conv_forward(x, self.binary_weight(), self.bias))


class _OneValueSafe:
    """A batch that holds one value per channel (a last batch of one example after a linear
    layer, or of one 1x1 feature map) has no batch statistics: torch raises "Expected more than
    1 value per channel when training". The batch norm that :func:`binarize` inserts
    normalises such a batch with its running statistics instead, as in evaluation, and leaves
    them (and ``num_batches_tracked``) unchanged; its scale and shift still get their
    gradients. Every other batch is normalised as by torch's batch norm."""

    def _one_value(self, x: torch.Tensor) -> bool:
        return (self.training and self.track_running_stats and self.running_mean is not None
                and x.numel() == x.shape[1])

    def forward(self, x):
        if self._one_value(x):
            self._check_input_dim(x)
            return nn.functional.batch_norm(x, self.running_mean, self.running_var,
                                            self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


class FeatureBatchNorm(_OneValueSafe, nn.BatchNorm1d):
    """BatchNorm over the last (feature) axis of an input of any rank: (N, C) as BatchNorm1d,
    and (N, L, C) token sequences as one batch of N * L feature vectors (the statistics of
    every position of every sequence), which is how BinaryNet's batch normalization after a
    fully connected layer reads for a transformer's per-token linear layers. A batch of one
    feature vector is normalised with the running statistics (see :class:`_OneValueSafe`)."""

    def forward(self, x):
        if x.dim() == 2:
            return super().forward(x)
        shape = x.shape
        return super().forward(x.reshape(-1, shape[-1])).reshape(shape)


class BinaryBatchNorm2d(_OneValueSafe, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` after a binary convolution; a batch of one 1x1 feature map is
    normalised with the running statistics (see :class:`_OneValueSafe`)."""


_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Tanh, nn.LeakyReLU, nn.GELU, nn.SiLU,
                nn.Sigmoid, nn.ELU)


def _binary_copy(m: nn.Module, stochastic: bool, generator) -> nn.Module:
    if isinstance(m, nn.Linear):
        b = BinaryLinear.__new__(BinaryLinear)
    else:
        b = BinaryConv2d.__new__(BinaryConv2d)
    b.__dict__ = m.__dict__  # the same parameters (the optimizer keeps pointing at them)
    b.stochastic, b.generator = stochastic, generator
    return b


def binarize(model: nn.Module, *, stochastic: bool = False,
             generator: torch.Generator | None = None, batchnorm: bool = True
             ) -> list[nn.Parameter]:
    """Transform ``model`` in place (see the module docstring); returns the parameters it
    added (BatchNorm scales and shifts), for the optimizer."""
    check_generator(generator)
    added: list[nn.Parameter] = []

    def visit(parent: nn.Module) -> None:
        names = list(parent._modules)
        for i, name in enumerate(names):
            child = parent._modules[name]
            if child is None:
                continue
            if type(child) in (nn.Linear, nn.Conv2d):
                b = _binary_copy(child, stochastic, generator)
                nxt = parent._modules.get(names[i + 1]) if i + 1 < len(names) else None
                if batchnorm and not isinstance(nxt, (nn.BatchNorm1d, nn.BatchNorm2d)):
                    bn = (FeatureBatchNorm if isinstance(child, nn.Linear) else BinaryBatchNorm2d)(
                        child.out_features if isinstance(child, nn.Linear) else
                        child.out_channels).to(child.weight.device)
                    added.extend(bn.parameters())
                    b.bn = bn
                parent._modules[name] = b
            elif isinstance(child, _ACTIVATIONS):
                parent._modules[name] = BinaryActivation()
            elif isinstance(child, (BinaryLinear, BinaryConv2d, BinaryActivation)):
                continue
            else:
                visit(child)

    visit(model)
    clip_latent_weights(model)
    return added


def binary_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (BinaryLinear, BinaryConv2d))]


def glorot_lr_scales(model: nn.Module) -> dict[int, float]:
    """BinaryNet's learning-rate scale of each binary layer's latent weights: the inverse of
    Glorot's initialization coefficient, sqrt((fan_in + fan_out) / 1.5) (Courbariaux et al.
    2016, following their BinaryConnect code), keyed by id(weight)."""
    scales = {}
    for m in binary_layers(model):
        w = m.weight
        receptive = w[0][0].numel() if w.dim() > 2 else 1
        fan_in, fan_out = w.shape[1] * receptive, w.shape[0] * receptive
        scales[id(w)] = ((fan_in + fan_out) / 1.5) ** 0.5
    return scales


def apply_lr_scales(optimizer, scales: dict[int, float]) -> None:
    """Move the scaled parameters into groups of their own carrying ``lr_scale`` (honoured by
    lowprec's optimizers); call before the first step."""
    new_groups = []
    for group in optimizer.param_groups:
        keep = [p for p in group["params"] if id(p) not in scales]
        moved = [p for p in group["params"] if id(p) in scales]
        group["params"] = keep
        for p in moved:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [p]
            g["lr_scale"] = scales[id(p)]
            new_groups.append(g)
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    optimizer.param_groups.extend(new_groups)


@torch.no_grad()
def clip_latent_weights(model: nn.Module) -> None:
    """Keep the latent weights in [-1, 1] (BinaryNet clips them after every update)."""
    for m in binary_layers(model):
        m.weight.clamp_(-1.0, 1.0)


@register_regime
class BinaryRegime(Regime):
    """BinaryNet as a regime (see the module docstring)."""

    name = "binary"
    replaces_compute = True  # the binary layers compute their own precision

    @classmethod
    def applies(cls, policy) -> bool:
        return isinstance(policy.compute, BinaryFormat)

    def prepare(self, model: nn.Module) -> list[nn.Parameter]:
        self.model = model
        return binarize(model, stochastic=self.policy.rounding.is_stochastic,
                        generator=self.generator)

    def configure_optimizer(self, optimizer, added: list[nn.Parameter]) -> None:
        if added:
            optimizer.add_param_group({"params": added})
        # lowprec's optimizers say so (PolicyOptimizer.honours_lr_scale); torch's have no flag
        if getattr(optimizer, "honours_lr_scale", False) is True:
            apply_lr_scales(optimizer, glorot_lr_scales(self.model))

    def after_step(self, model: nn.Module) -> None:
        clip_latent_weights(model)
