"""A mesh as HTML tables, for notebooks (``Mesh._repr_html_``).

The last two axes are the rows and columns of a table whose cells are ranks (the cell's
title holds the full coordinates); each combination of the leading axes gets its own
table, captioned with those coordinates. A 1-D mesh is a single row. Meshes with more
than :data:`MAX_HTML_RANKS` ranks are summarised in one line instead.
"""

from __future__ import annotations

import html
import itertools

__all__ = ["mesh_html", "MAX_HTML_RANKS"]

MAX_HTML_RANKS = 1024
_TABLE = ('<table class="vcluster-mesh" style="border-collapse:collapse;font-family:monospace;'
          'font-size:12px;display:inline-table;margin:0 12px 8px 0">')
_CELL = 'style="border:1px solid #bbb;padding:2px 6px;text-align:center"'


def _table(mesh, lead: tuple[int, ...]) -> str:
    rows_axis, cols_axis = (None, mesh.axes[-1]) if mesh.ndim == 1 else mesh.axes[-2:]
    n_rows = 1 if rows_axis is None else mesh.dims[-2]
    n_cols = mesh.dims[-1]
    caption = ", ".join(f"{a}={c}" for a, c in zip(mesh.axes, lead))
    out = [_TABLE]
    if caption:
        out.append(f"<caption>{html.escape(caption)}</caption>")
    out.append("<tr><th></th>" + "".join(f"<th {_CELL}>{html.escape(cols_axis)}={c}</th>"
                                         for c in range(n_cols)) + "</tr>")
    for i in range(n_rows):
        label = "" if rows_axis is None else f"{rows_axis}={i}"
        cells = []
        for j in range(n_cols):
            coords = lead + ((j,) if rows_axis is None else (i, j))
            rank = mesh.rank(coords)
            title = html.escape(repr(mesh.index(rank)))
            cells.append(f'<td {_CELL} title="{title}">{rank}</td>')
        out.append(f"<tr><th {_CELL}>{html.escape(label)}</th>{''.join(cells)}</tr>")
    out.append("</table>")
    return "".join(out)


def mesh_html(mesh) -> str:
    """``mesh`` as HTML: a heading line and one rank table per leading coordinate."""
    head = (f"<div><b>{html.escape(str(mesh))}</b>: {mesh.size} ranks, row-major "
            f"(the last axis varies fastest)</div>")
    if mesh.size > MAX_HTML_RANKS:
        return head
    leading = itertools.product(*(range(n) for n in mesh.dims[:-2]))
    return head + "<div>" + "".join(_table(mesh, lead) for lead in leading) + "</div>"
