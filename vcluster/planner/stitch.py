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

Combined pairs (Megatron-Core's MoE expert-parallel overlap, ``ParallelConfig(
moe_comm_overlap=True)``, :func:`pipelining.combined_pairs`): a forward and the backward
of another micro-batch that follows it are stitched as one interleaved op sequence
(:func:`combined_ops`): each body is split at its MoE token all_to_alls
(:func:`is_token_exchange`), each is
issued asynchronously (a handle of its own) and waited for just before the segment that
needs its result, F and B segments alternating — F seg 0, F's first all_to_all issued,
B seg 0, B's issued, wait for F's, F seg 1, ... — so that one micro-batch's exchange runs
on the FIFO communication stream while the other's compute runs (Megatron-Core's
``combined_1f1b.py`` and ``fine_grained_callables.py`` order a layer's sub-modules the
same way: attention and dispatch of one, combine and MLP of the other). Both actions'
pipeline receives come before the pair (Megatron receives a step's forward input and
backward gradient together before the step), each action's send right after its own last
segment. Each action's marker comes right after its own last segment (before its send,
as alone), and its ``contains`` covers the pair's run from its first
segment up to the marker: the two markers' spans overlap, each holding the other
action's segments issued in between.

Point-to-point messages inside an action that are not pipeline messages (context
parallelism's K/V ring, to peers outside the pipeline group: ``cut_templates(...,
pipeline_peers=)``) stay in the templates, and :func:`moved` renames their peers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vcluster.runtime.tracing.ops import (DeviceTrace, TraceCollective, TraceCompute, TraceRecv,
                                          TraceSend, TraceWait)

__all__ = ["message_tag", "Templates", "cut_templates", "stitch", "coalesce", "moved",
           "unique_handles", "combined_ops", "is_token_exchange"]


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


def is_token_exchange(op) -> bool:
    """An MoE layer's token exchange: a blocking all_to_all of activations (a dropless
    exchange once :func:`vcluster.planner.simulation.moe_exchanges_as_all_to_all` has
    rewritten it, bytes; a capacity buffer's, 16-bit), not the layer's int64 counts
    exchange (itemsize 8), which Megatron-Core runs inside the layer's compute node (the
    token dispatcher's preprocess, ``fine_grained_callables.py``), not overlapped."""
    return isinstance(op, TraceCollective) and op.collective == "all_to_all" and \
        op.handle is None and op.itemsize != 8


def _split(body, at) -> tuple[list, list]:
    """(segments, exchanges): ``body`` cut at the ops ``at`` picks, k exchanges between
    k + 1 segments."""
    segments, exchanges = [[]], []
    for op in body:
        if at(op):
            exchanges.append(op)
            segments.append([])
        else:
            segments[-1].append(op)
    return segments, exchanges


def combined_ops(f_body, b_body, fresh, at=is_token_exchange):
    """(ops, index just after the forward's last segment): the bodies of a
    combined (F, B) pair interleaved (module docstring). F's segments f_0..f_k between
    its exchanges e_1..e_k, B's b_0..b_l between d_1..d_l; for i = 0, 1, ...: [wait e_i]
    f_i [issue e_(i+1)] then [wait d_i] b_i [issue d_(i+1)], each exchange issued
    asynchronously with the handle ``fresh()`` gives. The ops are the bodies' own, only
    reordered and the exchanges made asynchronous; a body without exchanges is one
    segment (it runs whole, then the other's)."""
    runs = []
    for body in (f_body, b_body):
        segments, exchanges = _split(body, at)
        handles = [fresh() for _ in exchanges]
        runs.append((segments, [TraceCollective(x.collective, x.group, x.nbytes, x.itemsize,
                                                x.algorithm, x.root, h)
                                for x, h in zip(exchanges, handles)], handles))
    ops: list = []
    f_end = None
    for i in range(max(len(r[0]) for r in runs)):
        for which, (segments, issues, handles) in enumerate(runs):
            if i >= len(segments):
                continue
            if i > 0:
                ops.append(TraceWait(handles[i - 1]))
            ops.extend(segments[i])
            if i < len(issues):
                ops.append(issues[i])
            elif which == 0:
                f_end = len(ops)
    return ops, f_end


def stitch(templates: Templates, rank: int, actions, pp_group, n_stages: int,
           microbatches: int, step: int = 0, markers: bool = True,
           pairs=frozenset()) -> DeviceTrace:
    """This rank's trace for ``actions`` (the long schedule), from ``templates``
    (``markers=False`` leaves out the zero-cost action markers). ``pairs``: indices i
    whose actions i (F) and i + 1 (B) run combined (:func:`combined_ops`)."""
    p = len(pp_group)
    last = _last_backwards(actions)
    ops: list = []
    sizes = templates.message_bytes
    handles = iter(range(-1, -(1 << 62), -1))     # fresh, apart from traced (>= 0) ones

    def recv(a):
        s, kind, j = a.stage, _letter(a), a.microbatch
        if kind == "F" and s > 0:
            return [TraceRecv(pp_group[(s - 1) % p], sizes[(0, s)],
                              message_tag(step, 0, s, j, n_stages, microbatches))]
        if kind in ("B", "I") and s < n_stages - 1:
            return [TraceRecv(pp_group[(s + 1) % p], sizes[(1, s)],
                              message_tag(step, 1, s, j, n_stages, microbatches))]
        return []

    def send(a):
        s, kind, j = a.stage, _letter(a), a.microbatch
        if kind == "F" and s < n_stages - 1:
            return [TraceSend(pp_group[(s + 1) % p], sizes[(0, s + 1)],
                              message_tag(step, 0, s + 1, j, n_stages, microbatches))]
        if kind in ("B", "I") and s > 0:
            return [TraceSend(pp_group[(s - 1) % p], sizes[(1, s - 1)],
                              message_tag(step, 1, s - 1, j, n_stages, microbatches))]
        return []

    def body(i, a):
        key = (a.stage, _letter(a), i in last)
        if key not in templates.bodies:
            raise ValueError(f"no template for stage {a.stage} action {_letter(a)} (last="
                             f"{i in last}); trace a step with at least two micro-batches")
        return templates.bodies[key]

    i = 0
    while i < len(actions):
        a = actions[i]
        if i in pairs:
            b = actions[i + 1]
            ops.extend(recv(a) + recv(b))
            run, f_end = combined_ops(body(i, a), body(i + 1, b), lambda: next(handles))
            run[f_end:f_end] = ([TraceCompute(str(a), 0.0, 0, contains=f_end)]
                                if markers else []) + send(a)
            if markers:
                run.append(TraceCompute(str(b), 0.0, 0, contains=len(run)))
            ops.extend(run)
            ops.extend(send(b))
            i += 2
            continue
        ops.extend(recv(a))
        ops.extend(body(i, a))
        if markers:
            ops.append(TraceCompute(str(a), 0.0, 0, contains=len(body(i, a))))
        ops.extend(send(a))
        i += 1
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
