"""Fidelity table: emulated 16-true against torch's native CPU fp16 on whole models.

Usage: PYTHONPATH=src:. python benchmarks/fidelity_models.py [--match-cpu-kernels] [model ...]
Per model (the same fp16-rounded weights and input in every run, as tests/training do): forward
and gradient ratio ||emulated - native fp16|| / ||fp32 - native fp16|| (0: identical to native,
1: no closer than plain fp32), and error ||emulated - float64|| / ||native fp16 - float64||
(1: as far from exact as native fp16 is). Models: the Hugging Face RMSNorm, a Llama decoder and
a T5 encoder-decoder from ``transformers`` (tiny configs, random weights),
nn.MultiheadAttention(batch_first=True), the tests' small transformer and ResNet, and the
recurrent models (GRU, packed bidirectional LSTM, stacked LSTM with dropout).
``--match-cpu-kernels``: emulated with ``match_cpu_kernels=True`` (convolutions in the reference
kernel's order, matrix products by this CPU's 16-bit kernels).
"""
import sys

import torch

sys.path.insert(0, ".")
from tests.training.test_fidelity import (RECURRENT, Transformer, _x, fidelity,  # noqa: E402
                                          resnet)
from tests.training.test_logical_dtypes import (MHA, HFRMSNorm, Logits, _hf_llama,  # noqa: E402
                                                _hf_t5)

MODELS = {
    "hf_rmsnorm": (HFRMSNorm, lambda: _x(8, 256)),
    "llama": (lambda: Logits(_hf_llama()), lambda: _x(4, 16, ints=128)),
    "t5": (lambda: Logits(_hf_t5(), t5=True), lambda: _x(4, 12, ints=128)),
    "mha_batch_first": (MHA, lambda: _x(4, 10, 32)),
    "transformer": (Transformer, lambda: _x(4, 16, ints=50)),
    "resnet": (lambda: resnet(16), lambda: _x(8, 3, 16, 16)),
    **{name: (make, lambda: _x(4, 10, 12)) for name, make in RECURRENT.items()},
}


def main(names, match_cpu_kernels=False):
    print(f"{'model':28s} {'fwd ratio':>9s} {'grad ratio':>10s} {'fwd error':>9s} "
          f"{'grad error':>10s}")
    for name in names or MODELS:
        make, x = MODELS[name]
        torch.manual_seed(0)
        r = fidelity(make(), x(), match_cpu_kernels)
        print(f"{name:28s} {r['forward'][0]:9.3f} {r['grads'][0]:10.3f} {r['forward'][1]:9.3f} "
              f"{r['grads'][1]:10.3f}", flush=True)


if __name__ == "__main__":
    flag = "--match-cpu-kernels"
    main([a for a in sys.argv[1:] if a != flag], flag in sys.argv[1:])
