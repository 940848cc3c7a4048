"""``vcluster bench emulation``: what emulating a training step costs, against the same math
run in one process.

For each case both sides train the same model on the same data from the same seed:
``fit_reference`` in this process (numpy with all its BLAS threads) and ``fit`` on a
``VirtualCluster`` (every device a process, their thread pools sized to share the cores).
A step's time is taken as a difference, so that neither side's start-up counts:

    step_s = (median T(1 + steps) - median T(1)) / steps

over ``reps`` alternating runs of 1 and of 1 + ``steps`` steps (after one warm-up run of
each), where T includes everything ``fit`` does (shipping the parameters to the devices,
collecting the results). ``ratio`` = emulated step_s / one-process step_s. ``run_ratio``
is the same for the whole (1 + steps)-step call, start-up included. ``max_rel_error``
compares the emulated losses with the reference's: the emulator must compute the same
numbers, not only fast ones.

Cases: the MLP of issue 32 (8 layers of ``width`` features, ``batch`` samples, 1F1B with
4 micro-batches on dp 2 x pp 4) and a tiny GPT on tp x pp x dp = 2 x 2 x 2.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

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
    max_rel_error: float

    def as_dict(self) -> dict:
        return asdict(self)


def _step_time_s(fit, steps: int, reps: int) -> tuple[float, float]:
    """(step_s, time of a (1 + steps)-step run) of ``fit(n)``, as the module says."""
    fit(1)
    fit(1 + steps)                                   # warm-up of both lengths
    one, many = [], []
    for _ in range(reps):
        for n, into in ((1, one), (1 + steps, many)):
            t0 = time.perf_counter()
            fit(n)
            into.append(time.perf_counter() - t0)
    t1, tn = float(np.median(one)), float(np.median(many))
    return max(tn - t1, 0.0) / steps, tn


def _case(name, mesh, reference, emulated, steps, reps, losses_of) -> EmulationCase:
    ref_step, ref_run = _step_time_s(reference, steps, reps)
    emu_step, emu_run = _step_time_s(emulated, steps, reps)
    ref_losses, emu_losses = losses_of(reference(1 + steps)), losses_of(emulated(1 + steps))
    err = float(np.max(np.abs(emu_losses - ref_losses) / np.maximum(np.abs(ref_losses), 1e-300)))
    return EmulationCase(name, mesh, ref_step, emu_step,
                         emu_step / ref_step if ref_step > 0 else float("inf"),
                         emu_run / ref_run, err)


def measure_mlp(width: int, batch: int, steps: int = 3, reps: int = 3,
                threads_per_device: int | None = None) -> EmulationCase:
    """The MLP case: ``[width] * 9`` sizes, float64, SGD, 1F1B, 4 micro-batches, dp 2 x pp 4."""
    from mesh import Mesh
    from pipeline_parallel import MLP
    from vcluster import VirtualCluster

    sizes = [width] * 9
    mlp, rng = MLP(sizes, seed=0), np.random.default_rng(0)
    X, Y = rng.standard_normal((batch, width)), rng.standard_normal((batch, width))
    kw = dict(optimizer="sgd", lr=0.01)
    mesh = Mesh((2, 4), ("dp", "pp"))
    with VirtualCluster(mesh, threads_per_device=threads_per_device) as cluster:
        return _case(f"MLP width {width}, batch {batch}", "dp 2 x pp 4",
                     lambda n: mlp.fit_reference(X, Y, steps=n, **kw),
                     lambda n: mlp.fit(cluster, X, Y, steps=n, microbatches=4,
                                       schedule="1f1b", **kw),
                     steps, reps, lambda r: np.asarray(r.losses))


def measure_gpt(steps: int = 3, reps: int = 3,
                threads_per_device: int | None = None) -> EmulationCase:
    """The GPT case: hidden 64, 4 layers, 4 heads, sequence 16, vocabulary 64, batch 8,
    SGD, on tp 2 x pp 2 x dp 2."""
    from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
    from vcluster import VirtualCluster

    cfg = GPTConfig(hidden=64, layers=4, heads=4, seq=16, vocab=64)
    gpt, par = GPT(cfg, seed=1), ParallelConfig(global_batch=8, dp=2, pp=2, tp=2)
    rng = np.random.default_rng(0)
    tokens, targets = (rng.integers(0, cfg.vocab, (8, cfg.seq)) for _ in range(2))
    kw = dict(optimizer="sgd", lr=0.1)
    with VirtualCluster(par.mesh(), threads_per_device=threads_per_device) as cluster:
        return _case("GPT hidden 64, 4 layers, batch 8", "tp 2 x pp 2 x dp 2",
                     lambda n: gpt.fit_reference(tokens, targets, steps=n, **kw),
                     lambda n: gpt.fit(cluster, tokens, targets, steps=n, parallel=par, **kw),
                     steps, reps, lambda r: np.asarray(r.losses))


def format_table(cases: list[EmulationCase]) -> str:
    head = (f"{'case':<34} {'mesh':<20} {'one process':>12} {'emulated':>12} {'ratio':>6} "
            f"{'whole run':>9} {'max rel err':>11}")
    rows = [head, "-" * len(head)]
    for c in cases:
        rows.append(f"{c.name:<34} {c.mesh:<20} {c.reference_step_s * 1e3:>9.1f} ms "
                    f"{c.emulated_step_s * 1e3:>9.1f} ms {c.ratio:>5.2f}x {c.run_ratio:>8.2f}x "
                    f"{c.max_rel_error:>11.1e}")
    return "\n".join(rows)
