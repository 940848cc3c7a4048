"""``Golden``: per-rank inputs, outputs and gradients of one run, and its manifest.

On disk (``save_golden`` / ``load_golden``)::

    DIR/manifest.json          what, where, how: see below
    DIR/rank<r>/inputs.npz     the rank's input arrays (names: arg<i>[.<key>...])
    DIR/rank<r>/outputs.npz    what the program returned on the rank
    DIR/rank<r>/gradients.npz  returned gradients (names d<Name>), when there are any

``manifest.json`` holds ``format``, ``scenario`` (a name and, from a scenario file, its
sections), ``seed``, ``mesh`` (shape, axes), ``layouts``, ``dtypes`` and ``tolerances``
per tensor, ``engine`` (``emulator`` or ``torch``; for torch also ``torch_version`` and
``torch_backend`` as torch reports them) and ``arrays``: per rank, kind and name the
dtype, shape and ``sha256`` content hash (:mod:`vcluster.oracle.hashing`), checked on
load. The directory is written next to its destination and renamed into place, so a
reader never sees half a golden.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from .hashing import array_sha256

__all__ = ["Golden", "save_golden", "load_golden", "FORMAT", "KINDS"]

FORMAT = "vcluster-oracle/1"
KINDS = ("inputs", "outputs", "gradients")


@dataclass(frozen=True, repr=False)
class Golden:
    """``arrays[r][kind][name]``; ``manifest`` as described in the module docstring."""

    manifest: dict
    arrays: tuple = field(default_factory=tuple)

    def __repr__(self) -> str:
        m = self.manifest
        names = sorted(self.results(0)) if self.arrays else []
        return (f"Golden({m.get('scenario', {}).get('name')!r}, engine={m.get('engine')!r}, "
                f"mesh={m['mesh']['shape']}, tensors={names})")

    @property
    def size(self) -> int:
        return len(self.arrays)

    def results(self, rank: int) -> dict:
        """Outputs and gradients of ``rank`` by name (what ``compare`` checks)."""
        return {**self.arrays[rank].get("outputs", {}), **self.arrays[rank].get("gradients", {})}

    def inputs(self, rank: int) -> dict:
        return dict(self.arrays[rank].get("inputs", {}))

    def results_by_rank(self) -> list[dict]:
        return [self.results(r) for r in range(self.size)]

    def tolerance(self, name: str) -> dict:
        return dict(self.manifest.get("tolerances", {}).get(name, {"rtol": 0.0, "atol": 0.0}))


def _npz_bytes(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def save_golden(golden: Golden, directory) -> str:
    """Write ``golden`` to ``directory`` (replacing it as a whole); return its path."""
    directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".oracle-", dir=parent)
    try:
        manifest = dict(golden.manifest)
        manifest["arrays"] = []
        for r, kinds in enumerate(golden.arrays):
            os.makedirs(os.path.join(tmp, f"rank{r}"))
            entry = {}
            for kind in KINDS:
                arrays = kinds.get(kind) or {}
                if not arrays and kind == "gradients":
                    continue
                with open(os.path.join(tmp, f"rank{r}", f"{kind}.npz"), "wb") as f:
                    f.write(_npz_bytes(arrays))
                entry[kind] = {name: {"dtype": np.asarray(a).dtype.str,
                                      "shape": list(np.shape(a)), "sha256": array_sha256(a)}
                               for name, a in arrays.items()}
            manifest["arrays"].append(entry)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
        old = None
        if os.path.exists(directory):
            old = tempfile.mkdtemp(prefix=".oracle-old-", dir=parent)
            os.replace(directory, os.path.join(old, "d"))
        os.replace(tmp, directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_golden(directory, verify: bool = True) -> Golden:
    """Read a golden directory; with ``verify`` every array's hash must match the manifest."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} is not a golden directory: no manifest.json "
                                "(write one with `vcluster oracle export`)")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    arrays = []
    for r, entry in enumerate(manifest["arrays"]):
        kinds = {}
        for kind, listed in entry.items():
            with np.load(os.path.join(directory, f"rank{r}", f"{kind}.npz")) as data:
                kinds[kind] = {name: data[name] for name in listed}
            if verify:
                for name, meta in listed.items():
                    got = array_sha256(kinds[kind][name])
                    if got != meta["sha256"]:
                        raise ValueError(f"{directory}: rank {r} {kind} {name!r}: sha256 {got} "
                                         f"!= manifest {meta['sha256']} (the file changed)")
        arrays.append(kinds)
    return Golden(manifest, tuple(arrays))
