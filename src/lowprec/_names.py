"""The names the ``lowprec`` command offers for shell completion, in the standard library alone.

A TAB must not wait for torch (seconds): the console script (:mod:`lowprec_cmd`) builds the
parser of :mod:`lowprec.cli` without importing the package's library modules, and its completers
read the registries' names from here. Each tuple is a copy of a registry, in its order;
tests/test_completion.py checks that they are equal, so that a name added to a registry and not
here fails a test rather than going missing from completion.
"""

from __future__ import annotations

__all__ = ["POLICY_NAMES", "POLICY_KEYS", "POLICY_FORMAT_KEYS", "PLAN_PREFIX", "PRESET_NAMES",
           "DEFAULT_POLICIES", "DATASET_NAMES", "DATASET_KINDS", "MODEL_NAMES", "FORMAT_NAMES",
           "ROUNDING_NAMES", "PLAN_LEVELS"]

#: lowprec.training.policy.POLICIES, once the package is imported (the scaled recipes included)
POLICY_NAMES = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed", "16-master",
                "fixed16-sr", "fixed16-rn", "dfxp-10-12", "fixed-10-12", "binary",
                "binary-stochastic", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
                "mxfp4", "mxint8", "fp8-tensorwise", "fp8-unscaled", "fp8-rowwise",
                "fp8-rowwise-gw-hp", "fp8-delayed", "fp8-blockwise", "mxfp8", "nvfp4", "nvfp4-sr")
#: the short keys of a compact policy spec (lowprec.training.policy._KEYS), one per role
POLICY_KEYS = ("p", "c", "g", "o", "m", "ls", "b", "s", "r", "u", "sc", "acc")
#: the keys whose value is a number format
POLICY_FORMAT_KEYS = ("p", "c", "g", "o", "m")
#: lowprec.training.plan.PLAN_PREFIX ("plan:FILE" as a policy)
PLAN_PREFIX = "plan:"
#: lowprec.experiments.config.PRESETS and DEFAULT_POLICIES
PRESET_NAMES = ("default", "gupta", "courbariaux", "binarynet", "mx", "fp8", "fp4",
                "accumulation", "yun2023")
DEFAULT_POLICIES = ("32-true", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "16-master")
#: lowprec.experiments.data.DATASETS, and the kinds written KIND:PATH
DATASET_NAMES = ("mnist", "digits", "mnist1d", "fashion-mnist", "text")
DATASET_KINDS = ("idx", "cifar10", "fashion-mnist", "text")
#: lowprec.experiments.models.MODELS
MODEL_NAMES = ("mlp", "lenet5", "resnet20", "vgg", "cnn1d", "transformer", "mobilenet",
               "chartransformer")
#: lowprec.numerics.formats.NAMED_FORMATS
FORMAT_NAMES = ("fp32", "tf32", "fp16", "bf16", "fp8_e5m2", "fp8_e4m3", "fp8_e4m3fnuz",
                "fp8_e5m2fnuz", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "q2.14", "q8.8", "mxfp8_e4m3",
                "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8", "dfx<10>", "binary")
#: the rounding modes by their long names (lowprec.numerics.rounding; srN is any N)
ROUNDING_NAMES = ("nearest", "nearest_away", "toward_zero", "up", "down", "stochastic")
#: lowprec.experiments.planner.LEVELS (lowprec plan --menu)
PLAN_LEVELS = ("fp32", "bf16", "fp16", "fp8", "mxfp8", "fixed16-sr", "mixed16", "nvfp4", "mxfp4")
