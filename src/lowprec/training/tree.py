"""Tensors inside a model's inputs and outputs: casting floating ones, finding the output.

Real models take more than one tensor: keyword arguments, dicts of tensors (a tokenizer's
``BatchEncoding``), nested tuples, ``PackedSequence``; and return tuples, dicts or Hugging Face
``ModelOutput`` objects. Integer tensors (token ids, masks, lengths) are never cast: a
vocabulary of 30,522 ids is not representable in fp16 (integers are exact only up to 2048), and
``nn.Embedding`` wants them as integers anyway.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["tensors_in", "map_floating", "cast_floating", "output_tensor", "call_model", "batch_size_of",
           "slice_batch"]


def tensors_in(obj, out: list) -> list:
    """Append every tensor of ``obj`` (nested tuples, lists, dicts) to ``out``; returns it."""
    if isinstance(obj, torch.Tensor):  # (torch.is_tensor is this, behind a call)
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_in(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_in(v, out)
    return out


def map_floating(obj, fn):
    """``obj`` with ``fn`` applied to every floating-point tensor in it (tuples, lists, dicts,
    named tuples such as ``PackedSequence``, nested); everything else is returned as it is."""
    if torch.is_tensor(obj):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple, PackedSequence
        return type(obj)(*(map_floating(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_floating(v, fn) for v in obj)
    if isinstance(obj, Mapping):
        items = {k: map_floating(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:  # BatchEncoding, OrderedDict, ModelOutput: keep the type where it rebuilds
            return type(obj)(items)
        except Exception:  # noqa: BLE001 - a mapping type we cannot rebuild: a plain dict
            return items
    return obj


def cast_floating(obj, dtype: torch.dtype):
    """Floating tensors in ``obj`` cast to ``dtype``; integer and bool tensors untouched."""
    return map_floating(obj, lambda t: t if t.dtype == dtype else t.to(dtype))


def _first_tensor(obj):
    if torch.is_tensor(obj):
        return obj
    values = obj.values() if isinstance(obj, Mapping) else (
        obj if isinstance(obj, (tuple, list)) else ())
    for v in values:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def output_tensor(out, output_fn=None) -> torch.Tensor:
    """The tensor a model's output stands for: ``output_fn(out)`` when given; the tensor
    itself; a mapping's (``ModelOutput``'s) ``logits``, else its first tensor; a tuple's first
    tensor (an LSTM's output sequence before its states)."""
    if output_fn is not None:
        out = output_fn(out)
        if not torch.is_tensor(out):
            raise TypeError(f"output_fn must return a tensor, got {type(out).__name__}")
        return out
    if isinstance(out, Mapping) and torch.is_tensor(out.get("logits")):
        return out["logits"]
    t = _first_tensor(out)
    if t is None:
        raise TypeError(f"no tensor in the model's output ({type(out).__name__}); pass "
                        "output_fn=... to pick one")
    return t


def call_model(model, inputs):
    """``model(**inputs)`` for a mapping of keyword inputs, ``model(*inputs)`` for a plain tuple
    of positional inputs (wrap a dict in a 1-tuple to pass it as one argument), else
    ``model(inputs)`` (a tensor, a list, a named tuple such as ``PackedSequence``)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if type(inputs) is tuple:
        return model(*inputs)
    return model(inputs)


def batch_size_of(inputs) -> int:
    """The leading dimension of the first tensor in ``inputs``."""
    t = _first_tensor(inputs)
    if t is None:
        raise TypeError(f"no tensor in the inputs ({type(inputs).__name__})")
    return int(t.shape[0])


def slice_batch(inputs, start: int, stop: int):
    """Rows ``start:stop`` of every tensor in ``inputs`` (tensor, tuple, list or mapping);
    0-dim tensors (a scale passed with the batch) are left whole."""
    if torch.is_tensor(inputs):
        return inputs[start:stop] if inputs.dim() else inputs  # a 0-dim tensor is shared
    if isinstance(inputs, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(slice_batch(v, start, stop) for v in inputs)
    return inputs
