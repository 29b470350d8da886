"""Plain-text tables for notebooks (stable, diffable output): the library's :func:`dlo_fn.plan.summary.text_table`."""

from dlo_fn.plan.summary import text_table

__all__ = ["text_table"]
