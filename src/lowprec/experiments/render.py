"""Rendering helpers of the report: figures without pyplot's global state, and tables.

Figures are ``matplotlib.figure.Figure`` objects drawn on the Agg canvas directly: no backend is
selected and no pyplot figure manager is touched, so a report can be written from a program
that uses matplotlib interactively, and nothing global changes.
"""

from __future__ import annotations

import html
import io

__all__ = ["subplots", "stacked", "png_bytes", "md_table", "html_table"]


def subplots(figsize: tuple[float, float]):
    """A new (figure, axes) pair on an Agg canvas of its own."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def stacked(n: int, figsize: tuple[float, float]):
    """A new figure with ``n`` axes stacked vertically, sharing the x axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, sharex=True)
    return fig, list(axes)


def png_bytes(fig) -> bytes:
    """A figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def md_table(cols, rows) -> str:
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def html_table(cols, rows, cls="") -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
