"""The per-device training program: follow this rank's schedule, step after step.

Each device runs its own action list (the host only hands in the batch and collects the
results). For action ``sXj`` (stage s, kind X, micro-batch j):

* F: input = micro-batch j of the batch (stage 0) or ``recv`` from stage s-1's rank;
  forward; ``send`` to stage s+1's rank, or (last stage) the loss and dL/dy;
* I: dL/dy from stage s+1's rank (or the loss); input gradient; ``send`` it to stage s-1;
* W: weight gradient, accumulated over the micro-batches of the step;
* B: I then W.

Messages are tagged (step, direction, stage, micro-batch), so any schedule's order is
matched correctly. After the last micro-batch's weight gradient of a layer, the layer's
gradients are final: they join a data-parallel bucket, and a full bucket
(``bucket_bytes``) starts its all-reduce over ``dp`` at once, asynchronously
(DDP-style), overlapping the remaining backward work. With context parallelism
(``cp_axis``: each rank holds some of the sequence's rows, so its gradients are partial
sums too) the buckets are all-reduced over the combined dp × cp group, one collective per
bucket (Megatron reduces over its data-parallel-with-context group the same way).
``grad_reduce_dtype`` (None: the gradients' own dtype) is the dtype every gradient
reduction runs in — DDP's buckets, ZeRO's reduce-scatters, the tied copies' exchange: the
gradients are cast up into it, summed, and cast back (``"float32"``: FSDP's
``reduce_dtype=float32``, Megatron-LM's fp32 main-gradient reduction). The
optimizer steps once per step. With ``zero_stage`` 1, 2 or 3 the optimizer state (and
gradients, and parameters) are sharded over that same dp (× cp) group instead
(:mod:`pipeline_parallel.zero`: reduce-scatter, update of the shard, all-gather; FSDP's
gathers around each module for stage 3).

A mixture of experts' expert parameters (a stage's ``expert_mask``) go to buckets of their
own, all-reduced over ``expert_dp_axis`` (the expert-data-parallel group, dp/ep ranks, × cp
where present) instead; the results carry each step's weighted MoE aux loss and tokens per
expert (``aux_losses``, ``moe_loads``; a stage's ``moe_report()``). ZeRO-1 shards the
experts' state over that group and the rest over dp (× cp): two flat parameters per MoE
module (:class:`~pipeline_parallel.zero.ShardedState` ``expert_axis``), as Megatron's
distributed optimizer does; ZeRO-2/3 shard the experts' gradients (and weights) over it
too, as Megatron-FSDP does.

Memory: the program tells a :class:`~pipeline_parallel.ledger.MemoryLedger` what it
holds (parameters, gradients, optimizer state, activations — the stages' saved tensors and
the last stage's dL/dy, the logits' gradient, from a micro-batch's forward to its
backward), after every action; ``dev.record_memory``
carries it to ``cluster.stats()`` (``peak_*_bytes``) and the results' ``memory``.

``action_costs`` (seconds per F, B, I, W) adds a sleep to each action — for checking
the measured timeline against :func:`pipelining.simulate`.

Other models plug in their own stages with ``stage_factory(dev, job, stage)``: an object
with :class:`~pipeline_parallel.layers.StageLayers`' interface (forward, backward_input,
backward_weight, zero_grads, params, grads, activation_bytes, in_flight); the last stage
may compute the loss itself (``loss_and_grad(dev, mb, out, targets, global_batch)``, e.g.
a vocabulary-parallel cross-entropy), and ``named_params()`` / ``named_grads()`` name
what the results return. A mesh without the ``pp`` axis is a pipeline of one rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from sharding import shard_slices
from vcluster.runtime.faults import crash_this_device
from vcluster.runtime.tracing.kernel import Kernel

from .functional import loss_and_grad
from .layers import LayerSpec, StageLayers
from .ledger import MemoryLedger
from .optim import Optimizer, OptimizerConfig
from .zero import ShardedState, check_zero_stage, in_dtype

__all__ = ["TrainJob", "train_program", "GradBuckets", "REDUCE_DTYPES"]

#: the dtypes a gradient reduction may run in (TrainJob.grad_reduce_dtype)
REDUCE_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class TrainJob:
    """Everything a device needs to train (the same object on every device)."""

    params: tuple                      # global (W, b) per layer, from the model's seed
    specs: tuple[tuple[LayerSpec, ...], ...]   # layers of each stage
    actions: tuple                     # per pp position: tuple of Action
    loss: str
    optimizer: OptimizerConfig
    steps: int
    microbatches: int
    global_batch: int
    pp_axis: str = "pp"
    dp_axis: str | None = None
    tp_axis: str | None = None
    bucket_bytes: int = 1 << 20
    cp_axis: str | None = None         # context parallelism: gradients summed over dp x cp
    action_costs: dict = field(default_factory=dict)
    stage_factory: object = None       # (dev, job, stage) -> stage; None: StageLayers of specs
    first_step: int = 0                # global number of this job's first step (resumed runs)
    optimizer_state: tuple | None = None   # (t, slots): slots[k] global (W, b) per layer
    return_optimizer: bool = False     # results carry the optimizer state (checkpoints)
    crash_at: tuple = ()       # (rank, global step): injected crashes (vcluster.runtime.faults)
    per_step_data: bool = False        # X, Y hold one batch per step: (steps, rows, ...)
    zero_stage: int = 0                # 0 DDP; 1, 2, 3: ZeRO (pipeline_parallel.zero)
    tied: tuple = ()                   # parameter names held by the first and last stage
    #                                    as one parameter: their gradients summed per step
    expert_dp_axis: object = None      # experts' gradients: sum over this (axis, tuple of
    #                                    axes, () = none) instead of dp_axis; None: dp_axis
    grad_reduce_dtype: str | None = None   # gradient reductions in this dtype (None: the
    #                                        gradients' own), e.g. "float32"

    def __post_init__(self):
        check_zero_stage(self.zero_stage, "TrainJob")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"TrainJob: grad_reduce_dtype must be None (the gradients' own "
                             f"dtype) or one of {REDUCE_DTYPES}, got "
                             f"{self.grad_reduce_dtype!r}")
        if self.zero_stage and (self.optimizer_state is not None or self.return_optimizer):
            raise ValueError(f"TrainJob: zero_stage={self.zero_stage} does not save or "
                             f"restore optimizer state (checkpoints); use zero_stage=0")

    @property
    def n_stages(self) -> int:
        return len(self.specs)


class GradBuckets:
    """DDP-style gradient buckets: all-reduce (sum) over ``axis`` as soon as full.

    ``reduce_dtype`` (None: the gradients' own): the dtype the sum runs in. A bucket of
    another dtype is packed cast into one flat array of it, all-reduced, and written back
    cast to the gradients' dtype — what PyTorch DDP/FSDP do with a ``reduce_dtype``:
    float32 moves 4 bytes per element where bf16 gradients hold 2."""

    def __init__(self, dev, axis: str, bucket_bytes: int, reduce_dtype=None):
        self.dev, self.axis, self.bucket_bytes = dev, axis, bucket_bytes
        self.reduce_dtype = None if reduce_dtype is None else np.dtype(reduce_dtype)
        self._pending: list[np.ndarray] = []
        self._launched: list = []

    def add(self, arrays) -> None:
        self._pending.extend(arrays)
        if sum(a.nbytes for a in self._pending) >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        if not self._pending:
            return
        arrays, self._pending = self._pending, []
        self._launched.append(self._all_reduce(arrays, async_op=True))

    def _all_reduce(self, arrays, async_op: bool) -> tuple:
        """All-reduce ``arrays`` as one bucket: (the Work or the sum, the arrays to write
        the sum back to, or None when it was summed where they lie)."""
        span = adjacent_span(arrays)          # None for device and meta arrays
        if span is not None and self.reduce_dtype not in (None, span.dtype):
            span = None                       # summed in another dtype: packed, cast
        if span is not None:
            # the gradients lie back to back in device memory (StageLayers.place_grads):
            # the bucket is that memory, summed in place — no packing, no write-back
            return self.dev.all_reduce(span, self.axis, out=span, async_op=async_op), None
        return self.dev.all_reduce(self._packed(arrays), self.axis, async_op=async_op), arrays

    def finish(self) -> None:
        """Wait for the buckets in flight, all-reduce what is left, write the sums back.

        What is left would be waited for as soon as it started, so it goes as a blocking
        all-reduce once the buckets in flight are done, rather than ``async_op=True`` and
        ``wait()``: the same collectives in the same issue order, the last one started
        where a communication stream would have started it. On the emulator a blocking
        collective with nothing in flight runs in the program's own thread, where the
        asynchronous form handed it to the communication thread and back with nothing to
        overlap: at width 128 (dp 2 x pp 4, 8 devices pinned on 2 cores; one bucket per
        stage) the step went from 7.4-7.6 to 7.0-7.2 ms (benchmarks/README.md, issue 32).
        """
        launched, self._launched = self._launched, []
        for work, arrays in launched:
            total = work.wait()
            if arrays is not None:
                _unpack(total, arrays)
        if self._pending:
            arrays, self._pending = self._pending, []
            total, arrays = self._all_reduce(arrays, async_op=False)
            if arrays is not None:
                _unpack(total, arrays)

    def _packed(self, arrays):
        """``arrays`` one after another in one flat array of device memory: written
        straight where peers read it in place (``dev.empty``); a private
        ``np.concatenate`` was copied once more into the arena by the all-reduce (its
        input must be resident), |bucket| bytes per bucket."""
        flat = self.dev.empty((sum(a.size for a in arrays),),
                              self.reduce_dtype or np.result_type(*(a.dtype for a in arrays)))
        offset = 0
        for a in arrays:
            flat[offset:offset + a.size] = a.reshape(-1)
            offset += a.size
        return flat


def _unpack(total, arrays) -> None:
    """Write the flat sum ``total`` back into ``arrays``, in order."""
    offset = 0
    for a in arrays:
        a[...] = total[offset:offset + a.size].reshape(a.shape)
        offset += a.size


def adjacent_span(arrays) -> np.ndarray | None:
    """One 1-D view over ``arrays`` when they are C-contiguous numpy arrays of one dtype
    lying back to back, in this order, in one buffer; else None."""
    first = arrays[0]
    if type(first) is not np.ndarray:
        return None
    root = first
    while isinstance(root.base, np.ndarray):
        root = root.base
    item, start = first.itemsize, first.__array_interface__["data"][0]
    end = start
    for a in arrays:
        if (type(a) is not np.ndarray or a.dtype != first.dtype or not a.flags.c_contiguous
                or a.__array_interface__["data"][0] != end):
            return None
        end += a.nbytes
    if root.dtype != first.dtype or not root.flags.c_contiguous:
        return None
    lo, rem = divmod(start - root.__array_interface__["data"][0], item)
    n = (end - start) // item
    if rem or lo < 0 or lo + n > root.size:
        return None
    return root.reshape(-1)[lo:lo + n]


class _NoBuckets:
    """Gradients that need no reduction (a group of one)."""

    def add(self, arrays) -> None:
        pass

    def finish(self) -> None:
        pass


def _expert_buckets(job: TrainJob, dev):
    """The experts' own buckets when ``job.expert_dp_axis`` is set (a _NoBuckets for a
    group of one), else None."""
    if job.expert_dp_axis is None:
        return None
    axes = job.expert_dp_axis
    if axes == () or dev.mesh.axis_size(axes) == 1:
        return _NoBuckets()
    return GradBuckets(dev, axes, job.bucket_bytes, job.grad_reduce_dtype)


def _add_split(buckets, expert_buckets, layers, i: int) -> None:
    """Module ``i``'s final gradients into the buckets: the experts' (``expert_mask``)
    into ``expert_buckets``, the others into ``buckets`` (None: no reduction)."""
    mask = layers.expert_mask(i) if hasattr(layers, "expert_mask") else ()
    grads = layers.grads[i]
    mask = mask or (False,) * len(grads)
    if buckets is not None:
        buckets.add([g for g, e in zip(grads, mask) if not e])
    expert_buckets.add([g for g, e in zip(grads, mask) if e])


def _letter(action) -> str:
    kind = action.kind
    return getattr(kind, "value", kind) if not isinstance(kind, str) else kind


def _local_params(job: TrainJob, dev, stage: int, source=None):
    """This rank's pieces of ``source`` (default: the parameters), (W, b) per layer."""
    out = []
    for spec in job.specs[stage]:
        w, b = (job.params if source is None else source)[spec.index]
        if job.tp_axis is None:
            out.append((w, b))
        else:
            out.append((w[shard_slices(w.shape, spec.w_layout, dev.mesh, dev.rank)],
                        b[shard_slices(b.shape, spec.b_layout, dev.mesh, dev.rank)]))
    return out


def _stage(job: TrainJob, dev, stage: int):
    if job.stage_factory is not None:
        return job.stage_factory(dev, job, stage)
    return StageLayers(list(job.specs[stage]), _local_params(job, dev, stage))


def _named(stages, what: str) -> dict:
    """Parameters (or gradients) of this rank's stages by name (layer index for the MLP)."""
    out = {}
    for s, layers in stages.items():
        named = getattr(layers, f"named_{what}", None)
        if named is not None:
            out.update(named())
        else:
            out.update({spec.index: tuple(getattr(layers, what)[i])
                        for i, spec in enumerate(layers.specs)})
    return out


def _restore_optimizer(job: TrainJob, dev, stages, opt: Optimizer) -> None:
    """Load a checkpoint's optimizer state (global arrays) into this rank's slots."""
    if job.stage_factory is not None:
        raise ValueError("TrainJob.optimizer_state: restoring optimizer state needs the MLP "
                         "stages (stage_factory=None)")
    t, slots = job.optimizer_state
    if len(slots) != len(opt.state):
        raise ValueError(f"TrainJob.optimizer_state: {len(slots)} slot(s) given; optimizer "
                         f"{job.optimizer.name!r} has {len(opt.state)}")
    opt.t = int(t)
    for k, slot in enumerate(slots):
        local = [a for s in sorted(stages) for pair in _local_params(job, dev, s, slot)
                 for a in pair]
        for dst, src in zip(opt.state[k], local, strict=True):
            dst[...] = src


def _optimizer_named(stages, opt: Optimizer) -> dict:
    """The optimizer state by layer index, like the parameters: t and (W, b) per slot."""
    slots = []
    for flat in opt.state:
        it, named = iter(flat), {}
        for s in sorted(stages):
            for spec in stages[s].specs:
                named[spec.index] = (next(it), next(it))
        slots.append(named)
    return {"t": opt.t, "slots": slots}


def _tied_modules(job: TrainJob, stages: dict) -> set:
    """(stage, module) of this rank's modules holding a copy of a ``job.tied`` parameter,
    where the first and last stage differ (one stage holds one copy: nothing to sum)."""
    if not job.tied or job.n_stages == 1:
        return set()
    return {(s, i) for s in stages if s in (0, job.n_stages - 1)
            for i, m in enumerate(getattr(stages[s], "modules", ()))
            if any(n in getattr(m, "p", {}) for n in job.tied)}


def _sum_tied(dev, job: TrainJob, stages: dict, pp, tag: int) -> None:
    """Sum the gradients of ``job.tied`` (e.g. a tied word embedding E) between the first
    stage and the last, which hold one copy each (Megatron-LM's embedding group): both
    become first + last, in that order (the same sum, bit for bit, so the copies stay
    equal). Under DDP after the data-parallel reduction, as Megatron-LM; under ZeRO-1
    before it (the executor holds those modules' reduce-scatter back until then). On one
    rank a local sum; else pipeline rank 0 and the last stage's rank exchange their
    gradients (p2p; ``tag`` is the step's forward tag of stage 0, which no pipeline
    message uses), in ``job.grad_reduce_dtype`` where one is set."""
    S = job.n_stages
    first, last = stages.get(0), stages.get(S - 1)
    rd = job.grad_reduce_dtype
    for name in job.tied:
        own = [st.named_grads()[name] for st in (first, last) if st is not None]
        g0 = None if first is None else in_dtype(own[0], rd)
        gl = None if last is None else in_dtype(own[-1], rd)
        if g0 is None:                     # the last stage's rank: receive, then send
            g0 = dev.recv(pp[0], tag)
            dev.send(gl, pp[0], tag)
        elif gl is None:                   # pipeline rank 0: send, then receive
            dev.send(g0, pp[(S - 1) % len(pp)], tag)
            gl = dev.recv(pp[(S - 1) % len(pp)], tag)
        with dev.compute("tied grads: sum", flops=g0.size, bytes=3 * g0.nbytes):
            total = g0 + gl
        for g in own:                      # cast back to the gradients' dtype
            g[...] = total


def _activation_bytes(stages: dict, pending_dy: dict) -> int:
    """What the stages keep for their backward, plus the loss gradients dL/dy (the last
    stage's logits' gradient) held from a micro-batch's forward to its backward."""
    return sum(L.activation_bytes for L in stages.values()) + sum(
        int(d.nbytes) for d in pending_dy.values())


def train_program(dev, job: TrainJob, X, Y):
    """The SPMD training program (see the module docstring); returns this rank's results."""
    pp = dev.mesh.group(job.pp_axis, dev.rank) if job.pp_axis in dev.mesh.axes else (dev.rank,)
    p, pos = len(pp), pp.index(dev.rank)
    S, m = job.n_stages, job.microbatches
    stages = {s: _stage(job, dev, s) for s in range(S) if s % p == pos}
    check_zero_stage(job.zero_stage, "TrainJob", p)
    grad_axes = tuple(a for x in (job.dp_axis, job.cp_axis) if x is not None    # dp (× ep)
                      for a in ((x,) if isinstance(x, str) else x))              # (× cp)
    grad_axis = grad_axes[0] if len(grad_axes) == 1 else grad_axes
    grad_size = dev.mesh.axis_size(grad_axes) if grad_axes else 1
    in_place = job.grad_reduce_dtype is None or all(   # summed in their own dtype
        a.dtype == job.grad_reduce_dtype for st in stages.values() for pair in st.params
        for a in pair)
    if grad_size > 1 and not job.zero_stage and job.expert_dp_axis is None and dev.xp is np \
            and in_place:
        # buckets become views summed in place; where the arena cannot hold the gradients
        # this raises ArenaFullError, as packing would later (it holds every bucket's copy
        # and sum until the step's end: twice the gradients)
        for layers in stages.values():
            if hasattr(layers, "place_grads"):
                layers.place_grads(dev.empty)
    params = [arr for s in sorted(stages) for pair in stages[s].params for arr in pair]
    grads = [arr for s in sorted(stages) for pair in stages[s].grads for arr in pair]
    ledger, zero, opt = MemoryLedger(dev), None, None
    if job.zero_stage:
        zero = ShardedState(dev, job.zero_stage, grad_axis if grad_axes else None, stages,
                            job.optimizer, ledger, reduce_dtype=job.grad_reduce_dtype,
                            expert_axis=job.expert_dp_axis)
    else:
        opt = Optimizer(job.optimizer, params)
        opt_bytes = sum(p.nbytes for p in params) * opt.bytes_touched_per_param_byte
        opt_kernel = Kernel.optimizer(sum(int(p.size) for p in params), job.optimizer.name)
        ledger.set("params", sum(a.nbytes for a in params))
        ledger.set("grads", sum(a.nbytes for a in grads))
        ledger.set("optimizer", opt.state_bytes)
    if job.optimizer_state is not None:
        _restore_optimizer(job, dev, stages, opt)
    crash_steps = {step for rank, step in job.crash_at if rank == dev.rank}
    dp_size = 1 if job.dp_axis is None else len(dev.mesh.group(job.dp_axis, dev.rank))
    rows = job.global_batch // (dp_size * m)
    losses, peak_act, peak_in_flight = [], 0, {s: 0 for s in stages}
    aux_losses, moe_loads = [], []
    tied_modules = _tied_modules(job, stages)

    def tag(step, direction, stage, j):
        return ((step * 2 + direction) * S + stage) * m + j

    # (stage, kind letter, micro-batch, compute-block name) of each action, once per run
    my_actions = [(a.stage, _letter(a), a.microbatch, str(a)) for a in job.actions[pos]]
    costs = job.action_costs
    all_X, all_Y = X, Y
    for step in range(job.steps):
        if job.first_step + step in crash_steps:
            crash_this_device()
        if job.per_step_data:              # sampled mini-batches: this step's rows
            X = None if all_X is None else all_X[step]
            Y = None if all_Y is None else all_Y[step]
        for layers in stages.values():
            layers.zero_grads()
        left = {s: m for s in stages}
        buckets = GradBuckets(dev, grad_axis, job.bucket_bytes, job.grad_reduce_dtype) \
            if grad_size > 1 and zero is None else None
        expert_buckets = _expert_buckets(job, dev) if zero is None else None
        if zero is not None:
            zero.begin_step()
        pending_dy, loss = {}, 0.0
        for s, kind, j, name in my_actions:
            layers = stages[s]
            # inputs first: waiting for a neighbour is idle time, not part of the action
            if kind == "F":
                x = X[j * rows:(j + 1) * rows] if s == 0 else \
                    dev.recv(pp[(s - 1) % p], tag(step, 0, s, j))
            elif kind in ("B", "I"):
                dy = pending_dy.pop(j) if s == S - 1 else \
                    dev.recv(pp[(s + 1) % p], tag(step, 1, s, j))
            out = None
            with dev.compute(name):
                if costs and costs.get(kind):
                    time.sleep(costs[kind])
                if kind == "F":
                    out = layers.forward(dev, j, x)
                    peak_in_flight[s] = max(peak_in_flight[s], layers.in_flight)
                    if s == S - 1:
                        own = getattr(layers, "loss_and_grad", None)
                        part, pending_dy[j] = (
                            own(dev, j, out, Y[j * rows:(j + 1) * rows], job.global_batch)
                            if own is not None else loss_and_grad(
                                job.loss, out, Y[j * rows:(j + 1) * rows], job.global_batch))
                        loss += part
                        out = None
                elif kind in ("B", "I"):
                    out = layers.backward_input(dev, j, dy, need_input_grad=s > 0)
                act = _activation_bytes(stages, pending_dy)
                peak_act = max(peak_act, act)
                ledger.set("activations", act)
                if kind in ("B", "W"):
                    left[s] -= 1
                    done = None
                    if expert_buckets is not None and left[s] == 0:
                        done = lambda l, L=layers: _add_split(  # noqa: E731
                            buckets, expert_buckets, L, l)
                    elif buckets is not None and left[s] == 0:
                        done = lambda l, L=layers: buckets.add(L.grads[l])  # noqa: E731
                    elif zero is not None and (left[s] == 0 or zero.stage >= 2):
                        done = lambda i, s=s: None if (s, i) in tied_modules \
                            else zero.grad_ready(s, i)  # noqa: E731
                    layers.backward_weight(dev, j, on_layer_done=done)
            if out is not None and kind == "F":
                dev.send(out, pp[(s + 1) % p], tag(step, 0, s + 1, j))
            elif out is not None and s > 0:
                dev.send(out, pp[(s - 1) % p], tag(step, 1, s - 1, j))
        for b in (buckets, expert_buckets):
            if b is not None:
                b.finish()
        if tied_modules:
            _sum_tied(dev, job, stages, pp, tag(step, 0, 0, 0))
        ledger.set("activations", _activation_bytes(stages, pending_dy))
        if zero is not None:
            for u in sorted(tied_modules):     # held back until the copies were summed
                zero.grad_ready(*u)
            zero.finish_grads()
            zero.step()
        else:
            with dev.compute("optimizer", flops=0, bytes=opt_bytes, kernel=opt_kernel):
                opt.step(params, grads)
        losses.append(loss)
        for L in stages.values():
            if hasattr(L, "end_step"):          # MoE: the auxiliary-loss-free bias update
                L.end_step()
        reports = [L.moe_report() for L in stages.values() if hasattr(L, "moe_report")]
        aux_losses.append(sum(a for a, _ in reports))
        moe_loads.append({k: v for _, d in reports for k, v in d.items()})
    named_params, named_grads = _named(stages, "params"), _named(stages, "grads")
    return {
        "aux_losses": aux_losses, "moe_loads": moe_loads,
        "rank": dev.rank, "pp_position": pos,
        "optimizer": _optimizer_named(stages, opt) if job.return_optimizer else None,
        "losses": losses if (S - 1) in stages else None,
        "params": named_params, "grads": named_grads,
        "zero": None if zero is None else zero.result(named_params, named_grads),
        "memory": {"rank": dev.rank, "params_bytes": sum(a.nbytes for a in params),
                   "grads_bytes": sum(a.nbytes for a in grads),
                   "optimizer_bytes": (opt or zero.opt).state_bytes,
                   "activations_bytes": sum(L.activation_bytes for L in stages.values()),
                   "activations_peak_bytes": peak_act,
                   "peak_in_flight": dict(peak_in_flight), **ledger.peaks()},
    }
