"""The tracer runs the same per-device programs on shape-only arrays, and the traffic it
predicts equals what the emulator moves, call for call, on every rank."""

import dataclasses

import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.executor import TrainJob, train_program
from sharding import TensorSharding as TS, shard
from tensor_parallel import (FeedForward, FeedForwardSharding, MatMul, MatMulSharding)
from vcluster import VirtualCluster
from vcluster.runtime.tracing import (MetaArray, TraceCompute, TraceError, comm_signature,
                                      meta_like, trace_comm_signature, trace_program)

pytestmark = pytest.mark.timeout(300)


def _check_same_traffic(mesh, fn, real_args, meta_args, cluster):
    cluster.reset_stats()
    cluster.run(fn, real_args)
    events = cluster.trace()
    traces = trace_program(mesh, fn, meta_args)
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    # the FLOPs declared are the same too
    flops = cluster.stats()["flops"].tolist()
    assert [sum(op.flops for op in t.ops if isinstance(op, TraceCompute)) for t in traces] == flops
    return traces


def _metas(args_per_rank):
    return [tuple(meta_like(a) if isinstance(a, np.ndarray) else a for a in args)
            for args in args_per_rank]


@pytest.fixture(scope="module")
def cluster24():
    with VirtualCluster(Mesh((2, 4), ("dp", "tp")), timeout_s=30) as cluster:
        yield cluster


def _matmul_fwd_bwd(dev, op, a, b, dc):
    c = op.forward_local(dev, a, b)
    da, db = op.backward_local(dev, a, b, dc)
    return c, da, db


@pytest.mark.parametrize("a, b, c", [
    (TS(None, "tp"), TS("tp", None), TS(None, None)),
    (TS(None, "tp"), TS("dp", None), TS(None, "tp")),
    (TS("dp", "tp"), TS(None, None), TS("dp", None)),
    (TS("dp", "tp"), TS("tp", "dp"), TS(None, None, partial="tp")),
])
def test_matmul_trace_traffic_equals_emulator(cluster24, a, b, c):
    mesh = cluster24.mesh
    rng = np.random.default_rng(0)
    A, B, dC = rng.standard_normal((8, 16)), rng.standard_normal((16, 8)), rng.standard_normal((8, 8))
    op = MatMul(MatMulSharding(a, b, c))
    pieces = [shard(A, a, mesh), shard(B, b, mesh), shard(dC, op.dc_layout, mesh)]
    real = [(op, pieces[0][r], pieces[1][r], pieces[2][r]) for r in range(mesh.size)]
    _check_same_traffic(mesh, _matmul_fwd_bwd, real, _metas(real), cluster24)


def _ffn_fwd_bwd(dev, op, x, w1, b1, w2, b2, dy):
    op.forward_local(dev, x, w1, b1, w2, b2)
    return op.backward_local(dev, x, w1, b1, w2, b2, dy)


@pytest.mark.parametrize("policy, dp", [("Megatron", None), ("SequenceParallel", "dp"),
                                        ("GSPMD", "dp"), ("Unsharded", "dp")])
def test_ffn_trace_traffic_equals_emulator(cluster24, policy, dp):
    mesh = cluster24.mesh
    op = FeedForward(FeedForwardSharding(policy, tp="tp", dp=dp), activation="gelu")
    lay = op.layouts
    rng = np.random.default_rng(1)
    shapes = {"x": (4, 8, 16), "w1": (16, 32), "b1": (32,), "w2": (32, 16), "b2": (16,),
              "dy": (4, 8, 16)}
    arrays = {k: rng.standard_normal(s) for k, s in shapes.items()}
    per = {k: shard(v, lay[k], mesh) for k, v in arrays.items()}
    names = ("x", "w1", "b1", "w2", "b2", "dy")
    real = [(op,) + tuple(per[k][r] for k in names) for r in range(mesh.size)]
    _check_same_traffic(mesh, _ffn_fwd_bwd, real, _metas(real), cluster24)


@pytest.mark.parametrize("shape, axes, schedule", [((4,), ("pp",), "1f1b"),
                                                   ((2, 2, 2), ("dp", "pp", "tp"), "zero_bubble")])
def test_pipelined_training_trace_traffic_equals_emulator(shape, axes, schedule):
    from pipeline_parallel.plan import plan_training
    mesh = Mesh(shape, axes)
    mlp = MLP([8, 16, 16, 16, 8], seed=0)
    rng = np.random.default_rng(2)
    X, Y = rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    plan = plan_training(mlp, mesh, 16, 4, schedule, None)
    from pipeline_parallel.optim import OptimizerConfig
    job = TrainJob(params=tuple(mlp.init_params()), specs=plan.stage_specs,
                   actions=plan.actions, loss="mse", optimizer=OptimizerConfig(),
                   steps=2, microbatches=4, global_batch=16, dp_axis=plan.dp_axis,
                   tp_axis=plan.tp_axis, bucket_bytes=256)
    real = plan.device_args(job, X, Y)
    # the traced job carries shape-only parameters
    meta_job = dataclasses.replace(job, params=tuple((meta_like(w), meta_like(b))
                                                     for w, b in job.params))
    metas = [(meta_job,) + tuple(None if a is None else meta_like(a) for a in args[1:])
             for args in real]
    with VirtualCluster(mesh, timeout_s=30) as cluster:
        _check_same_traffic(mesh, train_program, real, metas, cluster)


def test_symmetric_tracing_of_one_stage_representative():
    """Only one rank per pipeline stage is traced; tp/dp collectives complete alone."""
    mesh = Mesh((2, 4), ("dp", "tp"))
    op = MatMul(MatMulSharding(TS(None, "tp"), TS("tp", None), TS(None, None)))

    def prog(dev, a, b):
        return op.forward_local(dev, a, b)

    metas = [(MetaArray((8, 4)), MetaArray((4, 8)))] * 8
    full = {t.rank: t for t in trace_program(mesh, prog, metas)}
    (one,) = trace_program(mesh, prog, metas, ranks=[0])
    assert one.ops == full[0].ops


def test_untraced_peer_is_a_clear_error():
    mesh = Mesh((2,), ("pp",))

    def prog(dev):
        if dev.rank == 1:
            dev.recv(0, tag=3)

    with pytest.raises(TraceError, match="recv from untraced rank 0"):
        trace_program(mesh, prog, ranks=[1])


def test_value_dependent_control_flow_is_a_clear_error():
    def prog(dev, x):
        if x.sum() > 0:
            return x

    with pytest.raises(TraceError, match="branched on array values"):
        trace_program(Mesh((1,), ("x",)), prog, [(MetaArray((3,)),)])
