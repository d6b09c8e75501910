"""The planner: the cheapest per-layer precision that still trains, found, verified by
training, explained.

Data flow (docs/design.md, "Planning"), one module per step:

1. :mod:`.measure`: one float32 step profiles every module owning parameters
   (:func:`lowprec.analysis.plan_scores.module_profile`); each module is judged in each level of
   the menu (:func:`~lowprec.analysis.plan_scores.judge_level`: range against the formats,
   gradient underflow with and without a loss scale, lost updates, and the loss perturbation of
   that module alone in the level on a few batches);
2. :mod:`.assign`: each module at the cheapest level it passes under the budget's cost (memory
   bytes, bits moved, or time on a named hardware profile: :mod:`lowprec.analysis.roofline`);
   the optimizer state at the narrowest parameter format of the menu that holds every weight
   gradient; the base policy is the level holding most parameters, every other module an
   override; a loss scale where a level passes only with one; a joint probe of the whole plan
   on the same batches (repaired before training when it fails);
3. :mod:`.verify`: the plan, float32 and every uniform level (and 16-mixed beside fp16, or the
   levels of ``compare_with``) train for ``steps`` steps from the same initial weights, seeds
   and batches; the plan is returned only when its mean test accuracy is within ``tolerance``
   of float32's; otherwise the module most sensitive in its current level (perturbation score)
   is raised one level and the plan is trained again: each repair is logged.

:mod:`.levels` holds the menu's levels, :mod:`.settings` the checked arguments and the search
log, :mod:`.search` the function :func:`plan` that runs the three steps, and :mod:`.report`
the tables and markdown of a plan. The measurements and costs themselves are training-free and
live in the analysis layer (:mod:`lowprec.analysis.plan_scores`,
:mod:`lowprec.analysis.plan_costs`); the plan returned is a
:class:`lowprec.training.plan.Plan`: ``Precision(plan)``, ``lowprec compare --policies
plan:FILE`` and the integrations (which build a Precision) accept it.
"""

from .levels import (DEFAULT_MENU, LEVELS, UNIFORM, parse_compare_with, parse_menu,
                     uniform_policy)
from .report import plan_markdown, plan_table, summary_rows
from .search import plan
from .verify import cheaper_uniform, train_and_evaluate

__all__ = ["plan", "cheaper_uniform", "LEVELS", "DEFAULT_MENU", "UNIFORM", "uniform_policy",
           "parse_menu", "parse_compare_with", "plan_table", "plan_markdown", "summary_rows",
           "train_and_evaluate"]
