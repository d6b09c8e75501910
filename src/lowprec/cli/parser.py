"""The command line's arguments: :func:`build_parser` (one small function per command's flags),
--config applied over them, and the flags checked together.

Only the standard library, :mod:`lowprec._names` and the cli's own modules are imported here
(each command's module imports the library inside its function): shell completion builds this
parser without importing torch (lowprec_cmd).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from .. import _names  # the registries' names, for completion: the standard library alone
from .analyse import cmd_advise, cmd_certify
from .common import MAX_SEED, UserError, float_arg, int_arg, print_error, user_call
from .completion import listed, offer, offer_data, offer_formats, offer_models, policy_items
from .formats import cmd_formats, cmd_quantize
from .plan import cmd_plan
from .run import cmd_compare, cmd_export, cmd_report, cmd_train

__all__ = ["apply_config", "build_parser", "check_flags"]


_NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$|^-(?:inf|infinity|nan)$",
                              re.ASCII | re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit code 2."""

    #: (path, flags) of a --config file whose flags this parser is parsing
    config_origin: tuple[str, set] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-9", "-inf" and "-nan" for flags (its matcher knows only -1 and
        # -1.5), so "--lr -inf" said "expected one argument" instead of naming the value
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def parse_args(self, args=None, namespace=None):
        """argparse's, with arguments no parser took named by the command's parser (``lowprec
        train: error: ...``, not ``lowprec: error: ...``) and the closest flag it has
        (``--policies`` given to train: "did you mean --policy?")."""
        argv = list(sys.argv[1:] if args is None else args)
        ns, extra = self.parse_known_args(argv, namespace)
        if extra:
            command = getattr(ns, "command", None)
            target = getattr(self, "commands", {}).get(command, self)
            if command in argv and extra[0] in argv[:argv.index(command)]:
                target = self  # (given before the command: lowprec's own flags)
            msg = f"unrecognized arguments: {' '.join(extra)}"
            flag = next((a.split("=", 1)[0] for a in extra if a.startswith("--")), None)
            if flag is not None:
                opts = [o for a in target._actions for o in a.option_strings
                        if o.startswith("--")]
                close = difflib.get_close_matches(flag, opts, n=1, cutoff=0.7)
                if close:
                    msg += f" (did you mean {close[0]}?)"
            target.error(msg)
        return ns

    def error(self, message: str):
        origin = ""
        if self.config_origin and any(f in message for f in self.config_origin[1]):
            origin = f" (set in --config {self.config_origin[0]})"
        print_error(self.prog, f"{message}{origin} (see {self.prog} --help)")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lowprec",
        description="Reduced-precision training on PyTorch: formats, rounding, quantization.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"lowprec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add_command in _COMMANDS:  # in this order in --help
        add_command(sub)
    p.commands = dict(sub.choices)
    for name, command in p.commands.items():
        _add_config(command, name)
    return p


def _add_formats(sub) -> None:
    f = sub.add_parser("formats", help="table of number formats: bits, max, min normal, "
                                       "min subnormal, eps")
    offer_formats(f.add_argument("formats", nargs="*", metavar="FORMAT",
                                 help="formats to show (default: every named format), e.g. "
                                      "fp16 e3m4 q4.12"))
    f.set_defaults(func=cmd_formats)


def _add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="round numbers to one or more formats")
    offer(q.add_argument("values", nargs="+", metavar="X",
                         help="numbers (inf, nan, -0 accepted)"), ())
    offer_formats(q.add_argument("--format", "-f", action="append", required=True,
                                 help="target format (repeatable), e.g. -f fp16 -f e4m3fn"))
    offer(q.add_argument("--rounding", "-r", default="nearest",
                         help=", ".join(_names.ROUNDING_NAMES + ("srN",))),
          _names.ROUNDING_NAMES)
    q.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0,
                   help="seed of stochastic rounding")
    q.set_defaults(func=cmd_quantize)


def _add_compare(sub) -> None:
    c = sub.add_parser("compare", help="train every policy x seed, store results, write the "
                       "report, print a summary (the default job: real MNIST digits, LeNet-5)")
    _add_run_args(c, compare=True)
    c.set_defaults(func=cmd_compare)


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="one policy, one seed (what compare runs)")
    offer(t.add_argument("--policy", default="32-true", help="a policy name or spec"),
          listed(policy_items))  # a spec has commas (p=fp32,c=bf16)
    t.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0)
    _add_run_args(t, compare=False)
    t.set_defaults(func=cmd_train)


def _add_certify(sub) -> None:
    ce = sub.add_parser("certify", help="the 16-bit certificate, input by input: does the model "
                        "in FORMAT provably predict what it predicts in fp32?")
    _add_analysis_args(ce)
    ce.add_argument("--outputs", default="logits", help="logits (default) or probs")
    ce.set_defaults(func=cmd_certify)


def _add_advise(sub) -> None:
    ad = sub.add_parser("advise", help="can this model train and run in FORMAT, and what must "
                        "be done? (certificate, loss scale, ranges, lost updates, first Inf/NaN)")
    _add_analysis_args(ad)
    ad.add_argument("--batches", type=int_arg(1, 100_000), default=4,
                    help="batches analysed (default: 4)")
    ad.set_defaults(func=cmd_advise)


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="the cheapest per-layer precision that still trains: "
                        "measured per module, assigned under a budget, verified by training")
    offer_data(pl.add_argument("--data", default="digits",
                               help="dataset (as for compare; default: digits)"))
    offer_models(pl.add_argument("--model", default="mlp",
                                 help="model (as for compare; default: mlp)"), several=False)
    offer(pl.add_argument("--menu", default="fp32,bf16,fp16,fp8",
                          help="levels a module may take, widest first (fp32 bf16 fp16 mixed16 "
                               "fp8 mxfp8 nvfp4 mxfp4 fixed16-sr; default: fp32,bf16,fp16,fp8)"),
          listed(lambda _: _names.PLAN_LEVELS))
    offer(pl.add_argument("--minimise", default="memory",
                          help="what the plan minimises: memory bytes, bits moved, or time "
                               "estimated on --hardware (default: memory)"),
          ("memory", "bits", "time"))
    offer(pl.add_argument("--hardware", default=None,
                          help="named hardware profile for --minimise time (h100-sxm, a100, "
                               "b200, rtx4090, cpu-avx2, cpu-amx); with another budget the "
                               "time estimate is shown beside it"),
          ("h100-sxm", "a100", "b200", "rtx4090", "cpu-avx2", "cpu-amx"))
    pl.add_argument("--compare-with", default=None,
                    help="uniform levels also trained beside the plan, comma-separated "
                         "(default: 16-mixed when fp16 is in the menu)")
    pl.add_argument("--tolerance", type=float_arg(nonnegative=True), default=0.01,
                    help="accuracy the plan may lose against fp32, a fraction (default: 0.01)")
    pl.add_argument("--steps", type=int_arg(1, 10_000_000), default=200,
                    help="training steps of each verification run (default: 200)")
    pl.add_argument("--seeds", type=int_arg(1, 100), default=1,
                    help="verification seeds per policy (default: 1)")
    pl.add_argument("--epochs", type=int_arg(0, 100_000), default=0,
                    help="fp32 epochs before planning (default: 0: plan from the initial "
                         "weights)")
    pl.add_argument("--lr", type=float_arg(positive=True), default=0.02,
                    help="learning rate (default: 0.02)")
    pl.add_argument("--batch-size", type=int_arg(1, 2**31), default=64, help="default: 64")
    pl.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0,
                    help="seed of the initial weights")
    pl.add_argument("--out", default="plan.json", help="the plan file (default: plan.json)")
    pl.add_argument("--report", default=None, help="also write the report section (Markdown)")
    pl.add_argument("--quiet", action="store_true", help="no search log")
    _add_json(pl)
    pl.set_defaults(func=cmd_plan)


def _add_export(sub) -> None:
    ex = sub.add_parser("export", help="a run folder's results as csv, parquet, TensorBoard "
                        "event files or an MLflow file store (offline)")
    ex.add_argument("run_dir", help="the folder holding results.db")
    offer(ex.add_argument("--to", default=None, metavar="FORMAT",
                          help="csv, parquet, tensorboard or mlflow"),
          ("csv", "parquet", "tensorboard", "mlflow"))
    ex.add_argument("--out", default=None,
                    help="a new or empty folder (default: RUN_DIR/export/FORMAT)")
    ex.add_argument("--json", action="store_true",
                    help="print what was written as JSON on stdout")
    ex.set_defaults(func=cmd_export)


def _add_report(sub) -> None:
    r = sub.add_parser("report", help="rebuild report.html and report.md from a run folder")
    r.add_argument("run_dir", help="the folder holding results.db")
    _add_json(r)
    r.set_defaults(func=cmd_report)


#: every command's parser, in the order of --help
_COMMANDS = (_add_formats, _add_quantize, _add_compare, _add_train, _add_certify, _add_advise,
             _add_plan, _add_export, _add_report)


def _add_run_args(p: argparse.ArgumentParser, *, compare: bool) -> None:
    """compare's and train's flags (compare: several models, policies, seeds, an executor)."""
    offer_data(p.add_argument("--data", default=None, help="mnist, digits, mnist1d, "
                              "fashion-mnist[:DIR], idx:DIR, cifar10:DIR, module:function "
                              "(function() returns x_train, y_train, x_test, y_test) "
                              "(default: mnist, 5,000 real digits)"))
    offer_models(p.add_argument("--model", default=None, help="mlp, lenet5, resnet20, vgg, "
                                "cnn1d, transformer, mobilenet, module:function "
                                "(function(input_shape, num_classes) returns an nn.Module) "
                                "(default: lenet5); compare takes several, comma-separated: "
                                "one comparison per model in OUT/MODEL"), several=compare)
    if compare:
        _add_grid_args(p)
        _add_executor_args(p)
    _add_training_args(p)
    _add_folder_args(p)


def _add_grid_args(p: argparse.ArgumentParser) -> None:
    """compare's policies x seeds, or a preset of the literature."""
    DEFAULT_POLICIES, PRESETS = _names.DEFAULT_POLICIES, _names.PRESET_NAMES
    offer(p.add_argument("--policies", default=None,
                         help="comma-separated names or specs (default: "
                              f"{','.join(DEFAULT_POLICIES)})"),
          listed(policy_items))
    p.add_argument("--seeds", type=int_arg(1, 10_000), default=None,
                   help="seeds per policy (default: 3)")
    offer(p.add_argument("--preset", default=None, help="an experiment of the literature: "
                         + ", ".join(PRESETS) + " (policies, model and optimizer; flags "
                         "override)"),
          PRESETS)


def _add_executor_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the runs execute")
    offer(g.add_argument("--executor", default=None, help="local (default: one run after "
                         "another in this process) or ray (each run a Ray task; pip install "
                         "'lowprec[ray]')"), ("local", "ray"))
    g.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: "
                   "start a local instance); --out must be on storage every node mounts")
    g.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (default: every CPU)")
    g.add_argument("--cpus-per-run", type=float, default=None,
                   help="CPUs Ray reserves for each run (default: --threads, at most a "
                   "node's CPUs); the run computes with --threads threads either way")
    g.add_argument("--gpus-per-run", type=float, default=None,
                   help="GPUs Ray reserves for each run (default: 0)")
    g.add_argument("--max-retries", type=int, default=None,
                   help="times Ray runs again a run whose worker died (default: 3)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int_arg(1, 100_000), default=None, help="default: 15")
    p.add_argument("--batch-size", type=int_arg(1, 2**31), default=None, help="default: 32")
    p.add_argument("--lr", type=float_arg(positive=True), default=None, help="default: 0.02")
    offer(p.add_argument("--optimizer", default=None, help="sgd (momentum 0.9, default) or adam"),
          ("sgd", "adam"))
    p.add_argument("--momentum", type=float_arg(nonnegative=True), default=None,
                   help=argparse.SUPPRESS)
    offer(p.add_argument("--schedule", default=None, help="learning-rate schedule: cosine "
                         "(default) or constant"), ("cosine", "constant"))
    p.add_argument("--weight-decay", type=float_arg(nonnegative=True), default=None,
                   help="default: 5e-4")
    p.add_argument("--train-subset", type=int_arg(1, 2**31), default=None,
                   help="train on the first N training examples only")
    p.add_argument("--threads", type=int_arg(1, 1024), default=None,
                   help="torch threads of every run, wherever it runs (default: torch's "
                   "default here, stored for --resume): part of the numbers, as a float sum "
                   "split over other threads rounds differently")
    p.add_argument("--compile", action="store_const", const=True, default=None,
                   help="run the emulated policies compiled (Precision(compile=True): the "
                   "same bits as eager emulation; eager, with a line saying why, where a model "
                   "or policy cannot compile); fp32 and other native runs stay eager")


def _add_folder_args(p: argparse.ArgumentParser) -> None:
    """The run folder: where, resumed or not, and what is printed."""
    p.add_argument("--out", default="runs/compare", help="run folder (default: runs/compare)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run folder (one that holds nothing yet is "
                   "started, as make demo's first run): finished runs are kept, flags not "
                   "given take the stored values, flags that differ (policies, seeds and "
                   "--preset included) are refused with the list of differences")
    p.add_argument("--force-config", action="store_true",
                   help="with --resume: continue with the flags given even where they differ "
                   "from the stored configuration (recorded in the database); other "
                   "policies or seeds add runs, and unfinished runs no longer asked for are "
                   "marked 'not requested'")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary")
    _add_json(p)


def _add_analysis_args(p: argparse.ArgumentParser) -> None:
    offer_data(p.add_argument("--data", default="mnist",
                              help="dataset (as for compare; default: mnist)"))
    offer_models(p.add_argument("--model", default="lenet5",
                                help="model (as for compare; default: lenet5)"), several=False)
    offer_formats(p.add_argument("--format", default="fp16",
                                 help="the low-precision format (default: fp16); also a "
                                      "scaled-GEMM recipe (fp8-tensorwise), for advise a "
                                      "regime of one format (q6.10-sr), for certify a plan "
                                      "(plan:FILE)"))
    p.add_argument("--epochs", type=int_arg(0, 100_000), default=3,
                   help="fp32 training epochs before the analysis (default: 3; 0: untrained)")
    p.add_argument("--lr", type=float_arg(positive=True), default=0.02,
                   help="learning rate (default: 0.02)")
    p.add_argument("--batch-size", type=int_arg(1, 2**31), default=32, help="default: 32")
    p.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0)
    p.add_argument("--quiet", action="store_true")
    _add_json(p)


_JSON_HELP = ("print a machine-readable summary as JSON on stdout (progress and messages go to "
              "stderr)")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


_CONFIG_EXAMPLES = {"compare": 'epochs = 5, policies = ["32-true", "bf16-true"]',
                    "train": 'epochs = 5, policy = "bf16-true"'}


def _add_config(p: argparse.ArgumentParser, name: str) -> None:
    """--config for command ``name``, its help's example one of this command's own flags."""
    dests = {a.dest for a in p._actions}
    example = _CONFIG_EXAMPLES.get(name) or next(
        (f"{d} = {v}" for d, v in (("epochs", "5"), ("format", '"bf16"'), ("json", "true"))
         if d in dests), "a flag's long name = its value")
    kept = "; kept as OUT/run.toml" if name in _CONFIG_EXAMPLES else ""
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help=f"any flag of this command in a TOML file ({example}; or in a "
                   f"[{name}] table); flags given here win{kept}")


def apply_config(parser: argparse.ArgumentParser, args, argv: list[str]):
    """Parse again with the --config file's flags before the command line's (which win)."""
    from ..experiments.configfile import config_tokens, read_config_file

    table, text = user_call(read_config_file, args.config)
    sub = parser.commands[args.command]
    tokens = user_call(config_tokens, table, sub, args.command, args.config,
                       tuple(parser.commands))
    at = argv.index(args.command) + 1
    sub.config_origin = (args.config, {t for t in tokens if t.startswith("--")})
    try:
        args = parser.parse_args(argv[:at] + tokens + argv[at:])
    finally:
        sub.config_origin = None
    args.config_text = text
    return args


def check_flags(args) -> None:
    """Flags that parse but mean nothing together, and values argparse cannot refuse alone
    (after --config's flags are applied, which may give the required ones)."""
    if getattr(args, "force_config", False) and not getattr(args, "resume", False):
        raise UserError("--force-config applies only with --resume (it continues a stored "
                        "comparison with other flags); add --resume, or drop --force-config")
    if getattr(args, "command", None) == "export" and args.to is None:
        raise UserError("--to is required: csv, parquet, tensorboard or mlflow (on the "
                        "command line or as to = \"csv\" in --config)")
