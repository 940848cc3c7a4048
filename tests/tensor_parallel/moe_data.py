"""What the MoE dispatcher tests share (test_moe_flex.py, test_moe_nodes.py): the layer's
sizes and tolerances, its inputs, a small Llama MoE config, and the check that a training
run's trace moves its messages."""

import numpy as np

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPTConfig
from vcluster.runtime.tracing import comm_signature, trace_comm_signature, trace_program

H, F = 8, 12
RTOL, ATOL = 1e-9, 1e-12
PAIRWISE = {"all_to_all": "pairwise"}
GRADS = ("y", "dx", "d_router", "d_gate", "d_up", "d_down")
BIASES = dict(moe_router_bias=True, moe_expert_bias=True)


def moe_inputs(seed: int, n: int = 32, h: int = H):
    """(x, dy): two (n, h) standard-normal arrays from ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, h)), rng.standard_normal((n, h))


def skewed_router(params: dict, bias: float = 1.5, h: int = H) -> dict:
    """``params`` with a router that favours expert 0 (a real imbalance)."""
    p = dict(params, w_router=params["w_router"].copy())
    p["w_router"][:, 0] += bias / np.sqrt(h)
    return p


def moe_cfg(**kw) -> GPTConfig:
    """A two-layer Llama with 8 experts, top-4 (``kw`` overrides)."""
    return GPTConfig(**{**dict(hidden=16, layers=2, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24, experts=8, moe_top_k=4,
                               moe_ffn_hidden=12), **kw})


def trace_moves_the_runs_messages(cluster, model, par, tokens, targets):
    """One step of ``model`` on ``cluster``; the trace given the run's ExpertLoad per layer
    moves the emulator's messages, rank by rank. Returns (run, the run's events)."""
    mesh = par.mesh()
    cluster.reset_stats()
    run = model.fit(cluster, tokens, targets, 1, parallel=par)
    events = cluster.trace()
    traces = trace_program(mesh, train_program, model.meta_args(
        mesh, par, 1, expert_load=run.expert_load[0]))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank
    return run, events
