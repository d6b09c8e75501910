"""The integrations guide (docs/guides/integrations.md, "Your own model and training loop"): its
Python examples run as written, in order, and leave what they claim behind."""

import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "integrations.md"


def _section() -> str:
    return DOC.read_text()


def test_integration_examples_run():
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    blocks = re.findall(r"```python\n(.*?)```", _section(), flags=re.S)
    assert len(blocks) == 4  # plain loop, GradScaler, Lightning, Hugging Face
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), ns)  # noqa: S102 - our own documentation
    assert ns["prec"].steps == 20
    assert ns["opt"].param_groups[0]["params"][0].dtype == torch.float16
    assert ns["scaler"].precision.steps == 20 and ns["scaler"].get_scale() > 0
    assert ns["trainer"].lowprec.steps == 4  # 32 examples, batches of 8, one epoch
