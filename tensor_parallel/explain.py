"""Explain tables: per device, the FLOPs of each compute step and the traffic of each
collective, predicted with the traffic model the emulator's counts are tested against.

Columns: ``rank, phase, operation, step, kind, collective, axis, group_size, algorithm,
flops, bytes_sent, bytes_received, messages_sent, messages_received``. ``kind`` is
``compute``, ``collective`` or ``local`` (a slice or zeroing, no traffic). The last rows
(operation ``total``) sum every numeric column per rank.
"""

from __future__ import annotations

from typing import Mapping

from sharding import RedistributePlan
from vcluster.runtime.algorithm import choose_algorithm
from vcluster.runtime.traffic import collective_traffic

__all__ = ["COLUMNS", "plan_rows", "compute_rows", "to_frame"]

COLUMNS = ["rank", "phase", "operation", "step", "kind", "collective", "axis", "group_size",
           "algorithm", "flops", "bytes_sent", "bytes_received", "messages_sent",
           "messages_received"]
_NUMERIC = ["flops", "bytes_sent", "bytes_received", "messages_sent", "messages_received"]


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def plan_rows(mesh, plan: RedistributePlan, phase: str, operation: str, itemsize: int,
              algorithms: Mapping[str, str] | None = None) -> list[dict]:
    """One row per step per rank of a redistribution."""
    algorithms = algorithms or {}
    rows = []
    for step, shape in zip(plan.steps, plan.local_shapes(mesh)):
        nbytes = _prod(shape) * itemsize
        for rank in range(mesh.size):
            members = mesh.group(step.axis, rank)
            row = {"rank": rank, "phase": phase, "operation": operation, "step": str(step),
                   "axis": step.axis, "group_size": len(members), "flops": 0,
                   "bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                   "messages_received": 0}
            if step.kind in ("slice", "partial"):
                row.update(kind="local", collective="", algorithm="")
            else:
                alg = choose_algorithm(step.kind, nbytes, len(members),
                                       requested=algorithms.get(step.kind, "auto"))
                t = collective_traffic(step.kind, alg, members, members.index(rank), nbytes,
                                       itemsize)
                row.update(kind="collective", collective=step.kind, algorithm=alg,
                           bytes_sent=t.bytes_sent, bytes_received=t.bytes_received,
                           messages_sent=t.messages_sent,
                           messages_received=t.messages_received)
            rows.append(row)
    return rows


def compute_rows(mesh, phase: str, operation: str, step: str, flops: int) -> list[dict]:
    return [{"rank": r, "phase": phase, "operation": operation, "step": step,
             "kind": "compute", "collective": "", "axis": "", "group_size": 1,
             "algorithm": "", "flops": flops, "bytes_sent": 0, "bytes_received": 0,
             "messages_sent": 0, "messages_received": 0} for r in range(mesh.size)]


def to_frame(rows: list[dict]):
    """A DataFrame of ``rows`` followed by one ``total`` row per rank."""
    import pandas as pd
    df = pd.DataFrame(rows, columns=COLUMNS)
    totals = df.groupby("rank", sort=True)[_NUMERIC].sum().reset_index()
    totals = totals.assign(phase="all", operation="total", step="", kind="total",
                           collective="", axis="", group_size=0, algorithm="")
    return pd.concat([df, totals[COLUMNS]], ignore_index=True)
