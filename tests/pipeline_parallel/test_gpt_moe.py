"""Mixture of experts in the Llama training program (GPTConfig(experts=E),
ParallelConfig(ep)): the emulated dp x ep x pp x tp training equals a single-process numpy
Llama whose MLP is the plain MoE reference (tensor_parallel.moe_reference) routing the
same calls; the all_to_all traffic equals the closed form of the routed counts and the
trace given the run's ExpertLoad."""


import numpy as np
import pytest

from pipeline_parallel.executor import train_program
from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig, moe_groups
from tensor_parallel.moe import MOE_TAG
from tensor_parallel.moe_load import ExpertLoad
from vcluster.runtime.events import CommEvent
from vcluster.runtime.tracing import comm_signature, trace_comm_signature, trace_program

from .gpt_data import token_data

pytestmark = pytest.mark.timeout(300)

B, STEPS, LR = 4, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12


def _cfg(top_k=2, cf=None, experts=4, layers=2, **kw):
    moe = dict(moe_top_k=top_k, moe_ffn_hidden=12, capacity_factor=cf) if experts else {}
    return GPTConfig(**{**dict(hidden=16, layers=layers, heads=4, seq=8, vocab=32, arch="llama",
                               kv_heads=2, ffn_hidden=24, experts=experts, **moe), **kw})


def _data(cfg, seed=0, batch=B):
    return token_data(cfg, batch, seed)


def _close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=what)


def _trains_as_reference(cluster, model, tokens, targets, par, forward=True, steps=STEPS):
    """The emulated run against the reference routing the same calls: forward loss and
    logits (``forward``), then ``steps`` SGD steps — losses, every gradient and parameter
    at rtol 1e-9. Returns (run, ref)."""
    if forward:
        ref_loss, ref_logits = model.reference_forward(tokens, targets, parallel=par)
        loss, logits = model.forward(cluster, tokens, targets, par)
        _close(loss, ref_loss, "forward loss")
        _close(logits, ref_logits, "logits")
    ref = model.fit_reference(tokens, targets, steps, lr=LR, parallel=par)
    run = model.fit(cluster, tokens, targets, steps, parallel=par, lr=LR)
    _close(run.losses, ref.losses, "losses")
    for n in ref.params:
        _close(run.grads[n], ref.grads[n], f"grad {n}")
        _close(run.params[n], ref.params[n], f"param {n}")
    return run, ref


# (dp, ep, pp, tp, sp, top_k, capacity factor, micro_batch, recompute): every ep in
# {1, 2, 4}, top-1/2, dropping and dropless, pp 2, dp/ep 2 (experts' grads over "dp"),
# tp 2 with SP (experts replicated over tp)
CASES = [
    (2, 1, 1, 1, False, 1, 1.0, 1, "none"),
    (2, 2, 1, 1, False, 2, None, 1, "none"),
    (4, 4, 1, 1, False, 1, 1.25, 1, "selective"),
    (2, 2, 2, 1, False, 2, 1.0, 1, "full"),
    (4, 2, 1, 1, False, 2, None, 1, "none"),
    (2, 2, 1, 2, True, 1, None, 2, "none"),
    (2, 2, 2, 2, False, 2, 1.0, 1, "full"),
]


@pytest.mark.parametrize("dp, ep, pp, tp, sp, top_k, cf, b, recompute", CASES,
                         ids=[f"dp{c[0]}-ep{c[1]}-pp{c[2]}-tp{c[3]}{'-sp' if c[4] else ''}"
                              f"-top{c[5]}-{'cf' + str(c[6]) if c[6] else 'dropless'}-{c[8]}"
                              for c in CASES])
def test_training_equals_reference(cluster_of, dp, ep, pp, tp, sp, top_k, cf, b, recompute):
    cfg = _cfg(top_k, cf)
    par = ParallelConfig(global_batch=B * (b if tp > 1 else 1), micro_batch=b, dp=dp, ep=ep,
                         pp=pp, tp=tp, sequence_parallel=sp, recompute=recompute)
    model, (tokens, targets) = GPT(cfg, seed=3), _data(cfg, batch=par.global_batch)
    cluster = cluster_of(par.mesh())
    run, ref = _trains_as_reference(cluster, model, tokens, targets, par)
    assert run.aux_losses.shape == (STEPS,) and (run.aux_losses > 0).all()
    # the load: every token routes top_k times per layer; dropping never adds
    for step in run.expert_load:
        assert sorted(step) == list(range(cfg.layers))
        for load in step.values():
            assert load.ep == dp and sum(load.per_expert_routed) == par.global_batch * \
                cfg.seq * top_k
            assert (load.dropped > 0) <= (cf is not None)


# fine-grained MoE, as DeepSeek-V3 and Qwen3 route: (dp, ep, pp, tp, sp, experts, top_k,
# router, shared width, routed scaling, capacity factor, recompute); micro-batches 2 per
# step (fewer than, equal to and more than pp over the cases)
FINE = [
    (2, 2, 1, 1, False, 8, 4, "softmax", 0, 1.0, None, "none"),
    (2, 2, 2, 1, False, 8, 8, "sigmoid", 10, 2.5, None, "selective"),
    (4, 4, 1, 1, False, 8, 8, "sigmoid", 0, 2.5, 1.0, "none"),
    (2, 2, 1, 2, True, 8, 4, "softmax", 6, 1.0, None, "full"),
    (2, 1, 2, 2, False, 4, 3, "sigmoid", 6, 1.0, None, "none"),
]


@pytest.mark.parametrize("dp, ep, pp, tp, sp, experts, top_k, router, fs, sigma, cf, recompute",
                         FINE, ids=[f"dp{c[0]}-ep{c[1]}-pp{c[2]}-tp{c[3]}{'-sp' if c[4] else ''}"
                                    f"-E{c[5]}-top{c[6]}-{c[7]}-shared{c[8]}-{c[11]}"
                                    for c in FINE])
def test_fine_grained_moe_training_equals_reference(cluster_of, dp, ep, pp, tp, sp, experts,
                                                    top_k, router, fs, sigma, cf, recompute):
    """Top-k up to E, sigmoid scores with DeepSeek-V3's scaling, a shared expert: forward,
    every gradient and 3 steps of training equal the numpy Llama whose MLP is the MoE
    reference, rtol 1e-9 in float64."""
    cfg = _cfg(top_k, cf, experts=experts, moe_router=router, moe_shared_ffn_hidden=fs,
               moe_routed_scaling=sigma, moe_aux_coef=0.01 if router == "softmax" else 0.0)
    par = ParallelConfig(global_batch=2 * dp, micro_batch=1, dp=dp, ep=ep, pp=pp, tp=tp,
                         sequence_parallel=sp, recompute=recompute)
    model, (tokens, targets) = GPT(cfg, seed=5), _data(cfg, batch=par.global_batch)
    cluster = cluster_of(par.mesh())
    run, ref = _trains_as_reference(cluster, model, tokens, targets, par)
    assert {n.rsplit(".", 1)[-1] for n in ref.params} >= (
        {"shared_gate", "shared_up", "shared_down"} if fs else {"w_router"})
    for step in run.expert_load:
        for load in step.values():
            assert sum(load.per_expert_routed) == par.global_batch * cfg.seq * top_k


# expert tensor parallelism: (tp, etp, ep, dp, pp, top_k, shared width, capacity factor,
# micro-batches per step) — etp = tp splits each expert over tp, etp = 1 folds the expert
# group over whole tp groups (each tp rank routes its own sequence slice)
ETP = [
    (1, 1, 2, 2, 1, 4, 0, None, 2),
    (1, 1, 2, 2, 2, 2, 6, None, 1),
    (2, 1, 2, 1, 1, 4, 0, None, 2),
    (2, 1, 2, 1, 2, 8, 6, None, 3),
    (2, 1, 2, 2, 1, 2, 0, 1.0, 1),
    (2, 1, 4, 2, 2, 4, 6, None, 2),
    (2, 1, 4, 4, 1, 2, 0, None, 1),
    (2, 2, 2, 2, 1, 4, 6, None, 2),
    (2, 2, 2, 2, 2, 8, 0, 1.0, 1),
]


@pytest.mark.parametrize("tp, etp, ep, dp, pp, top_k, fs, cf, m", ETP,
                         ids=[f"tp{c[0]}-etp{c[1]}-ep{c[2]}-dp{c[3]}-pp{c[4]}-top{c[5]}"
                              f"-shared{c[6]}-{'cf' if c[7] else 'dropless'}-m{c[8]}"
                              for c in ETP])
def test_expert_tensor_parallelism_equals_reference(cluster_of, tp, etp, ep, dp, pp, top_k,
                                                    fs, cf, m):
    """Forward, gradients and 3 steps equal the reference that routes the same calls —
    folded, a call's tokens are the sequence slices of the group's tp ranks."""
    cfg = _cfg(top_k, cf, experts=8, moe_shared_ffn_hidden=fs)
    par = ParallelConfig(global_batch=dp * m, micro_batch=1, dp=dp, ep=ep, pp=pp, tp=tp,
                         etp=etp, sequence_parallel=tp > 1)
    assert par.folded == (etp == 1 and tp > 1)
    model, (tokens, targets) = GPT(cfg, seed=7), _data(cfg, batch=par.global_batch)
    cluster = cluster_of(par.mesh())
    run, ref = _trains_as_reference(cluster, model, tokens, targets, par)
    assert (run.aux_losses > 0).all()
    rows = dp * (tp if par.folded else 1)
    for step in run.expert_load:
        for load in step.values():
            assert load.ep == rows
            assert sum(load.per_expert_routed) == par.global_batch * cfg.seq * top_k


@pytest.mark.parametrize("tp, etp, ep, dp", [(1, 1, 2, 2), (2, 1, 4, 2), (2, 2, 2, 2)],
                         ids=["tp1-ep2", "tp2-etp1-ep4", "tp2-etp2-ep2"])
def test_qwen3_like_moe_equals_reference(cluster_of, tp, etp, ep, dp):
    """Qwen3's MoE block: 8 experts top-8 (here all of them), a head dimension 6 !=
    hidden/heads 4 and QK-norm, under both expert tensor parallelisms."""
    cfg = _cfg(8, None, experts=8, head_dim=6, qk_norm=True, moe_ffn_hidden=6)
    par = ParallelConfig(global_batch=2 * dp, micro_batch=1, dp=dp, ep=ep, tp=tp, etp=etp,
                         sequence_parallel=tp > 1)
    model, (tokens, targets) = GPT(cfg, seed=9), _data(cfg, batch=par.global_batch)
    cluster = cluster_of(par.mesh())
    ref = model.fit_reference(tokens, targets, STEPS, lr=LR, parallel=par)
    run = model.fit(cluster, tokens, targets, STEPS, parallel=par, lr=LR)
    _close(run.losses, ref.losses, "losses")
    assert "layers.0.q_norm_g" in ref.params
    for n in ref.params:
        _close(run.grads[n], ref.grads[n], f"grad {n}")
        _close(run.params[n], ref.params[n], f"param {n}")


def test_folded_expert_group_rules():
    with pytest.raises(ValueError, match="etp=3: the experts' hidden dimension is split"):
        ParallelConfig(global_batch=4, dp=2, ep=2, tp=4, etp=3, sequence_parallel=True)
    with pytest.raises(ValueError, match="ep=2 must be tp=4 times a divisor of dp=2"):
        ParallelConfig(global_batch=4, dp=2, ep=2, tp=4, etp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=False.*etp=1 each tp rank routes"):
        ParallelConfig(global_batch=4, dp=2, ep=4, tp=2, etp=1)
    par = ParallelConfig(global_batch=4, dp=2, ep=4, tp=2, etp=1, sequence_parallel=True)
    assert par.mesh().shape == {"dp": 1, "pp": 1, "ep": 2, "tp": 2}
    assert (par.expert_axes, par.expert_dp) == (("ep", "tp"), 1)
    assert ParallelConfig(global_batch=4, dp=2, ep=2, tp=2).etp == 2     # default: tp


def test_aux_loss_is_reported_and_equals_the_reference(cluster_of):
    """fit's aux_losses[0] equals the reference's loss with aux_coef 0.5 less its loss
    with aux_coef 0 (same parameters: the seed draws them whatever the coefficient), and
    fit's losses include it; the load's kept equals routed (dropless)."""
    par = ParallelConfig(global_batch=B, dp=2, ep=2)
    tokens, targets = _data(_cfg())
    ref = {a: GPT(_cfg(moe_aux_coef=a), seed=3).reference_forward(tokens, targets,
                                                                  parallel=par)[0]
           for a in (0.0, 0.5)}
    run = GPT(_cfg(moe_aux_coef=0.5), seed=3).fit(cluster_of(par.mesh()), tokens, targets, 1,
                                                   parallel=par)
    _close(run.aux_losses[0], ref[0.5] - ref[0.0], "aux")
    _close(run.losses[0], ref[0.5], "loss with aux")
    load = run.expert_load[0][0]
    assert load.per_expert_routed == load.per_expert_kept and load.dropped == 0


def test_moe_groups_are_the_ep_ranks_micro_batches():
    par = ParallelConfig(global_batch=8, micro_batch=1, dp=4, ep=2)
    # replicas 0..3 hold rows 0-1, 2-3, 4-5, 6-7; group (d, j) = rows of (2d, 2d+1) at j
    assert moe_groups(par) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _a2a_received(events, mesh, rank):
    """Bytes ``rank`` received by all_to_all over its ep group and by the MoE's tagged
    receives (received: the small counts go by the "shm" algorithm, whose sender records
    no peer bytes)."""
    group = mesh.group("ep", rank)
    return sum(b for e in events if isinstance(e, CommEvent) and e.rank == rank and (
        (e.collective == "all_to_all" and e.group == group)
        or (e.collective == "recv" and MOE_TAG <= e.tag < MOE_TAG + 4)) for _, b, _ in e.received)


@pytest.mark.parametrize("cf", [None, 1.0], ids=["dropless", "capacity"])
def test_all_to_all_traffic_equals_closed_form_and_trace(cluster_of, cf):
    """One step, one micro-batch, dp = ep = 2: received per layer by rank r, the counts'
    all_to_all (n−1)/n·E·8 bytes, plus four token exchanges (dispatch, combine, and their
    gradients): capacity 4·(n−1)·E_l·C·h·b, dropless 2·h·b·(sent_r + received_r) with
    sent_r = Σ_{e not r's} kept[r][e], received_r = Σ_{s≠r} Σ_{e r's} kept[s][e]; the
    trace, given the run's ExpertLoad per layer, moves the same messages."""
    cfg = _cfg(2, cf)
    par = ParallelConfig(global_batch=B, micro_batch=2, dp=2, ep=2)
    mesh, model = par.mesh(), GPT(cfg, seed=5)
    tokens, targets = _data(cfg)
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    run = model.fit(cluster, tokens, targets, 1, parallel=par)
    events = cluster.trace()
    loads = run.expert_load[0]
    n, E, h, b8 = 2, cfg.experts, cfg.hidden, 8
    e_l, T = E // n, par.micro_batch * cfg.seq
    cap = cfg.moe().capacity(T)
    for r in range(mesh.size):
        want = 0
        for load in loads.values():
            kept, me = load.kept, range(r * e_l, (r + 1) * e_l)
            want += (n - 1) * E * 8 // n
            if cf is None:
                sent = sum(kept[r][e] for e in range(E) if e not in me)
                recv = sum(kept[s][e] for s in range(n) if s != r for e in me)
                want += 2 * h * b8 * (sent + recv)
            else:
                want += 4 * (n - 1) * e_l * cap * h * b8
        assert _a2a_received(events, mesh, r) == want, r
    traces = trace_program(mesh, train_program, model.meta_args(mesh, par, 1,
                                                                 expert_load=loads))
    for t in traces:
        assert trace_comm_signature(t) == comm_signature(events, t.rank), t.rank


def test_expert_grads_reduce_over_expert_data_parallel_axis():
    """dp 4, ep 2: the experts' gradients are all-reduced over the "dp" axis (2 ranks),
    everything else over (dp, ep) (4 ranks); no all-reduce over ep alone of expert grads."""
    from vcluster.runtime.tracing import TraceCollective
    cfg = _cfg(2, None, layers=1)
    par = ParallelConfig(global_batch=4, dp=4, ep=2)
    mesh = par.mesh()
    assert mesh.axes == ("dp", "pp", "ep", "tp") and mesh.shape["dp"] == 2
    trace = trace_program(mesh, train_program, GPT(cfg).meta_args(mesh, par, 1,
                                                                  bucket_bytes=1 << 30))[0]
    reduces = [(op.group, op.nbytes) for op in trace.ops
               if isinstance(op, TraceCollective) and op.collective == "all_reduce"]
    e_l, h, f = cfg.experts // 2, cfg.hidden, cfg.moe_ffn_hidden
    expert_bytes = 3 * e_l * h * f * 8
    total = sum(np.prod(s) for s in GPT(cfg).param_shapes().values()) * 8
    by_group = {}
    for g, nb in reduces:
        by_group.setdefault(len(g), []).append(nb)
    assert expert_bytes in by_group[2]
    assert total - 3 * cfg.experts * h * f * 8 in by_group[4]


def test_bad_arguments():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelConfig(global_batch=4, dp=4, ep=3)
    with pytest.raises(ValueError, match="experts must be"):
        _cfg(experts=-1)
    with pytest.raises(ValueError, match="moe_top_k must be 1 to experts=4"):
        _cfg(top_k=5)
    with pytest.raises(ValueError, match="moe_router='tanh'.*one of softmax, sigmoid"):
        _cfg(moe_router="tanh")
    with pytest.raises(ValueError, match="moe_routed_scaling=0"):
        _cfg(moe_routed_scaling=0)
    with pytest.raises(ValueError, match="moe_shared_ffn_hidden"):
        _cfg(moe_shared_ffn_hidden=-3)
    with pytest.raises(ValueError, match="moe_router='sigmoid': only a mixture-of-experts"):
        GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32, moe_router="sigmoid")
    with pytest.raises(ValueError, match="capacity_factor"):
        _cfg(cf=-1.0)
    with pytest.raises(ValueError, match="experts=4 do not split over ep=8"):
        ParallelConfig(global_batch=8, dp=8, ep=8).check(_cfg(), ParallelConfig(
            global_batch=8, dp=8, ep=8).mesh())
    with pytest.raises(ValueError, match="dense model needs ep=1"):
        par = ParallelConfig(global_batch=4, dp=2, ep=2)
        par.check(_cfg(experts=0), par.mesh())
    with pytest.raises(ValueError, match="experts=4: the program's experts are SwiGLU MLPs, "
                                         "and arch='gpt''s MLP is gelu.*allowed: 0 with "
                                         "arch='gpt'"):
        _cfg(arch="gpt", kv_heads=None, ffn_hidden=None)
    with pytest.raises(ValueError, match="moe_ffn_hidden=12: only a mixture-of-experts model "
                                         "takes it"):
        GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32, moe_ffn_hidden=12)
    assert ExpertLoad.skewed(2, 4, 16, 2, 2.0).per_expert_routed[0] == 32


# --- MoE with context parallelism and ZeRO (the merge of moeint into cp/ZeRO) ---------

# context parallelism with experts: (tp, etp, ep, cp, dp, pp, top_k, capacity factor,
# micro-batches) — each cp rank routes its own two chunks; the expert group takes whole cp
# groups (and whole tp groups when folded); ep 1 with cp: every rank a call of its own
CP_EP = [
    (1, 1, 2, 2, 1, 1, 2, None, 2),
    (1, 1, 2, 2, 2, 2, 4, None, 1),
    (1, 1, 4, 2, 2, 1, 2, 1.0, 1),
    (2, 1, 4, 2, 1, 1, 4, None, 2),
    (2, 1, 4, 2, 1, 2, 2, None, 3),
    (2, 2, 2, 2, 1, 1, 4, None, 2),
    (1, 1, 1, 2, 2, 1, 2, 1.0, 1),
]


@pytest.mark.parametrize("tp, etp, ep, cp, dp, pp, top_k, cf, m", CP_EP,
                         ids=[f"tp{c[0]}-etp{c[1]}-ep{c[2]}-cp{c[3]}-dp{c[4]}-pp{c[5]}"
                              f"-top{c[6]}-{'cf' if c[7] else 'dropless'}-m{c[8]}"
                              for c in CP_EP])
def test_context_and_expert_parallelism_equal_reference(cluster_of, tp, etp, ep, cp, dp, pp,
                                                        top_k, cf, m):
    """CP × EP: forward, gradients and 3 steps equal the reference that routes each
    rank's chunks (its tp slice of them when folded) as one rank of its call."""
    cfg = _cfg(top_k, cf, experts=8, moe_shared_ffn_hidden=6 if tp > 1 else 0)
    par = ParallelConfig(global_batch=dp * m, micro_batch=1, dp=dp, ep=ep, pp=pp, tp=tp,
                         etp=etp, cp=cp, sequence_parallel=tp > 1)
    model, (tokens, targets) = GPT(cfg, seed=11), _data(cfg, batch=par.global_batch)
    cluster = cluster_of(par.mesh())
    run, ref = _trains_as_reference(cluster, model, tokens, targets, par)
    for step in run.expert_load:
        for load in step.values():
            assert load.ep == dp * cp * (tp if par.folded else 1)      # routing ranks
            assert sum(load.per_expert_routed) == par.global_batch * cfg.seq * top_k


@pytest.mark.parametrize("tp, etp, ep, cp, dp", [(1, 1, 2, 1, 2), (2, 2, 2, 1, 2),
                                                  (2, 1, 4, 1, 2), (1, 1, 2, 2, 1)],
                         ids=["ep2", "tp2-etp2-ep2", "tp2-etp1-ep4", "cp2-ep2"])
def test_allgather_dispatcher_training_equals_reference(cluster_of, tp, etp, ep, cp, dp):
    """ParallelConfig(moe_dispatcher="allgather") trains exactly as the reference (and so
    as the all-to-all dispatcher) under split, folded and context-parallel groups."""
    cfg = _cfg(4, None, experts=8, moe_shared_ffn_hidden=6)
    par = ParallelConfig(global_batch=2 * dp, micro_batch=1, dp=dp, ep=ep, tp=tp, etp=etp,
                         cp=cp, sequence_parallel=tp > 1, moe_dispatcher="allgather")
    model, (tokens, targets) = GPT(cfg, seed=13), _data(cfg, batch=par.global_batch)
    run, ref = _trains_as_reference(cluster_of(par.mesh()), model, tokens, targets, par,
                                    forward=False)


# dense-first layers (DeepSeek-V3's first three): (dense layers, layers, pp, tp, etp, ep,
# dp, first stage layers)
DENSE = [((0,), 3, 1, 1, 1, 2, 2, None), ((0, 1), 4, 2, 1, 1, 2, 2, None),
         ((0, 2), 4, 2, 2, 1, 4, 2, None), ((0,), 5, 2, 2, 2, 2, 2, 1),
         ((3,), 4, 1, 2, 1, 2, 1, None)]


@pytest.mark.parametrize("dense, layers, pp, tp, etp, ep, dp, first", DENSE,
                         ids=[f"dense{'-'.join(map(str, c[0]))}-l{c[1]}-pp{c[2]}-tp{c[3]}"
                              f"-etp{c[4]}-ep{c[5]}" for c in DENSE])
def test_dense_layers_among_moe_layers_equal_reference(cluster_of, dense, layers, pp, tp, etp,
                                                       ep, dp, first):
    """``moe_dense_layers``: those layers keep the dense SwiGLU (width ffn_hidden), the
    others are the mixture; training equals the reference, and the load reports only the
    MoE layers."""
    cfg = _cfg(4, None, experts=8, layers=layers, moe_dense_layers=dense,
               moe_shared_ffn_hidden=6)
    par = ParallelConfig(global_batch=2 * dp, micro_batch=1, dp=dp, ep=ep, pp=pp, tp=tp,
                         etp=etp, sequence_parallel=tp > 1, first_stage_layers=first)
    model, (tokens, targets) = GPT(cfg, seed=17), _data(cfg, batch=par.global_batch)
    assert f"layers.{dense[0]}.w_gate" in model.param_shapes() and \
        f"layers.{dense[0]}.w_router" not in model.param_shapes()
    run, ref = _trains_as_reference(cluster_of(par.mesh()), model, tokens, targets, par,
                                    forward=False)
    assert sorted(run.expert_load[0]) == [i for i in range(layers) if i not in dense]


def test_group_limited_routing_in_training_equals_reference(cluster_of):
    """DeepSeek-V3's routing in miniature: 16 experts in 4 groups, each token choosing 4
    among its 2 best groups, a sigmoid router scaled 2.5, a dense first layer."""
    cfg = _cfg(4, None, experts=16, layers=3, moe_groups=(4, 2), moe_router="sigmoid",
               moe_routed_scaling=2.5, moe_dense_layers=(0,), moe_aux_coef=0.0)
    par = ParallelConfig(global_batch=4, micro_batch=1, dp=2, ep=2, tp=2, etp=1,
                         sequence_parallel=True)
    model, (tokens, targets) = GPT(cfg, seed=19), _data(cfg, batch=4)
    run, ref = _trains_as_reference(cluster_of(par.mesh()), model, tokens, targets, par,
                                    forward=False)
    with pytest.raises(ValueError, match=r"moe_groups=\(3, 1\)"):
        _cfg(experts=16, moe_groups=(3, 1))


@pytest.mark.parametrize("tp, etp, ep, dp, cp", [(1, 1, 2, 2, 1), (2, 1, 4, 2, 1),
                                                  (2, 2, 2, 2, 1), (1, 1, 2, 1, 2)],
                         ids=["ep2", "tp2-etp1-ep4", "tp2-etp2-ep2", "cp2-ep2"])
def test_aux_loss_free_balancing_equals_reference(cluster_of, tp, etp, ep, dp, cp):
    """DeepSeek-V3's auxiliary-loss-free balancing (no aux loss; a per-expert bias on the
    choice, moved by γ·sign(mean load − load) after each step from the global load):
    5 steps equal the reference, whose bias follows the same global counts; the bias
    really changes the routing (the losses differ from no bias)."""
    base = dict(experts=8, moe_router="sigmoid", moe_aux_coef=0.0, moe_top_k=2)
    cfg = _cfg(**base, moe_bias_update_rate=0.05)
    par = ParallelConfig(global_batch=2 * dp, micro_batch=1, dp=dp, ep=ep, tp=tp, etp=etp,
                         cp=cp, sequence_parallel=tp > 1)
    model, (tokens, targets) = GPT(cfg, seed=23), _data(cfg, batch=par.global_batch)
    ref = model.fit_reference(tokens, targets, 5, lr=LR, parallel=par)
    run = model.fit(cluster_of(par.mesh()), tokens, targets, 5, parallel=par, lr=LR)
    _close(run.losses, ref.losses, "losses")
    for n in ref.params:
        _close(run.params[n], ref.params[n], f"param {n}")
    plain = GPT(_cfg(**base), seed=23).fit_reference(tokens, targets, 5, lr=LR, parallel=par)
    assert not np.allclose(plain.losses, ref.losses)
    with pytest.raises(ValueError, match="moe_bias_update_rate=-1"):
        _cfg(**base, moe_bias_update_rate=-1)


def test_dense_layers_rules():
    with pytest.raises(ValueError, match=r"moe_dense_layers=\(5,\).*layer indices 0 to 1"):
        _cfg(moe_dense_layers=(5,))
    with pytest.raises(ValueError, match=r"moe_dense_layers=\(0, 1\).*not every layer"):
        _cfg(moe_dense_layers=(0, 1))
    with pytest.raises(ValueError, match=r"moe_dense_layers=\(0,\): only a mixture"):
        GPTConfig(hidden=16, layers=2, heads=4, seq=8, vocab=32, moe_dense_layers=(0,))
    assert _cfg(layers=4, moe_dense_layers=[2, 0, 2]).moe_dense_layers == (0, 2)


def test_cp_with_ep_rules():
    with pytest.raises(ValueError, match=r"ep=3 must be cp=2 times a divisor of dp=2"):
        ParallelConfig(global_batch=4, dp=2, ep=3, cp=2)
    with pytest.raises(ValueError, match=r"ep=2 must be tp=2 x cp=2 times a divisor"):
        ParallelConfig(global_batch=4, dp=2, ep=2, cp=2, tp=2, etp=1, sequence_parallel=True)
    par = ParallelConfig(global_batch=4, dp=2, ep=4, cp=2)
    assert par.mesh().shape == {"dp": 1, "pp": 1, "ep": 2, "cp": 2, "tp": 1}
    assert (par.expert_axes, par.expert_dp, par.token_split) == (("ep", "cp"), 1, 2)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_expert_parallelism_is_planned_with_two_gradient_groups(zero):
    """Every ZeRO stage runs with ep > 1 (tests/pipeline_parallel/test_zero.py: equal to
    the reference): the plan keeps the stage, and the job its expert-data-parallel group
    beside the dp group, which ZeRO shards the experts over."""
    par = ParallelConfig(global_batch=4, dp=2, ep=2, zero_stage=zero)
    job = GPT(_cfg()).train_job(par.mesh(), par)
    assert (int(par.zero_stage), job.zero_stage) == (zero, zero)
    assert job.expert_dp_axis is not None


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_experts_on_ep_1_equals_ddp(cluster_of, zero):
    """With ep 1 the experts are ordinary replicated parameters: ZeRO shards them over dp
    with the rest and trains exactly as DDP (and the reference)."""
    cfg = _cfg(cf=1.0)
    tokens, targets = _data(cfg)
    ddp = ParallelConfig(global_batch=B, dp=2)
    par = ParallelConfig(global_batch=B, dp=2, zero_stage=zero)
    model = GPT(cfg, seed=3)
    ref = model.fit_reference(tokens, targets, STEPS, lr=LR, parallel=ddp)
    run = model.fit(cluster_of(par.mesh()), tokens, targets, STEPS, parallel=par, lr=LR)
    _close(run.losses, ref.losses, "losses")
    for n in ref.params:
        _close(run.params[n], ref.params[n], f"param {n}")
