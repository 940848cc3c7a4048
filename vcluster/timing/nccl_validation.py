"""Check the collective cost model against published NCCL bus bandwidths (nccl_a100.csv).

``validate_nccl()`` predicts every row of ``data/nccl_a100.csv`` — a group of
nodes x gpus_per_node ranks, algorithm "auto", nccl-tests' busbw — on the preset its
system maps to (``SYSTEM_PRESETS``; a row with a NICs-per-node figure uses a variant of
the preset with that many NICs). One JSON-friendly dict per row::

    {"source", "case", "metric": "busbw_gbps", "published", "predicted", "rel_error",
     "hardware", "algorithm"}        rel_error = predicted / published - 1

Acceptance (tests): |rel_error| <= ``NCCL_TOLERANCE`` for every row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .collective_cost import collective_cost
from .hardware import HardwareSpec
from .presets import load_hardware, read_data_csv

__all__ = ["validate_nccl", "format_validation_table", "SYSTEM_PRESETS", "NCCL_TOLERANCE"]

NCCL_TOLERANCE = 0.10  # acceptance: every published busbw within 10 %
NCCL_CSV = "nccl_a100.csv"
SYSTEM_PRESETS = (("A100", "a100-80gb-dgx"), ("H100", "h100-dgx"), ("H200", "h200-dgx"))


def _hardware_for(row: Mapping, hardware_by_system: Mapping) -> HardwareSpec:
    system = row["system"]
    if system in hardware_by_system:
        hw = load_hardware(hardware_by_system[system])
    else:
        names = [name for key, name in SYSTEM_PRESETS if key in system]
        if not names:
            raise ValueError(f"{NCCL_CSV}: no preset for system {system!r}; pass "
                             f"hardware_by_system={{{system!r}: ...}}")
        hw = load_hardware(names[0])
    gpus = int(row["gpus_per_node"])
    if gpus != hw.node.gpus_per_node:
        hw = replace(hw, name=f"{hw.name}-{gpus}gpu", node=replace(hw.node, gpus_per_node=gpus))
    if row["nics_per_node"].strip():
        hw = hw.with_nics_per_node(int(row["nics_per_node"]))
    return hw


def validate_nccl(hardware_by_system: Mapping | None = None) -> list[dict]:
    """One row per line of nccl_a100.csv: published vs predicted busbw (GB/s).

    ``hardware_by_system`` maps a CSV ``system`` string to a HardwareSpec, preset name,
    YAML path or dict, overriding ``SYSTEM_PRESETS``.
    """
    hardware_by_system = dict(hardware_by_system or {})
    _, rows = read_data_csv(NCCL_CSV)
    out = []
    for row in rows:
        hw = _hardware_for(row, hardware_by_system)
        nodes, gpus = int(row["nodes"]), int(row["gpus_per_node"])
        nbytes = int(float(row["message_bytes"]))
        group = tuple(range(nodes * gpus))
        cost = collective_cost(row["collective"], nbytes, group, hw)
        published = float(row["busbw_gbps"])
        predicted = cost.busbw_gbps
        nics = row["nics_per_node"].strip() or "-"
        out.append({
            "source": row["source"],
            "case": (f"{row['system']}: {nodes} node(s) x {gpus} GPUs, {nics} NICs/node, "
                     f"{row['collective']} {nbytes:.3g} B"),
            "metric": "busbw_gbps",
            "published": published,
            "predicted": predicted,
            "rel_error": predicted / published - 1,
            "hardware": hw.name,
            "algorithm": cost.algorithm.value,
        })
    return out


def format_validation_table(rows: list[dict]) -> str:
    """A markdown table of ``validate_nccl`` rows."""
    lines = ["| case | published | predicted | rel. error | algorithm |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['published']:g} | {r['predicted']:.1f} | "
                     f"{r['rel_error']:+.1%} | {r['algorithm']} |")
    return "\n".join(lines)
