"""Parameter-server training: ``servers`` ranks hold the parameters, ``workers`` ranks
compute gradients on their slices of the batch, synchronously or asynchronously. The
model is any one-device stage (:class:`~pipeline_parallel.layers.StageLayers`' interface):
the MLP's dense layers (:meth:`MLP.fit_parameter_server <pipeline_parallel.mlp.MLP.
fit_parameter_server>`) or a whole GPT / Llama (:meth:`GPT.fit_parameter_server
<pipeline_parallel.gpt.GPT.fit_parameter_server>`); the job's ``worker_stage`` builds it,
and everything else here — servers, traffic, the asynchronous bookkeeping — is the same.

The first ``S`` ranks of the cluster are servers, the next ``W`` workers (the mesh has one
axis of S + W devices). Each parameter tensor (an MLP layer's W or b, a GPT's named
tensors) lives on one server, assigned greedily, largest first, to the server holding the
fewest bytes (:func:`assign_tensors`). One step:

1. every server sends every worker its tensors, flattened into one message;
2. every worker runs forward and backward over its ``B / W`` rows (the loss is
   normalised by the global batch B, as in data parallelism), and sends every server the
   gradients of that server's tensors, flattened;
3. every server sums the W gradients in worker order, ``((g_0 + g_1) + g_2) + ...`` — the
   fold of the ``shm`` all-reduce — and applies the optimizer to its tensors.

So the result is bit-identical to all-reduce data parallelism over W replicas with the
same fold (``VirtualCluster(algorithm="shm")``), and equal to single-process training
within rounding. Bytes per step, with P the parameter bytes and P_s server s's share: a
worker sends P and receives P; server s sends and receives W·P_s — the server's link
carries W times what a ring all-reduce puts on each member's (2(W−1)/W·P), which is why
it becomes the bottleneck as workers are added.

**Asynchronous** (``staleness`` s >= 1, stale-synchronous parallel): a server applies each
worker's gradient on its own as it arrives (an optimizer step on that worker's share),
and sends a worker the parameters for its step t as soon as every worker has pushed at
least t − s steps — so the fastest worker is at most s steps ahead of the slowest, and the
gradient of step t was computed on parameters that miss at most s steps of the others'.
That is the staleness reported for every (worker, step): t − (steps every worker had
pushed when the parameters were sent), at most s. Arrival order is the machine's, so
each server records its events (``("send" | "apply", worker, step)``); passing the
record back (``replay``) makes the servers follow it and reproduces the run bit for bit.
``staleness=0`` is the synchronous algorithm above.

Host side: :func:`make_job` checks a setup (one mesh axis, servers, workers, the batch
split, staleness, replay) and :func:`fit_parameter_server` runs a job and gathers its
:class:`ParameterServerFit`; the models' ``fit_parameter_server`` methods are these two
calls around their own worker stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from mesh.arguments import as_int

from .functional import loss_and_grad
from .layers import LayerSpec, StageLayers
from .optim import Optimizer, OptimizerConfig

__all__ = ["ParameterServerJob", "ParameterServerFit", "assign_tensors", "make_job",
           "device_args", "assemble", "fit_parameter_server", "parameter_server_program",
           "mlp_worker_stage", "layer_specs_of"]


def assign_tensors(sizes_bytes, servers: int) -> tuple[int, ...]:
    """The server of each tensor: largest first, each to the server with the fewest bytes
    so far (ties: the lowest server). Every server gets at least one tensor."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an int >= 1, got {servers!r}")
    if servers > len(sizes_bytes):
        raise ValueError(f"servers={servers} is more than the {len(sizes_bytes)} parameter "
                         f"tensors to shard (each tensor lives on one server): use at most "
                         f"{len(sizes_bytes)}")
    load = [0] * servers
    owner = [0] * len(sizes_bytes)
    for i in sorted(range(len(sizes_bytes)), key=lambda i: (-sizes_bytes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += sizes_bytes[i]
    return tuple(owner)


@dataclass(frozen=True)
class ParameterServerJob:
    """What every rank needs (the same object on every rank)."""

    tensors: tuple           # every parameter tensor's initial value, in the order of the
    #                          worker stage's params (flattened: module by module)
    worker_stage: object     # (dev, job) -> the worker's one-device stage (StageLayers'
    #                          interface; its own loss_and_grad, or ``loss`` is used)
    loss: str
    optimizer: OptimizerConfig
    steps: int
    global_batch: int
    servers: int
    workers: int
    owner: tuple             # server of each tensor of ``tensors``
    staleness: int = 0       # 0: synchronous; s >= 1: asynchronous, bounded by s steps
    replay: tuple | None = None    # per server, the events of a recorded run to follow
    timeout_s: float = 60.0  # longest wait of an asynchronous server for any push
    first_worker: int | None = None   # rank of worker 0 (default: right after the servers;
                                      # later: ranks between are idle, e.g. to give the
                                      # servers a node of their own in a simulation)

    def worker_rank(self, w: int) -> int:
        return (self.servers if self.first_worker is None else self.first_worker) + w

    def owned(self, server: int) -> list[int]:
        return [i for i, s in enumerate(self.owner) if s == server]


def _flat(arrays):
    return np.concatenate([a.reshape(-1) for a in arrays])


def _unflatten_into(flat, arrays) -> None:
    offset = 0
    for a in arrays:
        a[...] = flat[offset:offset + a.size].reshape(a.shape)
        offset += a.size


def _server(dev, job: ParameterServerJob) -> dict:
    s = dev.rank
    mine = job.owned(s)
    params = [job.tensors[i].copy() for i in mine]       # device arrays (they arrived so)
    grads = [np.zeros_like(p) for p in params]
    opt = Optimizer(job.optimizer, params)
    for step in range(job.steps):
        flat = _flat(params)
        for w in range(job.workers):
            dev.send(flat, job.worker_rank(w), tag=2 * step)
        total = None
        for w in range(job.workers):                       # worker order: a fixed fold
            g = dev.recv(job.worker_rank(w), tag=2 * step + 1)
            total = g if total is None else total + g
        _unflatten_into(total, grads)
        with dev.compute("optimizer", flops=0,
                         bytes=sum(p.nbytes for p in params) * opt.bytes_touched_per_param_byte):
            opt.step(params, grads)
    return {"rank": dev.rank, "role": "server", "tensors": mine,
            "params": dict(zip(mine, params)), "losses": None}


def _async_server(dev, job: ParameterServerJob) -> dict:
    """One server of the asynchronous mode (module docstring): events in arrival order,
    or in the order of ``job.replay[server]``."""
    s, W, T = dev.rank, job.workers, job.steps
    mine = job.owned(s)
    params = [job.tensors[i].copy() for i in mine]       # device arrays (they arrived so)
    grads = [np.zeros_like(p) for p in params]
    opt = Optimizer(job.optimizer, params)
    pushed = [0] * W               # steps each worker has pushed (and this server applied)
    sent = [0] * W                 # steps each worker has been sent parameters for
    sent_floor = {}                # (worker, step) -> min(pushed) when sent
    events, staleness = [], []
    script = iter(job.replay[s]) if job.replay is not None else None

    def send(w):
        t = sent[w]
        dev.send(_flat(params), job.worker_rank(w), tag=2 * t)
        sent_floor[(w, t)] = min(pushed)
        sent[w] += 1
        events.append(("send", w, t))

    def apply(w):
        t = pushed[w]
        _unflatten_into(dev.recv(job.worker_rank(w), tag=2 * t + 1), grads)
        with dev.compute("optimizer", flops=0,
                         bytes=sum(p.nbytes for p in params) * opt.bytes_touched_per_param_byte):
            opt.step(params, grads)
        pushed[w] += 1
        staleness.append((w, t, t - sent_floor[(w, t)]))
        events.append(("apply", w, t))

    def allowed(w):
        return sent[w] == pushed[w] < T and sent[w] - job.staleness <= min(pushed)

    while min(pushed) < T:
        if script is not None:
            kind, w, t = next(script)
            (send if kind == "send" else apply)(w)
            continue
        for w in range(W):
            if allowed(w):
                send(w)
        apply(_next_push(dev, job, pushed, sent))
    return {"rank": dev.rank, "role": "server", "tensors": mine,
            "params": dict(zip(mine, params)), "losses": None, "events": events,
            "staleness": staleness}


def _next_push(dev, job: ParameterServerJob, pushed, sent) -> int:
    """The first worker (in arrival order, polled) whose next gradient has arrived."""
    waiting = [w for w in range(job.workers) if sent[w] > pushed[w]]
    deadline = time.monotonic() + job.timeout_s
    nap = 1e-5
    while True:
        for w in waiting:
            if dev.iprobe(job.worker_rank(w), tag=2 * pushed[w] + 1):
                return w
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"parameter server rank {dev.rank} waited {job.timeout_s:g} s for a gradient "
                f"from workers {[job.worker_rank(w) for w in waiting]} (their steps "
                f"{[pushed[w] for w in waiting]})")
        time.sleep(nap)
        nap = min(2 * nap, 1e-3)


def _worker(dev, job: ParameterServerJob, X, Y) -> dict:
    S = job.servers
    stage = job.worker_stage(dev, job)
    tensors = [a for group in stage.params for a in group]
    grads = [a for group in stage.grads for a in group]
    by_server = [job.owned(s) for s in range(S)]
    own_loss = getattr(stage, "loss_and_grad", None)
    losses = []
    for step in range(job.steps):
        for s in range(S):
            _unflatten_into(dev.recv(s, tag=2 * step), [tensors[i] for i in by_server[s]])
        stage.zero_grads()
        with dev.compute("forward, loss, backward"):
            out = stage.forward(dev, 0, X)
            loss, dy = own_loss(dev, 0, out, Y, job.global_batch) if own_loss is not None \
                else loss_and_grad(job.loss, out, Y, job.global_batch)
            stage.backward_input(dev, 0, dy, need_input_grad=False)
            stage.backward_weight(dev, 0)
        for s in range(S):
            dev.send(_flat([grads[i] for i in by_server[s]]), s, tag=2 * step + 1)
        losses.append(loss)
    return {"rank": dev.rank, "role": "worker", "losses": losses, "params": None}


def parameter_server_program(dev, job: ParameterServerJob, X, Y):
    """The per-device program: rank < servers serves, the workers' ranks work on ``X``,
    ``Y`` (this worker's rows; None elsewhere), any other rank idles."""
    if dev.rank < job.servers:
        return _server(dev, job) if job.staleness == 0 else _async_server(dev, job)
    if job.worker_rank(0) <= dev.rank < job.worker_rank(job.workers):
        return _worker(dev, job, X, Y)
    return {"rank": dev.rank, "role": "idle", "losses": None, "params": None}


def layer_specs_of(mlp) -> tuple:
    """One stage holding every layer of ``mlp`` (no tensor parallelism)."""
    return tuple(LayerSpec(l, mlp.sizes[l], mlp.sizes[l + 1], "dense", mlp._act(l))
                 for l in range(mlp.n_layers))


def mlp_worker_stage(mlp):
    """The MLP's ``worker_stage``: its dense layers on one device, the job's tensors
    being (W_0, b_0, W_1, b_1, ...)."""
    return partial(_mlp_stage, layer_specs_of(mlp))


def _mlp_stage(specs, dev, job: ParameterServerJob) -> StageLayers:
    t = job.tensors
    return StageLayers(list(specs), [(t[2 * i], t[2 * i + 1]) for i in range(len(specs))])


# --- host side: the setup's checks, the run, the result ----------------------------------
def make_job(caller: str, mesh, tensors, worker_stage, *, loss: str, optimizer, steps,
             batch: int, servers, staleness, replay, timeout_s: float) -> ParameterServerJob:
    """The job of a run on ``mesh``, its setup checked (``caller`` names the method in the
    messages): one mesh axis, ``servers`` (:func:`assign_tensors`) leaving >= 1 worker,
    ``batch`` rows splitting evenly over the workers, ``staleness`` >= 0, and ``replay``
    (only with staleness >= 1) holding the events of ``servers`` servers."""
    if len(mesh.axes) != 1:
        raise ValueError(f"{caller}: the mesh must have one axis (servers + workers), got "
                         f"{mesh}")
    owner = assign_tensors([a.nbytes for a in tensors], servers)
    workers = mesh.size - servers
    if workers < 1:
        raise ValueError(f"{caller}: servers={servers} leaves no worker on a mesh of "
                         f"{mesh.size} devices (need servers < {mesh.size})")
    if batch % workers:
        raise ValueError(f"{caller}: the batch of {batch} rows does not split evenly over "
                         f"{workers} workers")
    staleness = as_int(staleness, "staleness", 0)
    if replay is not None:
        if staleness == 0:
            raise ValueError(f"{caller}: replay= repeats an asynchronous run (staleness >= "
                             f"1); a synchronous run is deterministic")
        replay = tuple(tuple(tuple(e) for e in events) for events in replay)
        if len(replay) != servers:
            raise ValueError(f"{caller}: replay holds the events of {len(replay)} servers, "
                             f"this run has {servers}")
    return ParameterServerJob(
        tensors=tuple(tensors), worker_stage=worker_stage, loss=loss,
        optimizer=optimizer, steps=as_int(steps, "steps", 1), global_batch=batch,
        servers=servers, workers=workers, owner=owner, staleness=staleness, replay=replay,
        timeout_s=timeout_s)


def device_args(job: ParameterServerJob, X, Y) -> list[tuple]:
    """(job, X rows, Y rows) per rank: the servers get no data, worker w its ``B / W``
    consecutive rows."""
    rows = job.global_batch // job.workers
    return [(job, None, None)] * job.servers + [
        (job, X[w * rows:(w + 1) * rows], Y[w * rows:(w + 1) * rows])
        for w in range(job.workers)]


def assemble(job: ParameterServerJob, results) -> tuple[np.ndarray, list]:
    """(per-step losses: the workers' shares summed in worker order, every tensor in the
    job's order, read from its server) of the program's per-rank ``results``."""
    results = list(results)
    workers = results[job.worker_rank(0):job.worker_rank(job.workers)]
    losses = np.sum([r["losses"] for r in workers], axis=0)
    flat = {}
    for r in results[:job.servers]:
        flat.update(r["params"])
    return np.asarray(losses), [flat[i] for i in range(len(job.owner))]


@dataclass(frozen=True)
class ParameterServerFit:
    """What ``fit_parameter_server`` returns: per-step losses (the sum of the workers'
    shares, each on the parameters it received), the final parameters (read from the
    servers; the MLP's (W, b) per layer, a GPT's arrays by name), the server of each
    tensor, the bytes each rank sent and received per step (``traffic``: a DataFrame
    with ``rank``, ``role``, ``bytes_sent_per_step``, ``bytes_received_per_step``);
    asynchronous runs add each server's recorded ``events`` (pass them back as
    ``replay``) and the ``staleness`` of every applied gradient (a DataFrame: ``server``,
    ``worker``, ``step``, ``staleness``)."""

    losses: np.ndarray
    params: object
    owner: tuple
    traffic: object = None
    events: tuple | None = None
    staleness: object = None

    def __repr__(self) -> str:
        return (f"ParameterServerFit(losses={np.array2string(self.losses, precision=6)}, "
                f"tensors={len(self.owner)}, servers={max(self.owner) + 1})")


def fit_parameter_server(cluster, job: ParameterServerJob, X, Y,
                         params_of) -> ParameterServerFit:
    """Run ``job`` on ``cluster`` with the batch ``X``, ``Y`` and gather its result
    (``params_of``: the job's tensors, in order, -> the result's ``params``)."""
    import pandas as pd
    cluster.reset_stats()
    results = cluster.run(parameter_server_program, device_args(job, X, Y))
    stats = cluster.stats()
    losses, tensors = assemble(job, results)
    S = job.servers
    traffic = pd.DataFrame({
        "rank": stats["rank"], "role": ["server"] * S + ["worker"] * job.workers,
        "bytes_sent_per_step": stats["bytes_sent"] / job.steps,
        "bytes_received_per_step": stats["bytes_received"] / job.steps})
    events = seen = None
    if job.staleness:
        events = tuple(tuple(r["events"]) for r in results[:S])
        seen = pd.DataFrame([(r["rank"], w, t, st) for r in results[:S]
                             for w, t, st in r["staleness"]],
                            columns=["server", "worker", "step", "staleness"])
    return ParameterServerFit(losses, params_of(tensors), job.owner, traffic, events, seen)
