"""The ``torch_amp`` memory count (issue 26): what plain PyTorch under bf16 autocast holds,
checked against the tensors PyTorch's autograd really saves for the reference program
(:mod:`vcluster.gpu.gpt_step`, run on the CPU with ``saved_tensors_hooks``), and the peak
of a step whose ``.grad`` is set to None between steps."""

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.planner.memory import (gpt_memory, in_flight_after_first_backward, rank_memory,
                                     torch_amp_activation_bytes)
from vcluster.planner.precision import PRECISIONS, PrecisionPolicy
from vcluster.planner.simulation import gpt_schedule

torch = pytest.importorskip("torch", reason="the saved-tensor check runs PyTorch (vcluster[torch])")

AMP = PRECISIONS["torch_amp"]


def saved_forward(model, step, tokens, targets):
    """(bytes of the distinct non-parameter storages autograd saves while ``step`` — the
    reference ``model`` or its compiled form — runs the forward under CPU bf16 autocast,
    the loss)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(tokens, targets)
    return sum(saved.values()) - loss.element_size(), loss   # less the loss scalar's total_weight


def _saved_bytes(hidden, layers, heads, seq, vocab, batch) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in the forward."""
    from vcluster.gpu.gpt_step import _model
    torch.manual_seed(0)
    model = _model(torch, hidden, layers, heads, seq, vocab)
    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return saved_forward(model, model, tokens, targets)[0]


@pytest.mark.parametrize("hidden,layers,heads,seq,vocab,batch", [
    (64, 1, 4, 32, 100, 3), (64, 2, 4, 32, 100, 1), (32, 3, 2, 16, 50, 2),
    (96, 2, 6, 24, 77, 4)])
def test_the_count_equals_what_autograd_saves(hidden, layers, heads, seq, vocab, batch):
    """Per micro-batch (activations, the autocast weight casts, the ends) plus the saved
    fp32 log-softmax (``logits_saved_bytes`` per logit) equal the saved storages' bytes."""
    cfg = GPTConfig(hidden=hidden, layers=layers, heads=heads, seq=seq, vocab=vocab)
    per_mb, logits = torch_amp_activation_bytes(
        cfg, ParallelConfig(global_batch=batch, micro_batch=batch), 0)
    assert logits == batch * seq * vocab
    assert per_mb + AMP.logits_saved_bytes * logits == \
        _saved_bytes(hidden, layers, heads, seq, vocab, batch)


def test_one_micro_batch_peaks_at_the_larger_moment_not_the_sum():
    """``.grad`` set to None between steps: the first backward starts with the activations
    and no gradients; once it has run, the gradients and no activations (m = 1)."""
    short, long = (GPTConfig(hidden=2048, layers=24, heads=16, seq=s, vocab=51200)
                   for s in (128, 2048))
    small, big = (ParallelConfig(global_batch=b, micro_batch=b) for b in (1, 8))
    for cfg, par, at_start in ((short, small, False), (long, big, True)):
        mem = rank_memory(cfg, par, 0, 1, precision=AMP)
        per_mb, logits = torch_amp_activation_bytes(cfg, par, 0)
        assert (mem.grads_bytes == 0) == at_start
        assert mem.activations_bytes == (int(per_mb) if at_start else 0)
        assert mem.logits_bytes == (int(AMP.logits_bytes * logits) if at_start else 0)
    persistent = PrecisionPolicy("amp-persistent", 4, 4, 8, 2, 12, "torch_amp",
                                 logits_saved_bytes=4, weight_copy_bytes=2)
    both = rank_memory(short, small, 0, 1, precision=persistent)
    assert both.grads_bytes > 0 and both.activations_bytes > 0
    assert both.total_bytes > rank_memory(short, small, 0, 1, precision=AMP).total_bytes


@pytest.mark.parametrize("schedule,m,p", [("1f1b", 2, 4), ("1f1b", 4, 4), ("1f1b", 8, 4),
                                          ("gpipe", 3, 2), ("gpipe", 1, 2)])
def test_in_flight_after_the_first_backward_follows_the_schedule(schedule, m, p):
    """The closed form equals the schedule's own count of sets alive after each rank's
    first backward (pipelining's in_flight_profile)."""
    from pipelining.ideal_timing import in_flight_profile, peak_in_flight
    from pipelining import ActionKind
    par = ParallelConfig(global_batch=m, micro_batch=1, pp=p, schedule=schedule)
    sched = gpt_schedule(par)
    for r in range(p):
        actions = list(sched[r])
        first_b = next(i for i, a in enumerate(actions) if a.kind is ActionKind.B)
        profile = in_flight_profile(sched, r)
        after = max([profile[i] for i in range(first_b + 1, len(actions))
                     if actions[i].kind is ActionKind.F] + [profile[first_b]])
        assert in_flight_after_first_backward(par, peak_in_flight(sched, r)) == after


def test_pipeline_ranks_hold_gradients_beside_their_steady_state():
    """1F1B with more micro-batches than a rank holds: gradients and the full in-flight
    activations coexist after the first backward (the additive peak), each breakdown
    the larger of the two moments."""
    cfg = GPTConfig(hidden=256, layers=8, heads=4, seq=128, vocab=1000)
    par = ParallelConfig(global_batch=8, micro_batch=1, pp=4)
    for mem in gpt_memory(cfg, par, gpt_schedule(par), precision="torch_amp"):
        assert mem.grads_bytes > 0 and mem.activations_bytes > 0


def test_other_models_are_refused_by_name():
    llama = GPTConfig(hidden=64, layers=2, heads=4, seq=16, vocab=64, arch="llama")
    with pytest.raises(ValueError, match="dense GPT without context parallelism.*megatron"):
        rank_memory(llama, ParallelConfig(global_batch=2), 0, 1, precision="torch_amp")
    with pytest.raises(ValueError, match="grads_persistent must be a bool"):
        PrecisionPolicy("x", 4, 4, 8, 2, 12, "torch_amp", grads_persistent=1)
    with pytest.raises(ValueError, match="activation_count='torch_amp' is a 16-bit"):
        PrecisionPolicy("x", 4, 4, 8, 4, 12, "torch_amp")
