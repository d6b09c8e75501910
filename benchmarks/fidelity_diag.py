"""Find the first module/op whose output differs between native fp16 and emulated 16-true.

Usage: PYTHONPATH=src:tests python benchmarks/fidelity_diag.py [transformer|resnet] [seed]
       [--match-cpu-kernels]
Runs the model natively (``model.half()``) and under emulated ``16-true`` with the same
fp16-rounded weights and input, records every leaf module's output in both (forward hooks),
and prints, per module in execution order, the number of elements that differ and the largest
difference in fp16 ulps; then re-runs each differing module's native input through the
emulated module, to tell "this op differs" from "its input had already drifted".
"""
import copy
import sys

import torch

sys.path.insert(0, "tests")
from training.test_fidelity import Transformer, resnet, _x, ulp_distance  # noqa: E402

from lowprec import Precision  # noqa: E402


def record(model):
    outs, ins = [], []
    for name, m in model.named_modules():
        if not list(m.children()):
            def hook(m, a, o, name=name):
                outs.append((name, o.detach().float().clone()))
                ins.append((name, [t.detach().clone() for t in a if torch.is_tensor(t)]))
            m.register_forward_hook(hook)
    return outs, ins


def main(which="transformer", seed=0, match=False):
    torch.manual_seed(int(seed))
    model = Transformer() if which == "transformer" else resnet(16)
    x = _x(4, 16, ints=50) if which == "transformer" else _x(8, 3, 16, 16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    nat = copy.deepcopy(model).half().train()
    no, ni = record(nat)
    nat(x.half() if x.is_floating_point() else x)
    emu, _ = Precision("16-true", match_cpu_kernels=match).setup(copy.deepcopy(model))
    emu.train()
    eo, _ = record(emu)
    emu(x)
    mods = dict(emu.named_modules())
    for (name, a), (_, b), (_, inp) in zip(no, eo, ni):
        diff = int((a != b).sum())
        msg = f"{name:24s} differ {diff:6d}/{a.numel():6d}"
        if diff:
            msg += f" max {ulp_distance(a, b, torch.float16)} ulp"
            # the emulated module on native's own input (copy: modules may update buffers)
            m = copy.deepcopy(mods[name])
            with torch.no_grad():
                y = m(*[t.float() if t.is_floating_point() else t for t in inp]).float()
            d2 = int((y != a).sum())
            msg += f" | on native input: differ {d2}" + (
                f" max {ulp_distance(y, a, torch.float16)} ulp" if d2 else "")
        print(msg)


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    unknown = set(flags) - {"--match-cpu-kernels"}
    if unknown:
        sys.exit(f"fidelity_diag: unknown option {sorted(unknown)[0]}; accepted: --match-cpu-kernels")
    main(*[a for a in sys.argv[1:] if not a.startswith("--")], match="--match-cpu-kernels" in flags)
