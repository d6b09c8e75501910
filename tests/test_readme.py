"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
    """Every block outside "Your own model and training loop" (tests/integrations/test_docs.py
    runs those, with their optional dependencies), in order, in one namespace."""
    text = README.read_text()
    start = text.index("## Your own model and training loop")
    text = text[:start] + text[text.index("\n## ", start + 1):]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    assert "prec" in ns and ns["prec"].steps == 1  # the quick start's one step
