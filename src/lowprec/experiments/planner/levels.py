"""The planner's levels: what a module can be put in (parameter storage, compute and gradient
formats), the menu a search draws from, and the uniform policies trained beside a plan."""

from __future__ import annotations

from ...training.policy import parse_policy

__all__ = ["LEVELS", "DEFAULT_MENU", "UNIFORM", "SLOTS", "uniform_policy", "parse_menu",
           "parse_compare_with"]

#: the levels a module can be put in: parameter storage, compute and gradient formats
#: (optimizer state and the loss scale are the base policy's, for every module)
LEVELS = {
    "fp32": "p=fp32,c=fp32,g=fp32",
    "bf16": "p=bf16,c=bf16,g=bf16",
    "fp16": "p=fp16,c=fp16,g=fp16",
    # fp8 GEMM operands and outputs (e4m3 forward, e5m2 gradients rounded stochastically),
    # weights stored in bf16 and cast at use
    "fp8": "p=bf16,c=e4m3fn,g=e5m2:sr",
    # OCP MX blocks of 32 along the reduction axis (the engine's block formats), bf16 storage
    "mxfp8": "p=bf16,c=mxfp8_e4m3,g=bf16",
    # Gupta et al. (2015): 16-bit fixed point, stochastic rounding of activations and gradients
    "fixed16-sr": "p=q6.10,c=q6.10:sr,g=q6.10:sr",
    # 16-mixed (torch.autocast, Micikevicius et al. 2018): fp32 parameters, fp16 compute of
    # the matmul-like layers only (norms and embeddings in fp32); the loss scale is the
    # plan's (dynamic where a level needs one; the uniform comparator is "16-mixed" itself)
    "mixed16": "p=fp32,c=fp16,g=fp16,s=matmul",
    # NVFP4 (arXiv:2509.25149): every linear layer's three GEMMs on e2m1 in 16-element blocks
    # along the reduction axis with e4m3 scales and an fp32 tensor scale, gradients rounded
    # stochastically; everything else, and the weights' storage, in bf16
    "nvfp4": "p=bf16,c=bf16,g=bf16,sc=nvfp4-sr",
    # OCP MX v1.0 MXFP4: e2m1 in 32-element blocks along the reduction axis, E8M0 scales, for
    # the three GEMMs of every linear layer; bf16 elsewhere
    "mxfp4": "p=bf16,c=bf16,g=bf16,sc=mxfp4",
}
DEFAULT_MENU = ("fp32", "bf16", "fp16", "fp8")
#: the uniform policy a level is compared as, where it is not the level with its own
#: parameter format as optimizer state
UNIFORM = {"mixed16": "16-mixed"}
#: optimizer state tensors per parameter (SGD with momentum)
SLOTS = {"sgd": 1}


def uniform_policy(level: str) -> str:
    """The uniform policy of ``level``: ``16-mixed`` for mixed16, else the level with its
    parameter format as optimizer state."""
    if level in UNIFORM:
        return UNIFORM[level]
    return f"{LEVELS[level]},o={parse_policy(LEVELS[level]).params}"


def parse_menu(menu) -> tuple[str, ...]:
    """``"fp32,bf16,fp16"`` or a sequence of level names -> names (fp32 added: the fallback);
    ValueError naming the accepted levels."""
    names = [m.strip() for m in (menu.split(",") if isinstance(menu, str) else menu)]
    if not names or not all(names):
        raise ValueError(f"menu {str(menu)[:120]!r} holds an empty level; accepted levels: "
                         f"{', '.join(LEVELS)}, separated by single commas")
    for n in names:
        if n not in LEVELS:
            raise ValueError(f"unknown menu level {n!r}; accepted: {', '.join(LEVELS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"menu {','.join(names)} names a level twice")
    if "fp32" not in names:
        names.append("fp32")
    return tuple(names)


def parse_compare_with(compare_with, menu: tuple[str, ...],
                       compare_uniform: bool = True) -> tuple[str, ...]:
    """The levels trained uniformly beside the plan besides the menu's: ``compare_with`` (level
    names, ``16-mixed`` for mixed16; a comma-separated string or a sequence); by default
    mixed16 (the ``16-mixed`` policy) when fp16 is in the menu. Levels of the menu are trained
    anyway and dropped here, unless ``compare_uniform`` is false."""
    if compare_with is None:
        names = ["mixed16"] if compare_uniform and "fp16" in menu else []
    else:
        if isinstance(compare_with, str):
            raw = compare_with.split(",")
        elif isinstance(compare_with, (list, tuple)) and all(isinstance(n, str)
                                                            for n in compare_with):
            raw = list(compare_with)
        else:
            raise ValueError(f"compare_with={compare_with!r}; accepted: level names, a "
                             "comma-separated string or a list (16-mixed, "
                             f"{', '.join(LEVELS)})")
        names = [{"16-mixed": "mixed16"}.get(n.strip(), n.strip()) for n in raw if n.strip()]
        for n in names:
            if n not in LEVELS:
                raise ValueError(f"compare_with level {n!r}; accepted: 16-mixed, "
                                 f"{', '.join(LEVELS)}")
    out: list[str] = []
    for n in names:
        # a menu level is trained uniformly anyway, unless compare_uniform=False
        if (n not in menu or not compare_uniform) and n not in out:
            out.append(n)
    return tuple(out)
