"""``python -m vcluster.cli.torchrun``: a scenario's per-device program as one rank of a
torchrun job (one or many nodes).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m vcluster.cli.torchrun scenarios/ffn_megatron.yaml --out actual/ffn

Every process builds the same workload from the scenario file (inputs come from its
seed), joins the world from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; ``init_method="env://"``), creates
every axis group, runs the program on its own arguments, and sends its results to rank
0, which writes them in the oracle's format (one directory per sweep point, as ``vcluster
oracle export``) for ``vcluster oracle check GOLDEN --actual DIR``. The mesh of the
scenario must have ``WORLD_SIZE`` devices.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


class _ThisRank:
    """The engine interface (``mesh``, ``info``, ``run``) seen from inside one rank:
    ``run`` executes this rank's share and returns every rank's result on rank 0."""

    def __init__(self, dev, info: dict):
        self.dev, self.mesh, self.info = dev, dev.mesh, info

    def run(self, program, args_by_rank):
        import torch.distributed as dist
        result = program(self.dev, *args_by_rank[self.dev.rank])
        self.dev.synchronize()
        gathered = [None] * self.mesh.size if self.dev.rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        return gathered


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise SystemExit(f"vcluster.cli.torchrun: environment variable {name} is "
                         f"{value!r}; run this module under torchrun (it sets RANK, "
                         "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    return int(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcluster.cli.torchrun",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("file", metavar="FILE", help="a scenario YAML file")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="where rank 0 writes the results (oracle format)")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="override a scenario key (repeatable)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a rank waits for a peer (default 600)")
    args = parser.parse_args(argv)
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")

    # lazy: keeps vcluster --help fast
    import torch.distributed as dist
    from vcluster.oracle import engine_description, golden_from_run, save_golden
    from vcluster.scenario.oracle_export import scenario_layouts
    from vcluster.scenario import build_workload, load_scenario, sweep_points
    from vcluster.torchdist.rank import backend_info, init_rank

    scenario = load_scenario(args.file, args.overrides)
    points = sweep_points(scenario)
    meshes = {build_workload(scenario, i).mesh for i in range(len(points))}
    if len(meshes) != 1 or next(iter(meshes)).size != world:
        sizes = sorted(m.size for m in meshes)
        raise SystemExit(f"vcluster.cli.torchrun: {args.file} needs {sizes} devices (one mesh "
                         f"for every sweep point), torchrun started WORLD_SIZE={world}")
    # the ranks of this node share its GPUs: NCCL only when each can have its own
    local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ \
        else None
    dev = init_rank(next(iter(meshes)), rank, args.backend, "env://", args.timeout, local,
                    local_world)
    engine = _ThisRank(dev, backend_info())
    try:
        for i, (values, point) in enumerate(points):
            workload = build_workload(scenario, i)
            outputs = engine.run(workload.program, list(workload.args_by_rank))
            if rank != 0:
                continue
            golden = golden_from_run(
                workload.mesh, workload.args_by_rank, outputs, name=scenario.name,
                seed=point.workload.seed, layouts=scenario_layouts(point, workload),
                scenario={"file": os.path.abspath(args.file), "point": values,
                          "document": point.document, "launcher": "torchrun"},
                engine=engine_description(engine))
            dest = args.out if len(points) == 1 else os.path.join(args.out, f"point{i}")
            print(f"{save_golden(golden, dest)}: {world} ranks, engine torch "
                  f"{engine.info['torch_version']} ({engine.info['torch_backend']})", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
