"""A pipeline laid over one axis of a :class:`mesh.Mesh`.

Along the mesh axis ``axis`` of size ``p``, the ranks of each group
``mesh.group(axis, rank)`` form one pipeline; a rank's *position* in its
group (``mesh.group_position(axis, rank)``) is its pipeline rank, the
column of the schedule it runs.  With ``S = p v`` stages, stage ``s`` lives
at position ``s mod p`` as chunk ``s // p`` (Megatron-LM's interleaved
layout, Narayanan et al. SC21; ``v = 1`` gives stage ``s`` at position
``s``).  Stage 0 reads the micro-batch, stage ``S-1`` computes the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh import Mesh
from mesh.arguments import as_int

from .actions import Action
from .generators import SCHEDULE_NAMES, make_schedule
from .schedule import Schedule
from .validate import validate

__all__ = ["PipelineStage", "Pipeline"]


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` of a pipeline: at pipeline position ``position`` as its chunk ``chunk``."""

    index: int
    position: int
    chunk: int
    is_first: bool
    is_last: bool


@dataclass(frozen=True, init=False, repr=False)
class Pipeline:
    """``Pipeline(mesh, axis="pp", stages=None, microbatches=None, schedule="1f1b")``.

    ``schedule`` is a name from :data:`SCHEDULE_NAMES` or a :class:`Schedule`
    (whose ``ranks`` must equal ``p = mesh.shape[axis]``).  ``stages`` must be a
    multiple of ``p``; ``v = stages / p`` becomes the schedule's virtual stages
    (default: the Schedule's, else 2p for ``"interleaved_1f1b"``, else p).
    ``microbatches`` is required with a schedule name.
    """

    mesh: Mesh
    axis: str
    schedule: Schedule

    def __init__(self, mesh: Mesh, axis: str = "pp", stages: int | None = None,
                 microbatches: int | None = None, schedule: str | Schedule = "1f1b") -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Pipeline: mesh must be a mesh.Mesh, got {mesh!r}")
        if not isinstance(axis, str):
            raise TypeError(f"Pipeline: axis must be one axis name of {mesh.axes!r}, got {axis!r}")
        mesh.axis_tuple(axis)  # raises if the axis is not the mesh's
        p = mesh.shape[axis]
        if stages is not None:
            stages = as_int(stages, "Pipeline: stages", 1)
            if stages % p:
                raise ValueError(
                    f"Pipeline: stages={stages} must be a multiple of p={p} (the size of mesh "
                    f"axis {axis!r}), so every rank holds the same number of chunks; "
                    f"stages mod p = {stages % p}")
        if microbatches is not None:
            microbatches = as_int(microbatches, "Pipeline: microbatches", 1)
        if isinstance(schedule, Schedule):
            sched = schedule
            if sched.ranks != p:
                raise ValueError(f"Pipeline: schedule {sched.name!r} has ranks={sched.ranks} but "
                                 f"mesh axis {axis!r} has size p={p}; they must be equal")
            if stages is not None and stages != sched.stages:
                raise ValueError(f"Pipeline: stages={stages} but schedule {sched.name!r} has "
                                 f"{sched.stages} stages (p={p} x v={sched.virtual_stages})")
            if microbatches is not None and microbatches != sched.microbatches:
                raise ValueError(f"Pipeline: microbatches={microbatches} but schedule "
                                 f"{sched.name!r} has {sched.microbatches}")
            validate(sched)
        elif isinstance(schedule, str):
            key = schedule.strip().lower()
            if key not in SCHEDULE_NAMES:
                raise ValueError(f"Pipeline: unknown schedule {schedule!r}; choose from "
                                 f"{', '.join(SCHEDULE_NAMES)} or pass a Schedule")
            if microbatches is None:
                raise TypeError(f"Pipeline: microbatches is required with schedule {key!r}")
            if stages is None:
                stages = 2 * p if key == "interleaved_1f1b" else p
            v = stages // p
            if key != "interleaved_1f1b" and v != 1:
                raise ValueError(
                    f"Pipeline: schedule {key!r} runs one stage per rank, but stages={stages} on "
                    f"p={p} ranks means v={v} chunks per rank; use 'interleaved_1f1b' or "
                    f"stages={p}")
            sched = make_schedule(key, p, microbatches,
                                  v if key == "interleaved_1f1b" else None)
        else:
            raise TypeError(f"Pipeline: schedule must be a name ({', '.join(SCHEDULE_NAMES)}) "
                            f"or a Schedule, got {schedule!r}")
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "schedule", sched)

    # ----------------------------------------------------------- sizes
    @property
    def ranks(self) -> int:
        """``p``: pipeline ranks (size of the mesh axis)."""
        return self.schedule.ranks

    @property
    def virtual_stages(self) -> int:
        """``v``: chunks per rank."""
        return self.schedule.virtual_stages

    @property
    def stages(self) -> int:
        """``S = p v``: number of stages."""
        return self.schedule.stages

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    # ----------------------------------------------------------- stages
    def stage(self, index: int) -> PipelineStage:
        """Stage ``index`` (``0 .. S-1``): position ``index mod p``, chunk ``index // p``."""
        s = self.schedule._check_stage(index)
        p = self.ranks
        return PipelineStage(s, s % p, s // p, s == 0, s == self.stages - 1)

    @property
    def all_stages(self) -> tuple[PipelineStage, ...]:
        """Every stage, in model order."""
        return tuple(self.stage(s) for s in range(self.stages))

    def stages_of(self, position: int) -> tuple[PipelineStage, ...]:
        """The stages at pipeline position ``position``, chunk order."""
        return tuple(self.stage(s) for s in self.schedule.stages_of(position))

    # ----------------------------------------------------------- mesh ranks
    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every pipeline's mesh ranks in position order (``mesh.groups(axis)``)."""
        return self.mesh.groups(self.axis)

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The mesh ranks of ``rank``'s pipeline, position order (``mesh.group(axis, rank)``)."""
        return self.mesh.group(self.axis, rank)

    def position_of(self, rank: int) -> int:
        """``rank``'s pipeline position (``mesh.group_position(axis, rank)``)."""
        return self.mesh.group_position(self.axis, rank)

    def stages_on(self, rank: int) -> tuple[PipelineStage, ...]:
        """The stages mesh rank ``rank`` holds."""
        return self.stages_of(self.position_of(rank))

    def actions_of(self, rank: int) -> tuple[Action, ...]:
        """The ordered actions mesh rank ``rank`` runs."""
        return self.schedule[self.position_of(rank)]

    def rank_of_stage(self, index: int, rank: int) -> int:
        """The mesh rank holding stage ``index`` in the pipeline that ``rank`` belongs to."""
        return self.group_of(rank)[self.stage(index).position]

    def _repr_html_(self) -> str:
        """For notebooks: the pipelines' mesh ranks by position, then the schedule grid."""
        import html
        groups = "; ".join(" -> ".join(map(str, g)) for g in self.rank_groups)
        return (f"<div><b>{html.escape(repr(self))}</b></div><div>pipelines over "
                f"{html.escape(self.axis)} (mesh ranks by position): {html.escape(groups)}"
                f"</div>{self.schedule._repr_html_()}")

    def __repr__(self) -> str:
        return (f"Pipeline(mesh={self.mesh!r}, axis={self.axis!r}, stages={self.stages}, "
                f"microbatches={self.microbatches}, schedule={self.schedule.name!r})")
