"""A griffe extension of the docs site: the docstrings' Sphinx roles (``:func:`quantize```,
``:class:`~lowprec.Precision```) rendered as code (`quantize`, `Precision`), as the Markdown
pages spell names. The source keeps the roles (editors and Sphinx read them)."""

import re

from griffe import Extension

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|exc|obj|const|ref):`~?\.?([^`]+)`")


class SphinxRoles(Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
