"""``lowprec.experiments.plan``: the planner's public names under their former module, kept
because the README imports ``plan`` from here; the planner is the sub-package
:mod:`lowprec.experiments.planner` (new code imports from there)."""

from .planner import (DEFAULT_MENU, LEVELS, UNIFORM, cheaper_uniform, parse_compare_with,
                      parse_menu, plan, plan_markdown, plan_table, summary_rows,
                      train_and_evaluate, uniform_policy)

__all__ = ["plan", "cheaper_uniform", "LEVELS", "DEFAULT_MENU", "UNIFORM", "uniform_policy",
           "parse_menu", "parse_compare_with", "plan_table", "plan_markdown", "summary_rows",
           "train_and_evaluate"]
