"""Scaled GEMM recipes: how each operand of the three GEMMs of a layer is cast.

A linear layer y = x W^T runs three GEMMs (torchao ``Float8Linear``'s names):

    output       = input       @ weight^T       (forward)
    grad_input   = grad_output @ weight          (backward)
    grad_weight  = grad_output^T @ input         (backward)

A :class:`GemmScaling` gives each operand of each GEMM a :class:`ScaledCast`
(:mod:`lowprec.numerics.scaling`): ``input``, ``weight`` and ``grad_output`` for their first
use, and ``input_gw`` (input in grad_weight), ``weight_gi`` (weight in grad_input) and
``grad_output_gw`` (grad_output in grad_weight), which default to the first three as torchao's
``cast_config_*_for_*`` do. Scales, tiles and blocks run along each GEMM's reduction axis.
``ops`` says which ops the recipe covers: ``linear`` (every ``F.linear``, as torchao converts
``nn.Linear``), or ``linear+matmul`` (also ``matmul``/``mm``/``bmm`` of two tensors: attention's
GEMMs, with the first operand in the input's roles and the second in the weight's).

A policy carries a recipe under the key ``sc=``: a named recipe, or ``;``-separated
``role=cast`` items after an optional recipe name (later items override it)::

    p=fp32,sc=fp8-rowwise
    p=fp32,sc=fp8-tensorwise;go=e4m3fn@tensor
    p=fp32,sc=i=e4m3fn@1x128;w=e4m3fn@128x128;go=e4m3fn@1x128;ops=linear+matmul

Roles: ``i`` (input), ``w`` (weight), ``go`` (grad_output), ``i_gw``, ``w_gi``, ``go_gw``. A
first-use role given explicitly also sets its second use unless that is given too
(``fp8-rowwise-gw-hp;w=e4m3fn@tensor`` casts the weight per tensor in both GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..numerics.scaling import HP, ScaledCast, parse_cast

__all__ = ["GemmScaling", "RECIPES", "parse_scaling", "ROLES", "SCALED_OPS"]

#: short role names of the spec -> field names
ROLES = {"i": "input", "w": "weight", "go": "grad_output", "i_gw": "input_gw",
         "w_gi": "weight_gi", "go_gw": "grad_output_gw"}
_OPS = {"linear": ("linear",), "linear+matmul": ("linear", "matmul", "mm", "bmm")}
#: every op a recipe can cover
SCALED_OPS = frozenset(_OPS["linear+matmul"])


@dataclass(frozen=True)
class GemmScaling:
    """The casts of the operands of a layer's forward GEMM and both backward GEMMs."""

    input: ScaledCast = HP
    weight: ScaledCast = HP
    grad_output: ScaledCast = HP
    input_gw: ScaledCast | None = None
    weight_gi: ScaledCast | None = None
    grad_output_gw: ScaledCast | None = None
    ops: str = "linear"
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for role in ("input", "weight", "grad_output"):
            object.__setattr__(self, role, parse_cast(getattr(self, role)))
        for role, base in (("input_gw", "input"), ("weight_gi", "weight"),
                           ("grad_output_gw", "grad_output")):
            v = getattr(self, role)
            object.__setattr__(self, role, getattr(self, base) if v is None else parse_cast(v))
        if self.ops not in _OPS:
            raise ValueError(f"ops={self.ops!r}; accepted: {', '.join(_OPS)}")

    @property
    def op_names(self) -> tuple[str, ...]:
        """The torch op names the recipe covers (``linear``, and ``matmul``/``mm``/``bmm``)."""
        return _OPS[self.ops]

    @property
    def casts(self) -> dict[str, ScaledCast]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in ROLES.values()}

    @property
    def spec(self) -> str:
        """The explicit spec (every role); ``parse_scaling(s.spec) == s``."""
        parts = [f"{short}={getattr(self, role)}" for short, role in ROLES.items()]
        if self.ops != "linear":
            parts.append(f"ops={self.ops}")
        return ";".join(parts)

    def __str__(self) -> str:
        for name, recipe in RECIPES.items():
            if recipe == self:
                return name
        return self.spec


RECIPES: dict[str, GemmScaling] = {}


def _recipe(name: str, **casts) -> None:
    RECIPES[name] = GemmScaling(**casts, name=name)


# torchao 0.18 Float8LinearConfig.from_recipe_name("tensorwise"): dynamic per-tensor scales,
# e4m3 for input and weight, e5m2 for the gradient
_recipe("fp8-tensorwise", input="e4m3fn@tensor", weight="e4m3fn@tensor",
        grad_output="e5m2@tensor")
# the same formats with no scale at all (scale 1): what "just cast to fp8" does, the baseline
# every scaled recipe improves on (Micikevicius et al. 2022, section 3)
_recipe("fp8-unscaled", input="e4m3fn@none", weight="e4m3fn@none", grad_output="e5m2@none")
# "rowwise": per-row scales along each GEMM's reduction axis, e4m3 everywhere, scales rounded
# down to powers of two (round_scales_to_power_of_2=True)
_recipe("fp8-rowwise", input="e4m3fn@axis:pow2", weight="e4m3fn@axis:pow2",
        grad_output="e4m3fn@axis:pow2")
# "rowwise_with_gw_hp": grad_input's weight per tensor, grad_weight in high precision
_recipe("fp8-rowwise-gw-hp", input="e4m3fn@axis:pow2", weight="e4m3fn@axis:pow2",
        grad_output="e4m3fn@axis:pow2", weight_gi="e4m3fn@tensor:pow2", input_gw="hp",
        grad_output_gw="hp")
# delayed scaling (Micikevicius et al. 2022, Transformer Engine's default): the scale of each
# operand from the largest amax of its 16 previous casts
_recipe("fp8-delayed", input="e4m3fn@delayed16", weight="e4m3fn@delayed16",
        grad_output="e5m2@delayed16")
# DeepSeek-V3 (arXiv:2412.19437, 3.3.1): 1x128 tiles for activations and gradients, 128x128
# blocks for weights, e4m3 everywhere, fp32 scales
_recipe("fp8-blockwise", input="e4m3fn@1x128", weight="e4m3fn@128x128",
        grad_output="e4m3fn@1x128")
# OCP MX v1.0: 32-element blocks along the reduction axis, E8M0 scales (the spec's floor rule)
_recipe("mxfp8", input="e4m3fn@mx", weight="e4m3fn@mx", grad_output="e4m3fn@mx")
_recipe("mxfp4", input="e2m1fn@mx", weight="e2m1fn@mx", grad_output="e2m1fn@mx")
# NVFP4 (arXiv:2509.25149): e2m1 in 16-element blocks with e4m3 scales and an fp32 tensor scale
_recipe("nvfp4", input="e2m1fn@nvfp4", weight="e2m1fn@nvfp4", grad_output="e2m1fn@nvfp4")
# ... with the gradient's elements rounded stochastically in both backward GEMMs, as the NVFP4
# pretraining recipe does (arXiv:2509.25149, 4.3; its random Hadamard transform and 16x16 weight
# blocks are not modelled)
_recipe("nvfp4-sr", input="e2m1fn@nvfp4", weight="e2m1fn@nvfp4",
        grad_output="e2m1fn:sr@nvfp4")


def parse_scaling(spec: str | GemmScaling | None) -> GemmScaling | None:
    """A recipe from its spec (see the module docstring); ``none`` or None gives None."""
    if spec is None or isinstance(spec, GemmScaling):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a scaled-GEMM recipe is a name or a spec string, got {spec!r}")
    items = [s.strip() for s in spec.split(";") if s.strip()]
    if not items or items == ["none"]:
        return None
    base: dict = {}
    if "=" not in items[0]:
        name = items.pop(0).lower()
        if name not in RECIPES:
            raise ValueError(f"unknown scaled-GEMM recipe {name!r}; named recipes: "
                             f"{', '.join(RECIPES)}; or role=cast items (roles "
                             f"{', '.join(ROLES)}, ops)")
        base = {k: v for k, v in RECIPES[name].casts.items()}
        base["ops"] = RECIPES[name].ops
    given: set[str] = set()
    for item in items:
        key, eq, val = (s.strip() for s in item.partition("="))
        key = key.lower()
        if not eq:
            raise ValueError(f"scaled-GEMM item {item!r} is not role=cast (a recipe name comes "
                             "first)")
        if key in given:
            raise ValueError(f"scaled-GEMM role {key} given twice")
        given.add(key)
        if key == "ops":
            base["ops"] = val.lower()
        elif key in ROLES:
            base[ROLES[key]] = parse_cast(val)
        else:
            raise ValueError(f"scaled-GEMM role {key!r}; accepted: {', '.join(ROLES)}, ops")
    # a first-use cast given explicitly also sets its second use unless that one is given too
    for role, second in (("input", "input_gw"), ("weight", "weight_gi"),
                         ("grad_output", "grad_output_gw")):
        short = {v: k for k, v in ROLES.items()}
        if short[role] in given and short[second] not in given:
            base[second] = base[role]
    return GemmScaling(**base)

