"""How ``MLP.fit`` maps a model and a batch onto a (dp x) pp (x tp) mesh.

Checks every count divides what it must (naming both), builds the schedule, gives each
rank its arguments (the first stage's ranks get their replica's slice of X, the last
stage's ranks its slice of Y), and assembles the devices' results: losses summed over
data-parallel replicas, parameters put back together from their tensor-parallel pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipelining import make_schedule

from .layers import LayerSpec

__all__ = ["TrainingPlan", "plan_training", "AXES"]

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class TrainingPlan:
    mesh: object
    stage_specs: tuple[tuple[LayerSpec, ...], ...]
    actions: tuple
    dp_axis: str | None
    tp_axis: str | None
    batch: int

    @property
    def p(self) -> int:
        return self.mesh.shape["pp"]

    @property
    def dp(self) -> int:
        return self.mesh.shape[self.dp_axis] if self.dp_axis else 1

    def _coord(self, rank: int, axis: str | None) -> int:
        return 0 if axis is None else self.mesh.group_position(axis, rank)

    def device_args(self, job, X, Y) -> list[tuple]:
        """(job, X part or None, Y part or None) per rank. Each rank's job carries the
        parameters (and optimizer state) of its own stages only, None for the other
        layers: a rank copies what it trains, not the whole model (at width 4096 and
        pp 4, 256 MiB per device instead of 1 GiB)."""
        last = (len(self.stage_specs) - 1) % self.p
        rows = self.batch // self.dp
        jobs = [self._job_for(job, pos) for pos in range(self.p)]
        args = []
        for rank in range(self.mesh.size):
            pos, d = self._coord(rank, "pp"), self._coord(rank, self.dp_axis)
            part = slice(d * rows, (d + 1) * rows)
            if job.per_step_data:          # (steps, batch, ...): split the batch axis
                part = (slice(None), part)
            args.append((jobs[pos], X[part] if pos == 0 else None,
                         Y[part] if pos == last else None))
        return args

    def _job_for(self, job, pos: int):
        """``job`` with the layers of the stages at pp position ``pos`` (s % p == pos)."""
        if job.stage_factory is not None:
            return job
        mine = {spec.index for s, specs in enumerate(job.specs) if s % self.p == pos
                for spec in specs}
        keep = lambda per_layer: tuple(x if i in mine else None  # noqa: E731
                                       for i, x in enumerate(per_layer))
        state = job.optimizer_state
        if state is not None:
            state = (state[0], tuple(keep(slot) for slot in state[1]))
        return replace(job, params=keep(job.params), optimizer_state=state)

    def collect(self, mlp, results: list[dict]):
        import pandas as pd

        from .mlp import FitResult
        from .zero import unshard_results
        results = unshard_results(self.mesh, self.dp_axis, results)
        losses = None
        for r, res in enumerate(results):
            if res["losses"] is not None and self._coord(r, self.tp_axis) == 0:
                part = np.array(res["losses"])
                losses = part if losses is None else losses + part
        params = self.assemble(lambda r: results[r]["params"])
        memory = pd.DataFrame([dict(res["memory"], max_in_flight=max(
            res["memory"]["peak_in_flight"].values(), default=0)) for res in results])
        return FitResult(losses, params, memory)

    def assemble(self, named_of) -> list[tuple]:
        """Global (W, b) per layer from each rank's pieces ``named_of(rank)[layer]``
        (parameters, or a slot of optimizer state sharded like them)."""
        out = []
        for s, specs in enumerate(self.stage_specs):
            holders = [r for r in range(self.mesh.size)
                       if self._coord(r, "pp") == s % self.p and self._coord(r, self.dp_axis) == 0]
            holders.sort(key=lambda r: self._coord(r, self.tp_axis))
            for spec in specs:
                pieces = [named_of(r)[spec.index] for r in holders]
                out.append(tuple(_join([p[i] for p in pieces], layout)
                                 for i, layout in enumerate((spec.w_layout, spec.b_layout))))
        return out


def _join(pieces: list[np.ndarray], layout) -> np.ndarray:
    """A parameter from its pieces in tp order (or the first replica)."""
    for dim, d in enumerate(layout.dims):
        if d.axes:
            return np.concatenate(pieces, axis=dim)
    return pieces[0]


def plan_training(mlp, mesh, batch: int, microbatches: int, schedule: str,
                  virtual_stages: int | None) -> TrainingPlan:
    from .mlp import layer_specs
    unknown = [a for a in mesh.axes if a not in AXES]
    if "pp" not in mesh.axes or unknown:
        raise ValueError(f"MLP.fit: the mesh axes must include 'pp' and may include 'dp' and "
                         f"'tp'; got {mesh.axes}")
    p = mesh.shape["pp"]
    interleaved = schedule == "interleaved_1f1b"
    v = virtual_stages if virtual_stages is not None else (2 if interleaved else 1)
    if not interleaved and v != 1:
        raise ValueError(f"MLP.fit: virtual_stages={virtual_stages} needs "
                         f"schedule='interleaved_1f1b', not {schedule!r}")
    stages = p * v
    if mlp.n_layers % stages:
        raise ValueError(f"MLP.fit: the {mlp.n_layers} layers do not split evenly into {stages} "
                         f"stages (pp={p} ranks x {v} virtual stages)")
    dp_axis = "dp" if "dp" in mesh.axes else None
    tp_axis = "tp" if "tp" in mesh.axes else None
    dp = mesh.shape[dp_axis] if dp_axis else 1
    if batch % (dp * microbatches):
        raise ValueError(f"MLP.fit: the batch of {batch} samples does not split evenly into "
                         f"dp={dp} replicas x {microbatches} micro-batches")
    specs = layer_specs(mlp, stages, tp_axis is not None)
    if tp_axis:
        tp = mesh.shape[tp_axis]
        for spec in (s for st in specs for s in st):
            width = spec.fan_in if spec.kind == "row" else spec.fan_out
            if spec.kind != "dense" and width % tp:
                raise ValueError(f"MLP.fit: layer {spec.index} ({spec.kind}-parallel) has width "
                                 f"{width}, which does not split evenly over tp={tp}")
    sched = make_schedule(schedule, p, microbatches, virtual_stages=v if interleaved else None)
    actions = tuple(tuple(sched.actions[r]) for r in range(p))
    return TrainingPlan(mesh, specs, actions, dp_axis, tp_axis, batch)
