"""ZeRO (Rajbhandari et al., 2020) and FSDP: data parallelism with sharded training state.

n = the data-parallel degree (the ``dp`` group of a rank), P = the bytes of the
parameters this rank trains (its pipeline stages, its tensor-parallel pieces). Each
module of a stage (an MLP layer; a transformer layer, the embedding, the head) is one
*flat parameter*, like FSDP's: its arrays flattened in order and concatenated, zero-padded
from N to N' = ceil(N/n)·n elements, so that dp position d owns elements
[d·N'/n, (d+1)·N'/n). P' = the padded bytes (P' - P < n elements per module).

=====  ==============================  ========================  =======================
stage  what is sharded over dp          collectives per step      bytes sent per rank (ring)
=====  ==============================  ========================  =======================
0      nothing (DDP)                    all-reduce of grads       2(n-1)/n · P
1      optimizer state                  reduce-scatter of grads,  2(n-1)/n · P'
                                        all-gather of params
2      + gradients                      reduce-scatter per        (m+1)(n-1)/n · P'
                                        micro-batch, all-gather
3      + parameters (FSDP)              per micro-batch: gather   3m(n-1)/n · P'
                                        fwd, gather bwd, r-s
=====  ==============================  ========================  =======================

(m micro-batches per step; with m = 1: ZeRO-1/2 move what DDP moves, ZeRO-3 1.5x.)

* ZeRO-1: gradients accumulate in full over the step's micro-batches, as in DDP; when a
  module's gradient is final it is reduce-scattered (async, overlapping the rest of the
  backward); each rank updates its shard of the flat parameter with its shard of the
  optimizer state, then all-gathers the updated shards into the full parameters.
  Megatron's distributed optimizer; composes with pp and tp.
* ZeRO-2: a module's gradient is reduce-scattered as soon as a micro-batch's
  contribution is accumulated, and summed into the rank's gradient shard; the full
  buffer is free again at once (so at most one module's full gradient is held). Update
  and all-gather as ZeRO-1. DeepSpeed's stage 2 (it reduces every micro-batch, which is
  why it does not combine with pipeline parallelism: here pp > 1 is refused).
* ZeRO-3 / FSDP: each rank keeps only its shard of every flat parameter. Before a
  module's forward and backward its parameters are all-gathered (async; the next
  module's gather is launched before the current one computes: prefetch), and released
  after use; gradients as ZeRO-2; the optimizer updates the shards in place and nothing
  is gathered after the step. Composes with tp (FSDP2 + TP); pp > 1 refused (DeepSpeed).

Memory per rank (the ledger, :mod:`pipeline_parallel.ledger`; S = optimizer slots:
1 for SGD, 2 for Adam): optimizer S·P'/n from stage 1 on (S·P for DDP); gradients P for
stages 0, 1, then P'/n + the largest module's gradient; parameters P for stages 0-2,
then P'/n + the modules gathered at once (the current one and the prefetched next one).

The update is elementwise (:mod:`pipeline_parallel.optim`), so updating shards gives the
same parameters as updating the whole; padding is zero in parameters and gradients and
stays zero. Sequence parallelism's LayerNorm gradients are partial over tp: summed over tp
after the step's last micro-batch, under ZeRO-2/3 after every micro-batch, before the
micro-batch's gradients are reduce-scattered (FSDP2 + TP + SP: torchtitan's 2D).
Checkpoints and fault recovery (:mod:`pipeline_parallel.resilient`) need zero_stage=0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from modeling import ZeroStage
from modeling.plan import check_zero_stage as _zero_rule
from vcluster.runtime.tracing import Kernel, is_meta

from .optim import Optimizer, OptimizerConfig

__all__ = ["ZERO_STAGES", "check_zero_stage", "FlatLayout", "ShardedState", "unshard_results",
           "in_dtype"]

ZERO_STAGES = ZeroStage.values()     # the one list: modeling.choices


def check_zero_stage(zero_stage, who: str, pp: int = 1) -> int:
    """``zero_stage`` as an int, or ConfigError (a ValueError) naming ``who``, the value and
    the rule: :func:`modeling.plan.check_zero_stage`, the one copy of the rule."""
    return int(_zero_rule(zero_stage, pp, owner=who))


@dataclass(frozen=True)
class FlatLayout:
    """One flat parameter: arrays of ``sizes`` elements, flattened and concatenated,
    zero-padded to ``padded`` = a multiple of ``n``; dp position d owns ``owned(d)``."""

    sizes: tuple[int, ...]
    n: int

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def padded(self) -> int:
        return -(-self.numel // self.n) * self.n

    @property
    def shard(self) -> int:
        return self.padded // self.n

    def owned(self, pos: int) -> slice:
        return slice(pos * self.shard, (pos + 1) * self.shard)

    def flatten(self, arrays):
        """(padded,) copy of ``arrays`` (numpy or shape-only)."""
        pad = self.padded - self.numel
        parts = [a.reshape(-1) for a in arrays]
        if pad:
            parts.append(np.zeros_like(arrays[0], shape=(pad,)))
        return np.concatenate(parts)

    def unflatten_into(self, flat, arrays) -> None:
        offset = 0
        for a in arrays:
            a[...] = flat[offset:offset + a.size].reshape(a.shape)
            offset += a.size


def in_dtype(a, dtype):
    """``a`` itself when ``dtype`` is None or already its dtype, else a cast copy: the
    array a gradient reduction in ``dtype`` sends (numpy, device or shape-only)."""
    return a if dtype is None or a.dtype == dtype else a.astype(dtype)


class _Ready:
    """A finished local 'collective' (dp of one rank: nothing to move)."""

    def __init__(self, value):
        self._value = value

    def wait(self, timeout_s=None):
        return self._value


def _poison(arrays) -> None:
    """Released parameters: NaN, so that a use before the next gather shows."""
    for a in arrays:
        if not is_meta(a):
            a.fill(np.nan)


class ShardedState:
    """One rank's ZeRO state (stage 1, 2 or 3) for the pipeline stages it trains.

    ``stages``: stage index -> the stage object (its ``params`` and ``grads``: one list
    of arrays per module, updated in place); ``ledger``: the rank's MemoryLedger. The
    executor calls :meth:`begin_step`, :meth:`grad_ready` (ZeRO-1: after a module's last
    micro-batch; ZeRO-2/3: after every micro-batch), :meth:`finish_grads`, :meth:`step`.
    ``reduce_dtype`` (None: the gradients' own): the dtype of the gradients'
    reduce-scatters — a module's flat gradient is cast to it before, and its reduced piece
    added into the gradient shard (the parameters' dtype) after, as FSDP's
    ``MixedPrecision(reduce_dtype=...)``.

    ``expert_axis`` (None: no experts apart): a mixture of experts' expert parameters (a
    stage's ``expert_mask``) are summed over the expert-data-parallel group (the dp/ep
    ranks holding the same experts, × cp), so a module that holds both is two flat
    parameters — its other arrays sharded over ``axis``, its experts' over
    ``expert_axis`` (``()`` or a group of one: not sharded) — as Megatron's distributed
    optimizer and Megatron-FSDP shard the experts' state over the expert-data-parallel
    ranks; ZeRO-3 gathers both before the module computes.
    """

    def __init__(self, dev, zero_stage: int, axis: str | None, stages: dict,
                 config: OptimizerConfig, ledger, reduce_dtype=None, expert_axis=None):
        self.dev, self.stage, self.axis, self.ledger = dev, zero_stage, axis, ledger
        self.reduce_dtype = None if reduce_dtype is None else np.dtype(reduce_dtype)
        group = dev.mesh.group(axis, dev.rank) if axis is not None else (dev.rank,)
        self.n, self.pos = len(group), group.index(dev.rank)
        self.stages = stages
        # unit -> (stage, module, the module's array indices or None: all)
        self._where: dict = {}
        # unit -> (the axis it is reduced and gathered over or None, its group's members,
        # this rank's position in it)
        self._group: dict = {}
        self._units_of: dict = {}        # (stage, module) -> its units
        self.units = []
        for s in sorted(stages):
            for i in range(len(stages[s].params)):
                for u, idx, ax in self._parts(stages[s], s, i, axis, expert_axis):
                    self.units.append(u)
                    self._units_of.setdefault((s, i), []).append(u)
                    self._where[u] = (s, i, idx)
                    members = tuple(dev.mesh.group(ax, dev.rank)) if ax is not None else \
                        (dev.rank,)
                    self._group[u] = (ax, members, members.index(dev.rank))
        self.layouts = {u: FlatLayout(tuple(int(a.size) for a in self._params(u)),
                                      len(self._group[u][1])) for u in self.units}
        self.full_bytes = {u: sum(a.nbytes for a in self._params(u)) for u in self.units}
        item = {u: self._params(u)[0].itemsize for u in self.units}
        self.shard_bytes = sum(self.layouts[u].shard * item[u] for u in self.units)
        like = {u: np.zeros_like(self._params(u)[0], shape=(self.layouts[u].shard,))
                for u in self.units}
        self.grad_shard = {u: like[u].copy() for u in self.units}
        self.param_shard = None
        if zero_stage == 3:
            for s, st in stages.items():
                if not hasattr(st, "param_hook"):
                    raise TypeError(f"zero_stage=3: stage {s} ({type(st).__name__}) has no "
                                    f"param_hook (use(i, next) / done(i) around each "
                                    f"module's forward and backward), which FSDP needs; "
                                    f"StageLayers and TransformerStage have one")
            self.param_shard = {u: self.layouts[u].flatten(self._params(u))[
                self.layouts[u].owned(self._pos(u))].copy() for u in self.units}
            for u in self.units:
                _poison(self._params(u))
            for s in stages:
                stages[s].param_hook = _Gatherer(self, s)
        self.opt = Optimizer(config, [like[u] for u in self.units])
        self._reductions: list = []
        total = sum(self.full_bytes.values())
        ledger.set("params", self.shard_bytes if zero_stage == 3 else total)
        ledger.set("grads", total if zero_stage == 1 else self.shard_bytes)
        ledger.set("optimizer", self.opt.state_bytes)

    def __repr__(self) -> str:
        return (f"ShardedState(zero_stage={self.stage}, n={self.n}, pos={self.pos}, "
                f"modules={len(self.units)}, shard_bytes={self.shard_bytes}"
                + ("" if self.reduce_dtype is None else f", reduce_dtype={self.reduce_dtype}")
                + ")")

    def _parts(self, stage, s: int, i: int, axis, expert_axis) -> list:
        """[(unit, array indices or None, axis)] of module i of stage s: one unit (s, i)
        over ``axis``, or — with ``expert_axis`` and experts in the module — its other
        arrays (s, i, "dense") over ``axis`` and its experts' (s, i, "expert") over
        ``expert_axis`` (None when that group is one rank)."""
        mask = stage.expert_mask(i) if expert_axis is not None and \
            hasattr(stage, "expert_mask") else ()
        if not any(mask):
            return [((s, i), None, axis)]
        if expert_axis == () or self.dev.mesh.axis_size(expert_axis) == 1:
            expert_axis = None
        dense = tuple(k for k, e in enumerate(mask) if not e)
        experts = tuple(k for k, e in enumerate(mask) if e)
        return ([((s, i, "dense"), dense, axis)] if dense else []) + \
            [((s, i, "expert"), experts, expert_axis)]

    def _of(self, u, which: str) -> list:
        s, i, idx = self._where[u]
        arrays = getattr(self.stages[s], which)[i]
        return arrays if idx is None else [arrays[k] for k in idx]

    def _params(self, u):
        return self._of(u, "params")

    def _grads(self, u):
        return self._of(u, "grads")

    def _module_units(self, stage: int, module: int) -> list:
        return self._units_of[(stage, module)]

    def _pos(self, u) -> int:
        return self._group[u][2]

    # --- collectives (a group of one: nothing to move) --------------------------------
    def _reduce_scatter(self, u, flat):
        axis = self._group[u][0]
        if axis is None:
            return _Ready(flat)
        return self.dev.reduce_scatter(flat, axis, async_op=True)

    def _all_gather(self, u, shard):
        axis = self._group[u][0]
        if axis is None:
            return _Ready(shard)
        return self.dev.all_gather(shard, axis, async_op=True)

    # --- the step -----------------------------------------------------------------------
    def begin_step(self) -> None:
        for g in self.grad_shard.values():
            g[...] = 0

    def grad_ready(self, stage: int, module: int) -> None:
        """Module ``module`` of ``stage`` has accumulated gradients: reduce-scatter them
        (async; each flat parameter over its group); ZeRO-2/3 then zero the full buffer
        for the next micro-batch."""
        for u in self._module_units(stage, module):
            grads, layout = self._grads(u), self.layouts[u]
            if self.stage >= 2:
                self.ledger.add("grads", self.full_bytes[u])     # the full buffer holds data
            flat = in_dtype(layout.flatten(grads), self.reduce_dtype)
            self._reductions.append((u, self._reduce_scatter(u, flat)))
            if self.stage >= 2:
                for g in grads:
                    g[...] = 0
                self.ledger.add("grads", -self.full_bytes[u])

    def finish_grads(self) -> None:
        """Wait for every reduce-scatter; sum the pieces into the gradient shards."""
        for u, work in self._reductions:
            piece = work.wait()
            if self._group[u][0] is None:
                piece = piece[self.layouts[u].owned(self._pos(u))]
            self.grad_shard[u] += piece
        self._reductions = []

    def step(self) -> None:
        """Update the shards; ZeRO-1/2: all-gather them into the full parameters."""
        units = self.units
        if self.stage == 3:
            shards = [self.param_shard[u] for u in units]
        else:
            shards = [self.layouts[u].flatten(self._params(u))[
                self.layouts[u].owned(self._pos(u))] for u in units]
        with self.dev.compute("optimizer (shard)", flops=0,
                              bytes=self.shard_bytes * self.opt.bytes_touched_per_param_byte,
                              kernel=Kernel.optimizer(sum(int(s.size) for s in shards),
                                                      self.opt.config.name)):
            self.opt.step(shards, [self.grad_shard[u] for u in units])
        if self.stage == 3:
            return
        works = [self._all_gather(u, s) for u, s in zip(units, shards)]
        for u, work in zip(units, works):
            self.layouts[u].unflatten_into(work.wait(), self._params(u))

    # --- results ----------------------------------------------------------------------
    def result(self, named_params: dict, named_grads: dict) -> dict:
        """What the host needs to rebuild the unsharded parameters (ZeRO-3) and the
        reduced gradients (every stage) from the shards of a dp group
        (:func:`unshard_results`): per module, where its arrays sit in the named dicts."""
        return {"n": self.n, "pos": self.pos, "modules": [{
            "group": self._group[u][1],
            "params_at": _paths(named_params, self._params(u)),
            "grads_at": _paths(named_grads, self._grads(u)),
            "shapes": [tuple(a.shape) for a in self._params(u)],
            "param_shard": None if self.param_shard is None else self.param_shard[u],
            "grad_shard": self.grad_shard[u]} for u in self.units]}


class _Gatherer:
    """ZeRO-3's parameter hook of one stage: ``use(i, next)`` before module i computes
    (waits for its all-gather, launching it if no prefetch did, and launches ``next``'s),
    ``done(i)`` after (releases module i's full parameters)."""

    def __init__(self, state: ShardedState, stage: int):
        self.state, self.s = state, stage
        self._pending: dict = {}

    def _launch(self, i: int) -> None:
        if i not in self._pending:
            units = self.state._module_units(self.s, i)
            for u in units:
                self.state.ledger.add("params", self.state.full_bytes[u])
            self._pending[i] = [(u, self.state._all_gather(u, self.state.param_shard[u]))
                                for u in units]

    def _with_borrowed(self, i: int) -> tuple:
        """Module i and the module whose parameters it also uses (``stage.borrows``: a
        tied head and its embedding's E), gathered and released together."""
        j = getattr(self.state.stages[self.s], "borrows", {}).get(i)
        return (i,) if j is None else (i, j)

    def use(self, i: int, nxt: int | None) -> None:
        for k in self._with_borrowed(i) + (() if nxt is None else self._with_borrowed(nxt)):
            self._launch(k)
        for k in self._with_borrowed(i):
            for u, work in self._pending.pop(k):
                self.state.layouts[u].unflatten_into(work.wait(), self.state._params(u))

    def done(self, i: int) -> None:
        for k in self._with_borrowed(i):
            for u in self.state._module_units(self.s, k):
                _poison(self.state._params(u))
                self.state.ledger.add("params", -self.state.full_bytes[u])


def _paths(named: dict, arrays) -> list:
    """(key, index or None) of each array in ``named`` (values: arrays or tuples)."""
    where = {}
    for key, value in named.items():
        if isinstance(value, tuple):
            for k, a in enumerate(value):
                where[id(a)] = (key, k)
        else:
            where[id(value)] = (key, None)
    return [where[id(a)] for a in arrays]


def unshard_results(mesh, dp_axis: str | None, results: list) -> list:
    """``train_program``'s per-rank results with the ZeRO shards put together: each
    rank's "grads" (and, for ZeRO-3, "params") become the full arrays of its dp group,
    joined in dp order with the padding cut. Results without ZeRO pass unchanged."""
    out = []
    for rank, res in enumerate(results):
        info = res.get("zero") if isinstance(res, dict) else None
        if not info:
            out.append(res)
            continue
        group = mesh.group(dp_axis, rank) if dp_axis is not None else (rank,)
        res = dict(res, params=dict(res["params"]), grads=dict(res["grads"]))
        for k, mod in enumerate(info["modules"]):
            # the module's own group (an MoE's experts: the expert-data-parallel ranks)
            peers = [results[r]["zero"]["modules"][k] for r in mod.get("group", group)]
            for what, at in (("param_shard", "params_at"), ("grad_shard", "grads_at")):
                if mod[what] is None:
                    continue
                flat = np.concatenate([p[what] for p in peers])
                offset = 0
                for (key, idx), shape in zip(mod[at], mod["shapes"]):
                    size = int(np.prod(shape, dtype=np.int64))
                    a = flat[offset:offset + size].reshape(shape)
                    offset += size
                    named = res["params" if what == "param_shard" else "grads"]
                    if idx is None:
                        named[key] = a
                    else:
                        named[key] = tuple(a if j == idx else v
                                           for j, v in enumerate(named[key]))
        out.append(res)
    return out

