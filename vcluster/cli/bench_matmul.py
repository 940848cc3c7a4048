"""``vcluster bench matmul``: an emulated sharded MatMul against one process's ``A @ B``.

Both are measured in the same command: ``A @ B`` in this process (numpy with all its
BLAS threads) and ``MatMul(sharding).run(cluster, A, B)`` on N emulated devices (one
BLAS thread each), host transfers included — each the median of ``reps`` runs after one
warm-up. The default is the issue's case: 4096 x 2048 x 4096 float32,
MatchedInnerSharding (A [R, S(tp)], B [S(tp), R], C [R, R]) on a 1 x 8 mesh.
"""

from __future__ import annotations

import numpy as np

from vcluster.localhost.calibrate import median_time_s

__all__ = ["measure_matmul"]


def measure_matmul(m: int, k: int, n: int, devices: int, reps: int, dtype: str = "float32") -> dict:
    # lazy: keeps vcluster --help fast
    from mesh import Mesh
    from sharding import TensorSharding as TS
    from tensor_parallel import MatMul, MatMulSharding
    from vcluster import VirtualCluster

    rng = np.random.default_rng(0)
    A = rng.standard_normal((m, k)).astype(dtype)
    B = rng.standard_normal((k, n)).astype(dtype)
    single_s = median_time_s(lambda: A @ B, reps)
    op = MatMul(MatMulSharding(TS(None, "tp"), TS("tp", None), TS(None, None)))
    with VirtualCluster(Mesh((1, devices), ("dp", "tp"))) as cluster:
        C = op.run(cluster, A, B)
        emulated_s = median_time_s(lambda: op.run(cluster, A, B), reps)
    ref = A @ B
    max_rel_error = float(np.max(np.abs(C - ref)) / np.max(np.abs(ref)))
    return {"m": m, "k": k, "n": n, "dtype": dtype, "devices": devices, "reps": reps,
            "policy": op.sharding.policy.value, "single_process_s": single_s,
            "emulated_s": emulated_s, "ratio": emulated_s / single_s,
            "max_rel_error": max_rel_error}
