"""``python -m vcluster.cli.torchrun``: a scenario's per-device program as one rank of a
torchrun job (one or many nodes).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id JOB -m vcluster.cli.torchrun scenarios/ffn_megatron.yaml --out actual/ffn

Every process builds the same workload from the scenario file (inputs come from its
seed), joins the world from torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; ``init_method="env://"``), creates
every axis group, runs the program on its own arguments, and sends its results to rank
0, which writes them in the oracle's format (one directory per sweep point, as ``vcluster
oracle export``) for ``vcluster oracle check GOLDEN --actual DIR``. Every sweep point's
mesh must have ``WORLD_SIZE`` devices; points with different meshes of that size share
the world (each mesh's axis groups are created once, in point order, on every rank).

Several nodes: global rank 0 writes ``--out`` on its own node, and under the c10d
rendezvous that is whichever node sorts first (by host name), not necessarily the one
started first or named in ``--rdzv-endpoint``; so at the end the first process of every
other node prints where the results went (rank 0's host and the absolute directory),
and each golden records which node, local rank and host ran every rank
(``scenario.placement`` in its manifest). With the scenario's ``run.check`` (or
``--check``) rank 0 also compares the results with the workload's unsharded numpy
reference at the scenario's tolerance, as ``vcluster run`` does, and every rank exits 1
when an array is off (the results are written all the same, to be inspected).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

__all__ = ["main"]

_PROG = "vcluster.cli.torchrun"


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
        raise SystemExit(f"{_PROG}: environment variable {name} is "
                         f"{value!r}; run this module under torchrun (it sets RANK, "
                         "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    return int(value)


def _parse(argv):
    parser = argparse.ArgumentParser(prog=f"python -m {_PROG}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("file", metavar="FILE", help="a scenario YAML file (on every node)")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="where rank 0 writes the results (oracle format), on rank 0's "
                             "node")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append",
                        default=[], help="override a scenario key (repeatable)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="seconds a rank waits for a peer (default 600)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare with the numpy reference on rank 0 (default: the "
                             "scenario's run.check)")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    return args


def _fits_the_world(path: str, points, meshes, world: int) -> None:
    """Every point's mesh has ``world`` devices, and real data to run; else SystemExit."""
    sizes = sorted({m.size for m in meshes})
    if sizes != [world]:
        wrong = [f"point {i}{_values(values)} has {m}"
                 for i, ((values, _), m) in enumerate(zip(points, meshes)) if m.size != world]
        raise SystemExit(f"{_PROG}: {path} needs {sizes} devices (the mesh of every sweep "
                         f"point), torchrun started WORLD_SIZE={world} (--nnodes x "
                         f"--nproc-per-node): {'; '.join(wrong)}")
    for values, point in points:
        if point.run.mode == "simulate":
            raise SystemExit(f"{_PROG}: {path}{_values(values)} has run.mode simulate, "
                             "which builds no data to run; add --set run.mode=emulate")


def _values(values) -> str:
    """`` {sweep values}`` of a point, or nothing when the scenario does not sweep."""
    return f" {values}" if values else ""


def _placement(rank: int, local: int) -> list | None:
    """Every rank's {rank, node, local_rank, host}, on rank 0 (None elsewhere)."""
    import torch.distributed as dist
    mine = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", "0")),
            "local_rank": local, "host": socket.gethostname()}
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def _check_line(i: int, values, checks) -> tuple[str, list[str]]:
    """One line for a point's checks, and the names of the arrays that failed."""
    failed = [c["name"] for c in checks if not c["passed"]]
    worst = max(checks, key=lambda c: c["max_abs_error"] / max(c["tolerance"], 1e-300))
    verdict = "checks passed" if not failed else f"CHECK FAILED: {', '.join(failed)}"
    return (f"point {i}{_values(values)}: {verdict} against the numpy reference "
            f"({len(checks)} arrays; worst against its bound: {worst['name']}, max |error| "
            f"{worst['max_abs_error']:.3g}, bound {worst['tolerance']:.3g})"), failed


def main(argv=None) -> int:
    args = _parse(argv)
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")

    # lazy: keeps vcluster --help fast
    import torch.distributed as dist
    from vcluster.oracle import engine_description, golden_from_run, save_golden
    from vcluster.scenario.oracle_export import scenario_layouts
    from vcluster.scenario import build_workload, load_scenario, sweep_points
    from vcluster.torchdist.rank import backend_info, join_world, mesh_context

    scenario = load_scenario(args.file, args.overrides)
    points = sweep_points(scenario)
    meshes = [build_workload(scenario, i).mesh for i in range(len(points))]
    _fits_the_world(args.file, points, meshes, world)
    # the ranks of this node share its GPUs: NCCL only when each can have its own
    local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ \
        else None
    device = join_world(world, rank, args.backend, "env://", args.timeout, local, local_world)
    try:
        made, contexts = {}, {}
        for mesh in meshes:                      # the same order on every rank
            if mesh not in contexts:
                contexts[mesh] = mesh_context(mesh, rank, device, args.timeout, made)
        placement = _placement(rank, local)
        summary = {"host": socket.gethostname(), "written": [], "failed": []}
        for i, (values, point) in enumerate(points):
            workload = build_workload(scenario, i)
            engine = _ThisRank(contexts[workload.mesh], backend_info())
            outputs = engine.run(workload.program, list(workload.args_by_rank))
            if rank != 0:
                continue
            golden = golden_from_run(
                workload.mesh, workload.args_by_rank, outputs, name=scenario.name,
                seed=point.workload.seed, layouts=scenario_layouts(point, workload),
                scenario={"file": os.path.abspath(args.file), "point": values,
                          "document": point.document, "launcher": "torchrun",
                          "placement": placement},
                engine=engine_description(engine))
            dest = args.out if len(points) == 1 else os.path.join(args.out, f"point{i}")
            written = os.path.abspath(save_golden(golden, dest))
            summary["written"].append(written)
            nodes = len({p["node"] for p in placement})
            print(f"{written}: {world} ranks on {nodes} node{'s' if nodes != 1 else ''}, "
                  f"engine torch {engine.info['torch_version']} "
                  f"({engine.info['torch_backend']})", flush=True)
            if point.run.check if args.check is None else args.check:
                line, failed = _check_line(i, values, workload.check(
                    outputs, point.run.tolerance_for(workload.dtype)))
                print(line, flush=True)
                if failed:
                    summary["failed"].append(f"point {i}: {', '.join(failed)}")
        box = [summary]
        dist.broadcast_object_list(box, src=0)       # where rank 0 wrote, and its verdict
        summary = box[0]
    finally:
        dist.destroy_process_group()
    if local == 0 and rank != 0:                     # once per other node
        print(f"node {os.environ.get('GROUP_RANK', '?')} (host {socket.gethostname()}): "
              f"rank 0 wrote the results on host {summary['host']}: "
              f"{', '.join(summary['written'])}", flush=True)
    if not summary["failed"]:
        return 0
    if local == 0:
        print(f"{_PROG}: the check against the numpy reference failed on rank 0 (host "
              f"{summary['host']}): {'; '.join(summary['failed'])}", file=sys.stderr,
              flush=True)
    return 1


def _exit(code: int) -> None:
    """End this rank's process with ``code`` once its output is flushed, skipping the
    interpreter's teardown: after a clean ``destroy_process_group`` torch's gloo threads
    can still abort in static destruction ("terminate called without an active
    exception", SIGABRT), which failed runs whose every check had passed and left the
    other node's agent waiting on the rendezvous (the results are written, atomically,
    before this)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
