"""The built-in workloads of ``vcluster bench predict`` (:mod:`vcluster.cli.bench_predict`):
each a per-device program, its real arguments and their shape-only twins.

The workloads (``WORKLOADS``; ``--tiny`` shrinks each one to a smoke test, not a
benchmark):

* ``<collective>-<size>``: back-to-back all_reduce / all_gather / reduce_scatter of 1 MiB
  and 16 MiB (nccl-tests sizes: all_gather's is its output) on 8 devices, resident
  inputs; ``max(MIN_CALLS, SWEEP_BYTES / size)`` calls per run (20 and 5), so that the
  ~2 ms it takes 8 devices on 2 cores to get going stays a small part of every run;
* ``matmul``: MatMul, MatchedInnerSharding (A [R, S(tp)], B [S(tp), R]), forward,
  2048 x 1024 x 2048 float32 on a 1 x 8 mesh;
* ``ffn``: FeedForward, Megatron (tp=4, dp=2), forward then backward, x (8, 256, 512),
  d_ff 2048, float32;
* ``mlp``: MLP([1024] * 9).fit, 1F1B on 4 pipeline ranks, one step of 8 micro-batches of
  256 rows, float64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["WORKLOADS", "BenchWorkload", "build_bench_workload", "metas"]

SWEEP_BYTES, MIN_CALLS = 20 * (1 << 20), 5   # collectives per run of a sweep workload
_SWEEP = tuple(f"{op}-{size}" for op in ("all_reduce", "all_gather", "reduce_scatter")
               for size in ("1MiB", "16MiB"))
WORKLOADS = _SWEEP + ("matmul", "ffn", "mlp")
_MIB = 1 << 20


@dataclass(frozen=True)
class BenchWorkload:
    """A per-device program, its real arguments and their shape-only twins."""

    name: str
    mesh: object
    program: Callable
    args: list                          # per rank, real arrays
    meta_args: list                     # per rank, MetaArrays (what the tracer runs on)
    dtype: str


def _meta(x):
    # lazy: keeps vcluster --help fast
    from vcluster.runtime.tracing import meta_like
    return meta_like(x) if isinstance(x, np.ndarray) else x


def metas(args: list) -> list:
    return [tuple(_meta(a) for a in per_rank) for per_rank in args]


# --- the workloads ---------------------------------------------------------------------
def _sweep_program(dev, op: str, x, calls: int):
    for _ in range(calls):
        getattr(dev, op)(x)


def _sweep(name: str, tiny: bool) -> BenchWorkload:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    op, size = name.split("-")
    n = 8
    nbytes = (int(size[:-3]) * _MIB) // (64 if tiny else 1)
    elements = nbytes // 4 // (n if op == "all_gather" else 1)
    mesh = Mesh((n,), ("x",))
    calls = max(MIN_CALLS, SWEEP_BYTES // (int(size[:-3]) * _MIB))
    args = [(op, np.zeros(elements, np.float32), calls) for _ in range(n)]
    return BenchWorkload(name, mesh, _sweep_program, args, metas(args), "float32")


def _matmul(tiny: bool) -> BenchWorkload:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    from sharding import TensorSharding as TS, shard
    from tensor_parallel import MatMul, MatMulSharding
    m, k, n = (256, 128, 256) if tiny else (2048, 1024, 2048)
    mesh = Mesh((1, 8), ("dp", "tp"))
    op = MatMul(MatMulSharding(TS(None, "tp"), TS("tp", None), TS(None, None)))
    rng = np.random.default_rng(0)
    a = shard(rng.standard_normal((m, k)).astype(np.float32), op.sharding.a, mesh)
    b = shard(rng.standard_normal((k, n)).astype(np.float32), op.sharding.b, mesh)
    args = [(a[r], b[r]) for r in range(mesh.size)]
    return BenchWorkload("matmul", mesh, op.forward_local, args, metas(args), "float32")


def _ffn_program(dev, op, x, w1, b1, w2, b2, dy):
    op.forward_local(dev, x, w1, b1, w2, b2)
    op.backward_local(dev, x, w1, b1, w2, b2, dy)


def _ffn(tiny: bool) -> BenchWorkload:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    from sharding import shard
    from tensor_parallel import FeedForward
    from tensor_parallel.ffn_sharding import FeedForwardSharding
    batch, seq, d, d_ff = (4, 16, 64, 256) if tiny else (8, 256, 512, 2048)
    mesh = Mesh((2, 4), ("dp", "tp"))
    op = FeedForward(FeedForwardSharding("Megatron", tp="tp", dp="dp"))
    rng = np.random.default_rng(0)
    shapes = {"x": (batch, seq, d), "w1": (d, d_ff), "b1": (d_ff,), "w2": (d_ff, d),
              "b2": (d,), "dy": (batch, seq, d)}
    layouts = dict(op.layouts, dy=op.layouts["x"])
    pieces = {k: shard((0.05 * rng.standard_normal(s)).astype(np.float32), layouts[k], mesh)
              for k, s in shapes.items()}
    args = [(op,) + tuple(pieces[k][r] for k in shapes) for r in range(mesh.size)]
    return BenchWorkload("ffn", mesh, _ffn_program, args, metas(args), "float32")


def _mlp(tiny: bool) -> BenchWorkload:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    from pipeline_parallel import MLP
    from pipeline_parallel.executor import TrainJob, train_program
    from pipeline_parallel.optim import OptimizerConfig
    from pipeline_parallel.plan import plan_training
    width, rows, m = (64, 8, 4) if tiny else (1024, 256, 8)
    mlp = MLP([width] * 9, seed=0)
    mesh = Mesh((4,), ("pp",))
    plan = plan_training(mlp, mesh, rows * m, m, "1f1b", None)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((rows * m, width)), rng.standard_normal((rows * m, width))

    def job(params):
        return TrainJob(params=params, specs=plan.stage_specs, actions=plan.actions,
                        loss="mse", optimizer=OptimizerConfig("sgd", 0.01), steps=1,
                        microbatches=m, global_batch=rows * m)
    real = job(tuple(mlp.init_params()))
    meta = dataclasses.replace(real, params=tuple((_meta(w), _meta(b))
                                                  for w, b in real.params))
    args = plan.device_args(real, X, Y)
    metas = [(meta,) + tuple(None if a is None else _meta(a) for a in rest)
             for _, *rest in args]
    return BenchWorkload("mlp", mesh, train_program, args, metas, "float64")


def build_bench_workload(name: str, tiny: bool = False) -> BenchWorkload:
    if name in _SWEEP:
        return _sweep(name, tiny)
    builders = {"matmul": _matmul, "ffn": _ffn, "mlp": _mlp}
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return builders[name](tiny)
