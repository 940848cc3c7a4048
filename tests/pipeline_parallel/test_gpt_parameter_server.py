"""Parameter-server training of the GPT program (issue 28): the MLP's servers and
asynchronous bookkeeping with a whole-model GPT (or Llama) stage on each worker.
Synchronous: bit-identical to ``GPT.fit`` with dp = W on the ``shm`` all-reduce (the same
fold), equal to ``GPT.fit_reference`` within rtol 1e-9, atol 1e-12 in fp64; asynchronous:
replayed bit for bit, staleness within its bound; bytes per step: a worker sends and
receives P, server s W·P_s, emulated and traced."""

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import GPT, GPTConfig, ParallelConfig

from .gpt_data import token_data

pytestmark = pytest.mark.timeout(600)

BATCH = 8                           # sequences: splits over 1, 2, 4, 8 workers
CFG = GPTConfig(hidden=16, layers=2, heads=2, seq=8, vocab=32)
OPTIM = {"sgd": {"optimizer": "sgd", "lr": 0.05}, "adam": {"optimizer": "adam", "lr": 0.01}}


@pytest.fixture(scope="module")
def shm_cluster_of(cluster_of):
    """Data-parallel clusters on the ``shm`` all-reduce (the servers' fold)."""
    return lambda mesh: cluster_of(mesh, algorithm="shm")


def _without_key_bias(got, want):
    """b_qkv (3, h) less its key row, after Adam, with that row checked apart: the key
    bias's exact gradient is 0 (softmax over keys is shift-invariant), so its computed
    gradient is rounding noise (~1e-17) that Adam divides by eps = 1e-8 into steps of
    ~lr·1e-9, differently in any two summation orders: there |error| <= 1e-10."""
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-10)
    return got[[0, 2]], want[[0, 2]]


def _shares(run, tensors_bytes):
    servers = max(run.owner) + 1
    return [sum(n for n, s in zip(tensors_bytes, run.owner) if s == k) for k in range(servers)]


@pytest.mark.parametrize("arch, servers, workers",
                         [("gpt", 1, 1), ("gpt", 2, 2), ("gpt", 1, 4), ("gpt", 2, 8),
                          ("llama", 2, 2)])
def test_synchronous_equals_data_parallelism_and_the_reference(arch, servers, workers,
                                                               cluster_of, shm_cluster_of):
    cfg = CFG if arch == "gpt" else GPTConfig(hidden=16, layers=2, heads=2, seq=8, vocab=32,
                                              arch="llama", kv_heads=1, ffn_hidden=24)
    gpt, (tokens, targets) = GPT(cfg, seed=3), token_data(cfg, BATCH, seed=1)
    ps_cluster = cluster_of(Mesh((servers + workers,), ("ps",)))
    ddp_cluster = shm_cluster_of(Mesh((workers,), ("dp",)))
    parallel = ParallelConfig(BATCH, micro_batch=BATCH // workers, dp=workers)
    for opt in ("sgd", "adam"):
        run = gpt.fit_parameter_server(ps_cluster, tokens, targets, steps=3, servers=servers,
                                       **OPTIM[opt])
        ddp = gpt.fit(ddp_cluster, tokens, targets, steps=3, parallel=parallel, **OPTIM[opt])
        ref = gpt.fit_reference(tokens, targets, steps=3, **OPTIM[opt])
        assert np.array_equal(run.losses, ddp.losses), opt
        assert set(run.params) == set(ref.params) == set(gpt.param_shapes())
        for name, want in ref.params.items():
            assert np.array_equal(run.params[name], ddp.params[name]), (opt, name)
            got = run.params[name]
            if opt == "adam" and name.endswith("b_qkv"):
                got, want = _without_key_bias(got, want)
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12,
                                       err_msg=f"{opt} {name}")
        np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-9, atol=1e-12)
        assert run.losses[-1] < run.losses[0]
    # the closed forms of the bytes per step: a worker P each way, server s W·P_s
    tensors = [a.nbytes for a in gpt.init_params().values()]
    P, share = sum(tensors), _shares(run, tensors)
    assert sum(share) == P and min(share) > 0
    t = run.traffic
    for role, rank, sent, received in zip(t["role"], t["rank"], t["bytes_sent_per_step"],
                                          t["bytes_received_per_step"]):
        want = P if role == "worker" else workers * share[rank]
        assert (sent, received) == (want, want), (role, rank)


def test_staleness_zero_is_the_synchronous_run(cluster_of):
    gpt, (tokens, targets) = GPT(CFG, seed=2), token_data(CFG, BATCH)
    cluster = cluster_of(Mesh((2 + 4,), ("ps",)))
    sync = gpt.fit_parameter_server(cluster, tokens, targets, steps=2, servers=2, **OPTIM["adam"])
    again = gpt.fit_parameter_server(cluster, tokens, targets, steps=2, servers=2, staleness=0,
                                     **OPTIM["adam"])
    assert np.array_equal(sync.losses, again.losses)
    assert all(np.array_equal(sync.params[n], again.params[n]) for n in sync.params)
    assert sync.events is None and sync.staleness is None


@pytest.mark.parametrize("staleness", [1, 2])
def test_asynchronous_runs_replay_exactly_within_the_staleness_bound(staleness, cluster_of):
    gpt, (tokens, targets) = GPT(CFG, seed=2), token_data(CFG, BATCH)
    cluster = cluster_of(Mesh((2 + 4,), ("ps",)))
    steps = 4
    run = gpt.fit_parameter_server(cluster, tokens, targets, steps=steps, servers=2,
                                   staleness=staleness, **OPTIM["sgd"])
    again = gpt.fit_parameter_server(cluster, tokens, targets, steps=steps, servers=2,
                                     staleness=staleness, replay=run.events, **OPTIM["sgd"])
    assert np.array_equal(run.losses, again.losses)
    assert all(np.array_equal(run.params[n], again.params[n]) for n in run.params)
    seen = run.staleness
    assert len(seen) == 2 * 4 * steps                 # every (server, worker, step) applied
    assert seen["staleness"].between(0, staleness).all()
    for events in run.events:                         # a server's send precedes its apply
        order = {e: i for i, e in enumerate(events)}
        assert all(order[("send", w, t)] < order[("apply", w, t)]
                   for w in range(4) for t in range(steps))
    P = sum(a.nbytes for a in gpt.init_params().values())
    workers = run.traffic[run.traffic["role"] == "worker"]
    assert (workers["bytes_sent_per_step"] == P).all()
    assert (workers["bytes_received_per_step"] == P).all()
    assert np.isfinite(run.losses).all()


@pytest.mark.parametrize("servers, workers", [(1, 2), (2, 4), (3, 8)])
def test_traced_program_moves_the_closed_forms(servers, workers):
    """The tracer runs the same program on shape-only arrays: per step server s sends
    and receives W·P_s, a worker P."""
    from pipeline_parallel.parameter_server import device_args, parameter_server_program
    from vcluster.runtime.tracing import MetaArray, TraceRecv, TraceSend, trace_program
    gpt, steps, mesh = GPT(CFG, seed=0), 2, Mesh((servers + workers,), ("ps",))
    params = {n: MetaArray(s, CFG.dtype) for n, s in gpt.param_shapes().items()}
    job = gpt.parameter_server_job(mesh, servers, BATCH, steps, params=params)
    data = MetaArray((BATCH, CFG.seq), np.int64)
    traces = trace_program(mesh, parameter_server_program, device_args(job, data, data))
    tensors = [a.nbytes for a in params.values()]
    P = sum(tensors)
    share = [sum(n for n, s in zip(tensors, job.owner) if s == k) for k in range(servers)]
    for t in traces:
        sent = sum(op.nbytes for op in t.ops if isinstance(op, TraceSend))
        received = sum(op.nbytes for op in t.ops if isinstance(op, TraceRecv))
        want = workers * share[t.rank] if t.rank < servers else P
        assert (sent, received) == (steps * want, steps * want), t.rank


def test_bad_setups_are_named(cluster_of):
    gpt, (tokens, targets) = GPT(CFG, seed=1), token_data(CFG, BATCH)
    cluster = cluster_of(Mesh((3,), ("ps",)))
    with pytest.raises(ValueError, match="staleness must be an int >= 0, got -1"):
        gpt.fit_parameter_server(cluster, tokens, targets, steps=1, staleness=-1)
    with pytest.raises(ValueError, match="the batch of 7 rows does not split evenly over 2"):
        gpt.fit_parameter_server(cluster, tokens[:7], targets[:7], steps=1)
    with pytest.raises(ValueError, match="replay= repeats an asynchronous run"):
        gpt.fit_parameter_server(cluster, tokens, targets, steps=1, replay=((),))
    n = len(gpt.param_shapes())
    big = Mesh((n + 2,), ("ps",))
    with pytest.raises(ValueError, match=f"servers={n + 1} is more than the {n} parameter "
                                         f"tensors"):
        gpt.parameter_server_job(big, n + 1, BATCH)
    with pytest.raises(ValueError, match="the mesh must have one axis"):
        gpt.parameter_server_job(Mesh((2, 2), ("dp", "pp")), 1, BATCH)
    with pytest.raises(ValueError, match="the mesh's one axis is called 'tp'"):
        gpt.parameter_server_job(Mesh((3,), ("tp",)), 1, BATCH)
    moe = GPT(GPTConfig(hidden=16, layers=2, heads=2, seq=8, vocab=32, arch="llama",
                        experts=2))
    with pytest.raises(ValueError, match=r"GPT.fit_parameter_server: experts=2 is not "
                                         r"supported .* experts=0"):
        moe.parameter_server_job(Mesh((3,), ("ps",)), 1, BATCH)
