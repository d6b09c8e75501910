"""What a comparison is: its configuration, validated, and the presets of the literature."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..training.plan import is_plan_spec, load_plan
from ..training.policy import Policy, parse_policy, split_top

__all__ = ["CompareConfig", "DEFAULT_POLICIES", "PRESETS", "OPTIMIZERS", "SCHEDULES", "RunError",
           "lr_at", "split_policies", "split_models", "parse_named_policy"]

DEFAULT_POLICIES = ("32-true", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "16-master")

#: Experiments of the literature, as compare settings (``lowprec compare --preset NAME``);
#: explicit flags override them.
PRESETS: dict[str, dict] = {
    "default": {},
    # Gupta et al. (2015): <IL, FL> fixed point, round-to-nearest against stochastic rounding,
    # FL swept at a fixed IL of 6 (ReLU activations of the standardized digits stay below 32);
    # q6.18-rn is Chen et al.'s (2014) remedy without stochastic rounding: a much wider word
    "gupta": {"policies": ("32-true", "q6.8-rn", "q6.8-sr", "q6.10-rn", "q6.10-sr", "q6.12-rn",
                           "q6.12-sr", "q6.14-rn", "q6.14-sr", "q6.18-rn"), "seeds": (0, 1)},
    # Courbariaux, Bengio and David (2014): dynamic fixed point (10-bit propagations, 12-bit
    # updates) against static fixed point of the same widths and against float
    "courbariaux": {"policies": ("32-true", "16-true", "dfxp-10-12", "fixed-10-12"),
                    "seeds": (0, 1)},
    # BinaryNet (2016): an MLP with BatchNorm, Adam on the latent weights, no weight decay (it
    # pulls latent weights to 0, where stochastic binarization is a coin toss)
    "binarynet": {"model": "mlp", "optimizer": "adam", "lr": 0.005, "weight_decay": 0.0,
                  "policies": ("32-true", "binary", "binary-stochastic"), "seeds": (0, 1)},
    # OCP MX v1.0 block formats for the weights and activations of every matmul
    "mx": {"policies": ("32-true", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
                        "mxfp4", "mxint8"), "seeds": (0, 1)},
    # Yun et al. (2023), "In Defense of Pure 16-bit Floating-Point Neural Networks": pure fp16
    # against fp32 and mixed precision over several architectures. As the authors' code
    # (github.com/YUNBLAK/standalone_16bits_nn, CNN_MAIN.py): Keras SGD lr 0.01 momentum 0.9,
    # batch 256, no learning-rate schedule (constant), no weight decay (their ResNets alone
    # add an L2 term of 1e-4; one setting serves every model here). They train 100 epochs on
    # CIFAR-10; here the full Fashion-MNIST, 2 epochs x 2 seeds: about an hour on 2 CPU cores
    # (benchmarks/preset_epoch.py). One comparison per model in OUT/MODEL, a combined report.
    # Below 16 bits (issue: scaled fp8, MX and NVFP4 training), on a character-level language
    # model over the licence texts Debian ships (experiments/text.py); the image tables run the
    # same preset with --data mnist --model mlp. fp8: no scale against current, per-row and
    # delayed scaling (Micikevicius et al. 2022; torchao's recipes); fp4: MXFP4 against NVFP4
    # at equal element bits, NVFP4 with and without stochastic rounding of the gradients
    # (arXiv:2509.25149), MXFP8 as the 8-bit reference
    "fp8": {"data": "text", "model": "chartransformer", "optimizer": "adam", "lr": 0.003,
            "weight_decay": 0.0, "batch_size": 64, "epochs": 2, "train_subset": 8000,
            "seeds": (0, 1),
            "policies": ("32-true", "fp8-unscaled", "fp8-tensorwise", "fp8-rowwise",
                         "fp8-rowwise-gw-hp", "fp8-delayed")},
    "fp4": {"data": "text", "model": "chartransformer", "optimizer": "adam", "lr": 0.003,
            "weight_decay": 0.0, "batch_size": 64, "epochs": 2, "train_subset": 8000,
            "seeds": (0, 1),
            "policies": ("32-true", "mxfp8", "p=fp32,sc=mxfp4", "nvfp4", "nvfp4-sr")},
    # The GEMM accumulator (acc=, numerics/accumulation.py) on the MLP's 784-term dot products:
    # fp16 accumulation sequential, in chunks of 64 promoted to fp32 (Wang et al. 2018) and
    # pairwise; fixed-point accumulators with stochastic rounding, narrowing the fraction to find
    # the narrowest that still trains (Gupta et al. 2015)
    "accumulation": {"data": "mnist", "model": "mlp", "epochs": 2, "seeds": (0, 1),
                     "batch_size": 64,
                     "policies": ("32-true", "p=fp32,acc=fp16", "p=fp32,acc=fp16:chunk64",
                                  "p=fp32,acc=fp16:pairwise", "p=fp32,acc=q8.16:sr",
                                  "p=fp32,acc=q8.12:sr", "p=fp32,acc=q8.8:sr")},
    "yun2023": {"data": "fashion-mnist", "model": "resnet20,vgg,transformer,mobilenet",
                "policies": ("32-true", "16-true", "16-mixed", "bf16-true"), "seeds": (0, 1),
                "epochs": 2, "batch_size": 256, "lr": 0.01, "momentum": 0.9,
                "weight_decay": 0.0, "schedule": "constant"},
}
OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("cosine", "constant")


def lr_at(cfg: "CompareConfig", epoch: int) -> float:
    """The learning rate of an epoch: cosine annealing from lr towards 0 (Loshchilov & Hutter
    2017), or constant. A function of the epoch alone, so a resumed run gets the same rates."""
    if cfg.schedule == "constant":
        return cfg.lr
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * epoch / cfg.epochs))


MAX_SEED = 2**32 - 1  # seeds feed torch.manual_seed and seed * 100003 + epoch stays in 64 bits
MAX_RUNS = 10_000     # policies x seeds of one comparison
MAX_THREADS = 1024    # torch intra-op threads of a run


class RunError(Exception):
    """A configuration or output-folder problem, reported to the user in one line."""


def parse_named_policy(text: str | Policy) -> Policy:
    """A policy of a comparison, parsed once where it enters (the CLI, a CompareConfig): named
    as given, so it prints, keys its runs (``TEXT|seed=N``) and is stored as the text the user
    wrote (a spec is not rewritten to its canonical form)."""
    if isinstance(text, Policy):
        return text
    pol = parse_policy(text)
    name = text.strip() if isinstance(text, str) else None
    return pol if pol.name == name else replace(pol, name=name)


@dataclass(frozen=True)
class CompareConfig:
    """What a comparison runs, frozen. ``policies`` hold parsed :class:`Policy` objects (given
    as names, specs or bare formats, a comma-separated string, or Policies); a text no grammar
    reads is kept as given for :meth:`validate` to report (RunError), as are seeds out of
    range. ``seeds`` may be given as a count."""

    data: str = "mnist"
    model: str = "lenet5"
    policies: tuple[Policy, ...] = DEFAULT_POLICIES
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 15
    batch_size: int = 32
    lr: float = 0.02
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    out: str = "runs/compare"
    resume: bool = False
    quiet: bool = False
    train_subset: int | None = None
    schedule: str = "cosine"
    #: torch's intra-op threads for every run, wherever it runs (a float reduction split over
    #: another number of threads sums in another order). None: resolved once, when the
    #: comparison is created, to this process's torch.get_num_threads(); stored with the
    #: configuration, so --resume uses it (:meth:`resolve_threads`)
    threads: int | None = None
    #: run emulated policies compiled (``Precision(..., compile=True)``: the same bits as eager
    #: emulation, Inductor around the roundings); native-backend runs (fp32) stay eager
    compile: bool = False

    def __post_init__(self) -> None:
        policies = self.policies
        if isinstance(policies, str):
            policies = tuple(p.strip() for p in split_policies(policies))
        parsed = []
        for p in policies:
            try:
                parsed.append(parse_named_policy(p))
            except (ValueError, TypeError):
                parsed.append(p)  # validate() says why
        object.__setattr__(self, "policies", tuple(parsed))
        seeds = self.seeds
        if isinstance(seeds, int):
            if 1 <= seeds <= MAX_RUNS:  # a count; out of range, validate() says so
                object.__setattr__(self, "seeds", tuple(range(seeds)))
        elif not isinstance(seeds, str) and hasattr(seeds, "__iter__"):
            object.__setattr__(self, "seeds", tuple(seeds))

    def resolve_threads(self, stored: dict | None) -> "CompareConfig":
        """This configuration with ``threads`` given its value when not given: the stored
        comparison's, else (a new comparison, or one stored before the field existed) this
        process's torch default."""
        if self.threads is not None:
            return self
        import torch

        return replace(self, threads=(stored or {}).get("threads") or torch.get_num_threads())

    def validate(self) -> None:
        if not self.policies:
            raise RunError("no policies given")
        for p in self.policies:
            try:
                # plan:FILE stays its text (Precision reads the plan), or a policy
                load_plan(p) if is_plan_spec(p) else parse_named_policy(p)
            except (ValueError, TypeError) as err:
                raise RunError(str(err)) from None
        if isinstance(self.seeds, int):
            raise RunError(f"seeds={self.seeds}: give 1 to {MAX_RUNS} seeds per policy")
        if not self.seeds:
            raise RunError("no seeds given")
        if len(self.seeds) * len(self.policies) > MAX_RUNS:
            raise RunError(f"{len(self.policies)} policies x {len(self.seeds)} seeds is more "
                           f"than {MAX_RUNS} runs")
        for s in self.seeds:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED:
                raise RunError(f"seed {s!r} is not an integer in [0, {MAX_SEED}]")
        if len(set(self.seeds)) != len(self.seeds):
            raise RunError(f"seeds {list(self.seeds)[:10]} repeat a seed")
        names = [str(p) for p in self.policies]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RunError(f"policy {twice[0]!r} is listed twice in --policies "
                           f"({', '.join(names)[:200]}): list each once")
        if not isinstance(self.out, str) or not self.out.strip():
            raise RunError("--out is empty: name a run folder")

        def num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def count(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for name, value, ok, why in [
                ("epochs", self.epochs, count(self.epochs) and 0 < self.epochs <= 100_000,
                 "an integer in [1, 100000]"),
                ("batch_size", self.batch_size, count(self.batch_size) and
                 0 < self.batch_size <= 2**31, "a positive integer"),
                ("lr", self.lr, num(self.lr) and self.lr > 0, "a positive finite number"),
                ("momentum", self.momentum, num(self.momentum) and 0 <= self.momentum < 1,
                 "a number in [0, 1)"),
                ("weight_decay", self.weight_decay, num(self.weight_decay) and
                 self.weight_decay >= 0, "a finite number >= 0")]:
            if not ok:
                raise RunError(f"{name}={value!r} is not valid: must be {why}")
        if self.threads is not None and not (count(self.threads)
                                             and 1 <= self.threads <= MAX_THREADS):
            raise RunError(f"threads={self.threads!r} is not valid: must be an integer in "
                           f"[1, {MAX_THREADS}]")
        if not isinstance(self.compile, bool):
            raise RunError(f"compile={self.compile!r:.40} is not valid: must be True or False")
        if self.schedule not in SCHEDULES:
            raise RunError(f"schedule={self.schedule!r}; accepted: {', '.join(SCHEDULES)}")
        if self.optimizer not in OPTIMIZERS:
            raise RunError(f"optimizer={self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
        if self.train_subset is not None and not (isinstance(self.train_subset, int)
                                                  and self.train_subset > 0):
            raise RunError(f"train_subset={self.train_subset!r} must be a positive integer")

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.pop("resume")
        d.pop("quiet")
        d["policies"] = [str(p) for p in self.policies]
        d["seeds"] = list(self.seeds)
        return d


def split_models(spec: str) -> tuple[str, ...]:
    """``"resnet20,vgg"`` -> ("resnet20", "vgg"): a comparison over several architectures."""
    models = tuple(m.strip() for m in str(spec).split(",") if m.strip())
    if not models:
        raise RunError(f"model={spec!r}: no model given")
    if len(set(models)) != len(models):
        raise RunError(f"model={spec!r} names a model twice")
    return models


def _raw_pieces(spec: str) -> list[str]:
    """The comma-separated pieces of ``spec`` outside <...>, empty ones kept."""
    pieces, depth, cur = [], 0, []
    for ch in spec:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            pieces.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    return pieces + ["".join(cur)]


def split_policies(spec: str) -> list[str]:
    """Split a policy list on commas, keeping each compact spec (which has commas) whole:
    a piece containing '=' continues the previous spec when that spec also has '='."""
    out: list[str] = []
    if any(not piece.strip() for piece in _raw_pieces(spec)):
        raise ValueError(f"policies {spec[:120]!r} hold an empty item (two commas, or one at "
                         "an end): list policy names or specs separated by single commas")
    for piece in split_top(spec):  # commas inside <...> (fixed<16,14>-sr) do not split
        if out and "=" in piece and "=" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out
