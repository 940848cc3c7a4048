"""A long step's trace stitched from a short step's traced actions equals the long step
traced in full, op for op, for every schedule and with data and tensor parallelism."""


import numpy as np
import pytest

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.executor import TrainJob, train_program
from pipeline_parallel.optim import OptimizerConfig
from pipeline_parallel.plan import plan_training
from vcluster.planner.stitch import cut_templates, stitch
from vcluster.runtime.tracing import meta_like, trace_program

pytestmark = pytest.mark.timeout(300)


def _traces(mlp, mesh, m, schedule, v, rows):
    plan = plan_training(mlp, mesh, rows * m * plan_dp(mesh), m, schedule, v)
    job = TrainJob(params=tuple((meta_like(w), meta_like(b)) for w, b in mlp.init_params()),
                   specs=plan.stage_specs, actions=plan.actions, loss="mse",
                   optimizer=OptimizerConfig(), steps=1, microbatches=m,
                   global_batch=rows * m * plan_dp(mesh), dp_axis=plan.dp_axis,
                   tp_axis=plan.tp_axis, bucket_bytes=512)
    X = np.zeros((job.global_batch, mlp.sizes[0]))
    Y = np.zeros((job.global_batch, mlp.sizes[-1]))
    args = [(job,) + tuple(None if a is None else meta_like(a) for a in rest)
            for job_, *rest in plan.device_args(job, X, Y)]
    ranks = list(mesh.group("pp", 0))
    return plan, {t.rank: t for t in trace_program(mesh, train_program, args, ranks=ranks)}


def plan_dp(mesh):
    return mesh.shape["dp"] if "dp" in mesh.axes else 1


@pytest.mark.parametrize("shape, axes", [((2,), ("pp",)), ((4,), ("pp",)),
                                         ((2, 2, 2), ("dp", "pp", "tp"))])
@pytest.mark.parametrize("schedule, short, long, v", [
    ("gpipe", 2, 5, None), ("1f1b", 2, 9, None), ("zero_bubble", 2, 7, None),
    ("interleaved_1f1b", None, None, 2)])
def test_stitched_equals_traced(shape, axes, schedule, short, long, v):
    mesh = Mesh(shape, axes)
    p = mesh.shape["pp"]
    if schedule == "interleaved_1f1b":
        short, long = p, 3 * p
    mlp = MLP([8] + [16] * 7 + [8], seed=0)
    plan_s, short_traces = _traces(mlp, mesh, short, schedule, v, rows=2)
    plan_l, long_traces = _traces(mlp, mesh, long, schedule, v, rows=2)
    pp = mesh.group("pp", 0)
    S = len(plan_l.stage_specs)
    for pos, rank in enumerate(pp):
        t = cut_templates(short_traces[rank], plan_s.actions[pos], S, short)
        stitched = stitch(t, rank, plan_l.actions[pos], pp, S, long)
        assert stitched.ops == long_traces[rank].ops, (rank, schedule)
