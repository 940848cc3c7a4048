"""Tensor layouts as HTML, for notebooks.

* :func:`sharding_html` (``TensorSharding._repr_html_``): one row per tensor dimension —
  replicated, or split over which mesh axes (major first) — and the partial axes (an
  unreduced sum that an all-reduce or reduce-scatter over them closes);
* :func:`layout_html`: on a given mesh and global shape, which block each rank holds:
  its coordinates, the slices of the global array and the local shape, and whether it
  holds a partial sum.
"""

from __future__ import annotations

import html

__all__ = ["sharding_html", "layout_html", "MAX_LAYOUT_RANKS"]

MAX_LAYOUT_RANKS = 256
_TABLE = ('<table class="vcluster-sharding" style="border-collapse:collapse;'
          'font-family:monospace;font-size:12px">')
_CELL = 'style="border:1px solid #bbb;padding:2px 6px;text-align:left"'


def _row(cells, tag="td") -> str:
    return "<tr>" + "".join(f"<{tag} {_CELL}>{html.escape(str(c))}</{tag}>"
                            for c in cells) + "</tr>"


def sharding_html(spec) -> str:
    """A table: tensor dimension -> how it is laid out; the partial axes last."""
    rows = [_row(("dim", "layout"), "th")]
    for i, d in enumerate(spec.dims):
        how = "replicated" if d.is_replicated else \
            "split over " + " x ".join(d.axes) + (" (major first)" if len(d.axes) > 1 else "")
        rows.append(_row((i, how)))
    if spec.partial:
        rows.append(_row(("partial", "unreduced sum over " + ", ".join(spec.partial))))
    caption = f"<caption>{html.escape(repr(spec))} = {html.escape(str(spec))}</caption>"
    return _TABLE + caption + "".join(rows) + "</table>"


def _slice_text(s: slice) -> str:
    return f"{s.start}:{s.stop}"


def layout_html(spec, mesh, shape) -> str:
    """Per rank of ``mesh``: coordinates, the block of the global ``shape`` it holds
    (``[0:4, 8:16]``), the local shape, and for partial layouts whether it holds a term of
    the pending sum (every rank does; the sum is over its partial group)."""
    from .shard import local_shape, shard_slices
    local = local_shape(shape, spec, mesh)
    head = (f"<div><b>{html.escape(str(spec))}</b> of a {tuple(shape)} array on "
            f"{html.escape(str(mesh))}: local shape {local}</div>")
    if mesh.size > MAX_LAYOUT_RANKS:
        return head
    columns = ["rank", "coords", "block"] + (["partial group"] if spec.partial else [])
    rows = [_row(columns, "th")]
    for r in range(mesh.size):
        block = "[" + ", ".join(_slice_text(s) for s in shard_slices(shape, spec, mesh, r)) + "]"
        cells = [r, repr(mesh.index(r)), block]
        if spec.partial:
            cells.append(list(mesh.group(spec.partial, r)))
        rows.append(_row(cells))
    return head + _TABLE + "".join(rows) + "</table>"
