"""Check the collective cost model against published NCCL bus bandwidths (nccl_a100.csv).

``validate_nccl()`` predicts every row of ``data/nccl_a100.csv`` — a group of
nodes x gpus_per_node ranks, algorithm "auto", nccl-tests' busbw — on the preset its
system maps to (``SYSTEM_PRESETS``; a row with a NICs-per-node figure uses a variant of
the preset with that many NICs). One JSON-friendly dict per row::

    {"source", "case", "metric": "busbw_gbps", "published", "predicted", "rel_error",
     "hardware", "algorithm"}        rel_error = predicted / published - 1

Acceptance (tests): |rel_error| <= ``NCCL_TOLERANCE`` for every row.

``validate_nccl_2026()`` does the same for ``data/nccl_2026.csv``: collectives measured
on the hardware of 2026 (DGX B200/B300, GB200 NVL72, MI300X), each row on its preset,
with the run's scale-up domain (``domain_gpus``: NVL72 racks partitioned into NVL4/NVL8
domains), NVLink SHARP switched off where the run did (``nvls`` 0) and the algorithm it
forced. Its rows carry a ``role``: ``fit`` rows are the ones a preset constant was read
from, ``held_out`` rows chose nothing; the errors of both are reported apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .collective_cost import collective_cost
from .hardware import HardwareSpec
from .presets import load_hardware, read_data_csv

__all__ = ["validate_nccl", "validate_nccl_2026", "format_validation_table", "SYSTEM_PRESETS",
           "NCCL_TOLERANCE", "NCCL_2026_CSV"]

NCCL_TOLERANCE = 0.10  # acceptance: every published busbw within 10 %
NCCL_CSV = "nccl_a100.csv"
NCCL_2026_CSV = "nccl_2026.csv"
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


def validate_nccl_2026() -> list[dict]:
    """One row per line of nccl_2026.csv: published vs predicted busbw (GB/s), with its
    role (``fit`` / ``held_out``), as :func:`validate_nccl`'s rows."""
    _, rows = read_data_csv(NCCL_2026_CSV)
    out = []
    for row in rows:
        hw = load_hardware(row["preset"])
        node = hw.node
        if row["domain_gpus"].strip():
            node = replace(node, domain_gpus=int(row["domain_gpus"]))
        if row["nvls"].strip() == "0":
            node = replace(node, nvls_efficiency=None)
        if node != hw.node:
            hw = replace(hw, name=f"{hw.name}-nvl{node.domain_gpus}"
                         + ("-no-nvls" if node.nvls_efficiency is None else ""), node=node)
        gpus, nbytes = int(row["gpus"]), int(float(row["message_bytes"]))
        nodes = int(row["nodes"])
        if not (nodes - 1) * hw.gpus_per_node < gpus <= nodes * hw.gpus_per_node:
            raise ValueError(f"{NCCL_2026_CSV}: {row['system']!r}: {row['gpus']} GPUs do "
                             f"not fill {row['nodes']} nodes of {hw.gpus_per_node}")
        cost = collective_cost(row["collective"], nbytes, tuple(range(gpus)), hw,
                               algorithm=row["algorithm"])
        published = float(row["busbw_gbps"])
        out.append({
            "source": row["source"],
            "case": (f"{row['system']}: {gpus} GPUs in domains of {hw.domain_gpus}, "
                     f"{row['collective']} {nbytes:.3g} B"),
            "metric": "busbw_gbps", "published": published, "predicted": cost.busbw_gbps,
            "rel_error": cost.busbw_gbps / published - 1, "hardware": hw.name,
            "algorithm": cost.algorithm.value, "role": row["role"],
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
