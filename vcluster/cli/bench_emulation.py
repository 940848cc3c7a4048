"""``vcluster bench emulation``: what emulating a training step costs, against the same math
run in one process.

For each case both sides train the same model on the same data from the same seed:
``fit_reference`` in this process (numpy with all its BLAS threads) and ``fit`` on a
``VirtualCluster`` (every device a process, their thread pools sized to share the cores).
A step's time is taken as a difference, so that neither side's start-up counts:

    step_s = (median T(1 + steps) - median T(1)) / steps

over ``reps`` runs of each length per side (the reference measured before and after the
emulated side, so that the machine's drift shows in both), where T includes everything ``fit`` does
(shipping the parameters to the devices, collecting the results). ``ratio`` = emulated
step_s / one-process step_s; ``run_ratio`` the same for the whole (1 + steps)-step call.
``cpu_ratio`` is the same difference taken over CPU seconds — this process's (all its
BLAS threads) against this process's plus the devices' — which the machine's other work
moves far less than wall time: it says how much more work emulating is, where ``ratio``
also says how well the devices keep the cores busy. ``other_cores``: the cores the
machine's other processes used meanwhile (a shared machine's noise, made visible).
``max_rel_error`` compares the emulated losses with the reference's: the emulator must
compute the same numbers, not only fast ones.

For the MLP a third side, ``microbatched``, runs the reference's math on each of the
dp x m micro-batches in turn in this process (``fit_reference`` on batch / 8 rows, eight
times: the same matrix products as the devices', one at a time, plus eight optimizer
steps where the devices do one — a small excess). It is the floor that no emulator of
micro-batched training can beat on this machine: small products run fewer FLOP/s than
one large one (on the development machine, single-threaded, 128 x 1024 x 1024 products
at 19-34 GFLOP/s against 27-39 for 1024 rows). ``overhead_ratio`` = emulated /
microbatched is what the emulator itself adds.

``pin_devices`` is ``VirtualCluster``'s (False, the default: free to migrate; None,
``--pin-devices auto``: pinned when the devices outnumber the cores, which on a 2-core
machine they do; ``on``: always).

Cases: the MLP of issue 32 (8 layers of ``width`` features, ``batch`` samples, 1F1B with
4 micro-batches on dp 2 x pp 4) and a tiny GPT on tp x pp x dp = 2 x 2 x 2.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from mesh import Mesh
from pipeline_parallel import MLP
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster import VirtualCluster

from .bench_predict_measure import BackgroundLoad, processes_cpu_s

__all__ = ["EmulationCase", "measure_mlp", "measure_gpt", "format_table"]


@dataclass(frozen=True)
class EmulationCase:
    """One row of the table (times in seconds)."""

    name: str
    mesh: str
    reference_step_s: float
    emulated_step_s: float
    ratio: float
    run_ratio: float
    cpu_ratio: float | None         # CPU per step, all processes; None without /proc
    other_cores: float | None       # cores the machine's other processes used meanwhile
    max_rel_error: float
    microbatched_step_s: float | None = None   # one process, the same micro-batches
    overhead_ratio: float | None = None        # emulated / microbatched

    def as_dict(self) -> dict:
        return asdict(self)


def _devices_cpu_s(pids) -> float | None:
    """CPU seconds the device processes have used (Linux /proc; None elsewhere)."""
    try:
        return processes_cpu_s(pids)
    except (OSError, ValueError, IndexError):
        return None


def _case(name, mesh, cluster, reference, emulated, steps, reps, losses_of,
          microbatched=None) -> EmulationCase:
    """Time each side in its own block (a warm-up, then ``reps`` runs of 1 and of
    1 + ``steps`` steps): reference, emulated, [microbatched], reference again, the
    reference's figures the medians over both of its blocks. Blocks, not interleaved
    runs: one process's BLAS threads spin for a while after their work, which would
    tax whichever run follows them."""
    sides = {"reference": reference, "emulated": emulated}
    if microbatched is not None:
        sides["microbatched"] = microbatched
    ref_losses = losses_of(reference(1 + steps))
    emu_losses = losses_of(emulated(1 + steps))
    wall = {(side, n): [] for side in sides for n in (1, 1 + steps)}
    cpu = {key: [] for key in wall}

    def block(side):
        fit = sides[side]
        fit(1)                                                  # warm-up
        for _ in range(reps):
            for n in (1, 1 + steps):
                devices0 = _devices_cpu_s(cluster.pids) if side == "emulated" else 0.0
                c0, t0 = time.process_time(), time.perf_counter()
                fit(n)
                wall[side, n].append(time.perf_counter() - t0)
                devices = _devices_cpu_s(cluster.pids) if side == "emulated" else 0.0
                if devices is not None and devices0 is not None:
                    cpu[side, n].append(time.process_time() - c0 + devices - devices0)

    with BackgroundLoad(cluster.pids) as background:
        order = ["reference", "emulated"] + (["microbatched"] if microbatched else [])
        for side in order + ["reference"]:       # the reference twice: drift shows in both
            block(side)

    def per_step(table, side):
        values = [float(np.median(table[side, n])) for n in (1, 1 + steps)]
        return max(values[1] - values[0], 0.0) / steps, values[1]

    (ref_step, ref_run), (emu_step, emu_run) = per_step(wall, "reference"), \
        per_step(wall, "emulated")
    cpu_ratio = None
    if all(cpu.values()):
        ref_cpu, emu_cpu = per_step(cpu, "reference")[0], per_step(cpu, "emulated")[0]
        cpu_ratio = emu_cpu / ref_cpu if ref_cpu > 0 else None
    micro_step = per_step(wall, "microbatched")[0] if microbatched is not None else None
    err = float(np.max(np.abs(emu_losses - ref_losses) / np.maximum(np.abs(ref_losses), 1e-300)))
    return EmulationCase(name, mesh, ref_step, emu_step,
                         emu_step / ref_step if ref_step > 0 else float("inf"),
                         emu_run / ref_run, cpu_ratio, background.cores, err, micro_step,
                         emu_step / micro_step if micro_step else None)


def measure_mlp(width: int, batch: int, steps: int = 3, reps: int = 3,
                threads_per_device: int | None = None,
                pin_devices: bool | None = False) -> EmulationCase:
    """The MLP case: ``[width] * 9`` sizes, float64, SGD, 1F1B, 4 micro-batches, dp 2 x pp 4."""
    sizes = [width] * 9
    mlp, rng = MLP(sizes, seed=0), np.random.default_rng(0)
    X, Y = rng.standard_normal((batch, width)), rng.standard_normal((batch, width))
    kw = dict(optimizer="sgd", lr=0.01)
    mesh = Mesh((2, 4), ("dp", "pp"))
    rows = batch // (2 * 4)                          # one micro-batch of one replica

    def microbatched(n):
        for c in range(batch // rows):
            mlp.fit_reference(X[c * rows:(c + 1) * rows], Y[c * rows:(c + 1) * rows],
                              steps=n, **kw)

    with VirtualCluster(mesh, threads_per_device=threads_per_device,
                        pin_devices=pin_devices) as cluster:
        return _case(f"MLP width {width}, batch {batch}", "dp 2 x pp 4", cluster,
                     lambda n: mlp.fit_reference(X, Y, steps=n, **kw),
                     lambda n: mlp.fit(cluster, X, Y, steps=n, microbatches=4,
                                       schedule="1f1b", **kw),
                     steps, reps, lambda r: np.asarray(r.losses), microbatched)


def measure_gpt(steps: int = 3, reps: int = 3,
                threads_per_device: int | None = None,
                pin_devices: bool | None = False) -> EmulationCase:
    """The GPT case: hidden 64, 4 layers, 4 heads, sequence 16, vocabulary 64, batch 8,
    SGD, on tp 2 x pp 2 x dp 2."""
    cfg = GPTConfig(hidden=64, layers=4, heads=4, seq=16, vocab=64)
    gpt, par = GPT(cfg, seed=1), ParallelConfig(global_batch=8, dp=2, pp=2, tp=2)
    rng = np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    kw = dict(optimizer="sgd", lr=0.1)
    with VirtualCluster(par.mesh(), threads_per_device=threads_per_device,
                        pin_devices=pin_devices) as cluster:
        return _case("GPT hidden 64, 4 layers, batch 8", "tp 2 x pp 2 x dp 2", cluster,
                     lambda n: gpt.fit_reference(tokens, targets, steps=n, **kw),
                     lambda n: gpt.fit(cluster, tokens, targets, steps=n, parallel=par, **kw),
                     steps, reps, lambda r: np.asarray(r.losses))


def format_table(cases: list[EmulationCase]) -> str:
    head = (f"{'case':<34} {'mesh':<20} {'one process':>12} {'emulated':>12} {'ratio':>6} "
            f"{'whole run':>9} {'CPU ratio':>9} {'micro-batched':>13} {'overhead':>8} "
            f"{'others':>6} {'max rel err':>11}")
    rows = [head, "-" * len(head)]
    fmt = lambda v, spec, unit="": "-" if v is None else f"{v:{spec}}{unit}"  # noqa: E731
    for c in cases:
        micro = None if c.microbatched_step_s is None else c.microbatched_step_s * 1e3
        rows.append(f"{c.name:<34} {c.mesh:<20} {c.reference_step_s * 1e3:>9.1f} ms "
                    f"{c.emulated_step_s * 1e3:>9.1f} ms {c.ratio:>5.2f}x {c.run_ratio:>8.2f}x "
                    f"{fmt(c.cpu_ratio, '>8.2f', 'x')} {fmt(micro, '>10.1f', ' ms')} "
                    f"{fmt(c.overhead_ratio, '>7.2f', 'x')} {fmt(c.other_cores, '>6.2f')} "
                    f"{c.max_rel_error:>11.1e}")
    return "\n".join(rows)
