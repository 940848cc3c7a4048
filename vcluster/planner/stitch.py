"""Traces of long training steps, stitched from the traced actions of a short one.

Tracing a step of many micro-batches repeats the same work: every forward of a stage
on a micro-batch of fixed size records the same ops. So a long step is traced once
with few micro-batches, each action's ops are cut out as a *template* — keyed by
(stage, kind, whether it is the stage's last backward on its rank, which holds the
gradient buckets' all-reduce launches) — and the long step's trace is put together by
following the long schedule: for every action, its receive, its template, its marker
and its send, exactly as :func:`pipeline_parallel.executor.train_program` issues them;
then the step's tail (waiting for the buckets). A test checks that a stitched trace
equals the traced one op for op.

In a pipeline of uniform layers the middle stages do the same work, up to the names of
the ranks they talk to: :func:`moved` turns one pipeline position's templates into
another's (stage numbers and collective groups renamed), so a deep pipeline is traced
with one middle position only (see :mod:`vcluster.planner.simulation`).

Point-to-point messages inside an action that are not pipeline messages (context
parallelism's K/V ring, to peers outside the pipeline group: ``cut_templates(...,
pipeline_peers=)``) stay in the templates, and :func:`moved` renames their peers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vcluster.runtime.tracing.ops import (DeviceTrace, TraceCollective, TraceCompute, TraceRecv,
                                          TraceSend, TraceWait)

__all__ = ["message_tag", "Templates", "cut_templates", "stitch", "coalesce", "moved",
           "unique_handles"]


def message_tag(step: int, direction: int, stage: int, microbatch: int, n_stages: int,
                microbatches: int) -> int:
    """The tag of a pipeline message: direction 0 carries activations to ``stage``,
    direction 1 gradients to ``stage``."""
    return ((step * 2 + direction) * n_stages + stage) * microbatches + microbatch


def _letter(action) -> str:
    kind = action.kind
    return kind if isinstance(kind, str) else kind.value


def _last_backwards(actions) -> set:
    """Indices of each stage's last B or W action in a rank's list."""
    last = {}
    for i, a in enumerate(actions):
        if _letter(a) in ("B", "W"):
            last[a.stage] = i
    return set(last.values())


@dataclass(frozen=True)
class Templates:
    """Per (stage, kind, last) the ops of one action; the tail after the last action;
    and the bytes of the activation (direction 0) and gradient (1) messages per stage."""

    bodies: dict
    tail: tuple
    message_bytes: dict


def cut_templates(trace: DeviceTrace, actions, n_stages: int, microbatches: int,
                  pipeline_peers=None) -> Templates:
    """Cut ``trace`` (one traced step of this rank with ``actions``) into templates. The
    pipeline's messages (to or from ``pipeline_peers``, None: any peer, with tags below
    2·n_stages·microbatches: :func:`message_tag` of step 0) are left out, :func:`stitch`
    puts them back; other point-to-point messages (a context-parallel K/V ring's, a
    mixture of experts' token exchanges, with their own user tags) stay in the bodies."""
    last = _last_backwards(actions)
    bodies, body, k = {}, [], 0
    sizes: dict = {}
    for op in trace.ops:
        if isinstance(op, (TraceSend, TraceRecv)) and (
                pipeline_peers is None or op.peer in pipeline_peers) \
                and op.tag < 2 * n_stages * microbatches:
            direction, stage = divmod(op.tag // microbatches, n_stages)
            sizes[(direction % 2, stage)] = op.nbytes
            continue
        if (k < len(actions) and isinstance(op, TraceCompute) and op.name == str(actions[k])
                and op.flops == 0 and op.bytes == 0):
            a = actions[k]
            bodies.setdefault((a.stage, _letter(a), k in last), tuple(body))
            body, k = [], k + 1
            continue
        body.append(op)
    if k != len(actions):
        raise ValueError(f"rank {trace.rank}: found {k} of {len(actions)} action markers in "
                         "the trace; was it traced with these actions?")
    return Templates(bodies, tuple(body), sizes)


def coalesce(templates: Templates, costs, op_kind=None) -> Templates:
    """Templates whose runs of consecutive compute ops are merged into one op each, with
    the sum of their durations under ``costs`` as its ``seconds`` (replays the same time
    with a fraction of the ops). With ``op_kind`` (name -> kind, or None for "the previous
    op's kind"), a run is cut where the kind changes and each merged op is named by its
    kind, so that per-op accounting (:mod:`vcluster.timing.results`) sees the same kinds."""
    def kinds_of(ops):
        kinds, kind = [], None
        for op in ops:
            if isinstance(op, TraceCompute):
                kind = op_kind(op.name) or kind
            kinds.append(kind)
        return kinds

    def merge(ops):
        out, run = [], []
        kinds = kinds_of(ops) if op_kind is not None else [None] * len(ops)

        def flush(kind):
            if len(run) == 1:
                out.append(run[0])
            elif run:
                out.append(TraceCompute(kind or "compute", sum(o.flops for o in run),
                                        sum(o.bytes for o in run),
                                        sum(costs.compute_time_s(o) for o in run)))
            run.clear()
        run_kind = None
        for op, kind in zip(ops, kinds):
            if isinstance(op, TraceCompute):
                if run and kind != run_kind:
                    flush(run_kind)
                run.append(op)
                run_kind = kind
            else:
                flush(run_kind)
                out.append(op)
        flush(run_kind)
        return tuple(out)
    return Templates({k: merge(v) for k, v in templates.bodies.items()}, merge(templates.tail),
                     templates.message_bytes)


def moved(templates: Templates, stage_of, rank_of, message_bytes=None,
          group_of=None) -> Templates:
    """``templates`` of another pipeline position: every key's stage ``s`` becomes
    ``stage_of(s)``, every collective's group ``(r, ...)`` becomes ``(rank_of(r), ...)``
    — or ``group_of(group, that)`` when given — and every send's or receive's peer r (a
    body's own messages — a cp ring's, an MoE exchange's: the pipeline's are not in
    templates, :func:`stitch` names them) ``rank_of(r)``; the message sizes become
    ``message_bytes`` when given."""
    groups: dict = {}

    def rename(ops):
        out = []
        for op in ops:
            if isinstance(op, TraceCollective):
                g = groups.get(op.group)
                if g is None:
                    g = tuple(rank_of(r) for r in op.group)
                    g = groups[op.group] = g if group_of is None else group_of(op.group, g)
                op = TraceCollective(op.collective, g, op.nbytes, op.itemsize, op.algorithm,
                                     op.root, op.handle)
            elif isinstance(op, (TraceSend, TraceRecv)):
                op = type(op)(rank_of(op.peer), op.nbytes, op.tag)
            out.append(op)
        return tuple(out)
    bodies = {(stage_of(s), kind, last): rename(ops)
              for (s, kind, last), ops in templates.bodies.items()}
    return Templates(bodies, rename(templates.tail),
                     templates.message_bytes if message_bytes is None else message_bytes)


def stitch(templates: Templates, rank: int, actions, pp_group, n_stages: int,
           microbatches: int, step: int = 0, markers: bool = True) -> DeviceTrace:
    """This rank's trace for ``actions`` (the long schedule), from ``templates``
    (``markers=False`` leaves out the zero-cost action markers)."""
    p = len(pp_group)
    last = _last_backwards(actions)
    ops: list = []
    sizes = templates.message_bytes
    for i, a in enumerate(actions):
        s, kind, j = a.stage, _letter(a), a.microbatch
        if kind == "F" and s > 0:
            ops.append(TraceRecv(pp_group[(s - 1) % p], sizes[(0, s)],
                                 message_tag(step, 0, s, j, n_stages, microbatches)))
        elif kind in ("B", "I") and s < n_stages - 1:
            ops.append(TraceRecv(pp_group[(s + 1) % p], sizes[(1, s)],
                                 message_tag(step, 1, s, j, n_stages, microbatches)))
        key = (s, kind, i in last)
        if key not in templates.bodies:
            raise ValueError(f"no template for stage {s} action {kind} (last={i in last}); "
                             "trace a step with at least two micro-batches")
        body = templates.bodies[key]
        ops.extend(body)
        if markers:
            ops.append(TraceCompute(str(a), 0.0, 0, contains=len(body)))
        if kind == "F" and s < n_stages - 1:
            ops.append(TraceSend(pp_group[(s + 1) % p], sizes[(0, s + 1)],
                                 message_tag(step, 0, s + 1, j, n_stages, microbatches)))
        elif kind in ("B", "I") and s > 0:
            ops.append(TraceSend(pp_group[(s - 1) % p], sizes[(1, s - 1)],
                                 message_tag(step, 1, s - 1, j, n_stages, microbatches)))
    ops.extend(templates.tail)
    return DeviceTrace(rank, tuple(ops))


def unique_handles(trace: DeviceTrace) -> DeviceTrace:
    """``trace`` with every asynchronous collective given a handle of its own, for a
    stitched step whose templates issue collectives that are waited for only later: ZeRO-2
    and 3 reduce-scatter every micro-batch's gradients (async) and wait for them all at the
    end of the step, so a template used for m - 1 micro-batches issues its handles m - 1
    times. A wait for a traced handle waits for every outstanding instance of it, oldest
    first (the tail's wait for a backward's reduce-scatter waits for all m - 1 of them;
    a wait inside a body — ZeRO-3's all-gathers — finds one)."""
    fresh, live, ops = 0, {}, []
    for op in trace.ops:
        if isinstance(op, TraceCollective) and op.handle is not None:
            live.setdefault(op.handle, []).append(fresh)
            op = TraceCollective(op.collective, op.group, op.nbytes, op.itemsize,
                                 op.algorithm, op.root, fresh)
            fresh += 1
        elif isinstance(op, TraceWait):
            ops.extend(TraceWait(h) for h in live.pop(op.handle, ()))
            continue
        ops.append(op)
    return DeviceTrace(trace.rank, tuple(ops))
