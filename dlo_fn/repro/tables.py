"""Plain-text tables for notebooks: stable, diffable output."""

from __future__ import annotations

__all__ = ["text_table"]


def text_table(rows: list[dict]) -> str:
    """Rows of equal keys as an aligned text table (for notebooks: stable, diffable output)."""
    keys = list(rows[0])
    cells = [keys] + [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(line, widths))) for line in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])
