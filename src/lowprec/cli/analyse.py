"""``lowprec certify`` and ``lowprec advise``: a model trained briefly in fp32, then
:func:`lowprec.analysis.certify` or :func:`lowprec.analysis.advise` in the format asked for."""

from __future__ import annotations

import sys

from typing import TYPE_CHECKING

from .common import Table, UserError, print_json, user_call

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["cmd_advise", "cmd_certify", "trained_model"]


def trained_model(args, console: Console):
    """Load --data, build --model and, with --epochs > 0, train it briefly in fp32."""
    from ..experiments.data import DatasetNotFound
    from ..experiments.pretrain import train_fp32, untrained

    try:
        model, data = untrained(args.data, args.model, seed=args.seed)
    except (DatasetNotFound, ValueError) as err:
        raise UserError(str(err)) from None

    def report(epoch: int) -> None:
        if not args.quiet:
            console.print(f"trained {args.model} on {args.data} in fp32: epoch {epoch}/"
                          f"{args.epochs}")

    train_fp32(model, data, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
               seed=args.seed, on_epoch=report)
    return model, data


def cmd_certify(args, console: Console) -> int:
    from ..analysis.certify import certify, certify_target

    # what certify() takes (a format, a scaled-GEMM policy, plan:FILE), checked before training
    fmt = user_call(certify_target, args.format, args.outputs)[1]
    model, data = trained_model(args, console)
    cert = user_call(certify, model, data, args.format, outputs=args.outputs)
    # exit code 1 when an input is uncertified (or, against the theorem, a certified input
    # changed class): the model is not provably safe in the format (docs/guides/certify.md)
    code = 0 if bool(cert.certified.all()) and cert.violations == 0 else 1
    if args.json:
        print_json({"format": fmt, "summary": cert.summary(),
                    "per_class": cert.per_class()})
        return code
    console.print(str(cert))
    s = cert.summary()
    if "accuracy32" in s:
        console.print(f"test accuracy: fp32 {100 * s['accuracy32']:.2f}%, {fmt} "
                      f"{100 * s['accuracy16']:.2f}%")
    table = Table(title="per class", header_style="bold")
    for c in ("class", "inputs", "certified %", "same prediction %", "violations"):
        table.add_column(c, justify="right")
    for r in cert.per_class():
        table.add_row(str(r["class"]), str(r["n"]), f"{100 * r['certified']:.1f}",
                      f"{100 * r['agreement']:.1f}", str(r["violations"]))
    console.print(table)
    if code:
        left = int((~cert.certified).sum())
        print(f"lowprec certify: {left} of {cert.n} inputs uncertified (Γ <= 2δ)"
              + (f", {cert.violations} violations" if cert.violations else "")
              + ": exit code 1", file=sys.stderr)
    return code


def cmd_advise(args, console: Console) -> int:
    from ..analysis.advise import advise, advise_target

    # what advise() takes (a format, a regime such as q6.10-sr, a scaled-GEMM policy),
    # checked before training the model
    user_call(advise_target, args.format)
    model, data = trained_model(args, console)
    adv = user_call(advise, model, data, args.format, batches=args.batches, lr=args.lr)
    if args.json:
        print_json(adv.to_json())
    else:
        console.print(str(adv))
    return 0
