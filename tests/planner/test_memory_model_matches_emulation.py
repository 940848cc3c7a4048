"""Issue 28's memory line: the peaks the emulated GPT program records (``cluster.stats()``'s
peak_params/grads/optimizer/activations_bytes, per rank) match the memory model's
breakdown under the emulated program's precision policy (fp64, Adam: 8 + 8 + 16 bytes per
parameter, the activations counted tensor by tensor as the program saves them), for
ZeRO stages 0-3 at pp = 1 and stages 0-1 with pp = 2 and tp = 2; and issue 26's
precision policies: Megatron's 18 bytes per parameter stays the default, PyTorch AMP's
is 16, a bad name is refused naming the choices."""

import json

import pytest

from pipeline_parallel.gpt import GPT, GPTConfig, ParallelConfig
from vcluster.cli.main import main
from vcluster.planner.memory import gpt_memory, rank_memory
from vcluster.planner.precision import PRECISIONS, PrecisionPolicy, precision_policy
from vcluster.planner.simulation import gpt_schedule

from ..pipeline_parallel.gpt_data import mesh_of, token_data

pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig(hidden=32, layers=4, heads=4, seq=16, vocab=64)      # fp64
KINDS = ("params", "grads", "optimizer", "activations")
# (mesh, ZeRO stages, other ParallelConfig fields); 2 micro-batches of 2 per dp rank
CASES = [("dp2", (0, 1, 2, 3), {}),
         ("dp4", (0, 1, 2, 3), {}),
         ("dp2 pp2", (0, 1), {}),
         ("dp2 tp2", (0, 1, 2, 3), {}),
         ("dp2 pp2 tp2", (0, 1), {}),
         ("dp2 pp2", (0,), {"schedule": "gpipe"}),
         ("dp2 tp2", (1,), {"sequence_parallel": True}),
         ("dp2 pp2", (1,), {"recompute": "full"}),
         ("dp2", (0,), {"recompute": "selective"})]


def _model(cfg, par, rank_pp: int, policy) -> dict:
    """The model's figures for a rank at pipeline position ``rank_pp``, by ledger kind: the
    ledger counts the logits' gradient the program holds among the activations."""
    m = gpt_memory(cfg, par, gpt_schedule(par), precision=policy)[rank_pp]
    return {"params": m.params_bytes, "grads": m.grads_bytes,
            "optimizer": m.optimizer_bytes,
            "activations": m.activations_bytes + m.logits_bytes}


def _emulate(cluster_of, spec: str, zero: int, extra: dict, cfg=CFG, optimizer="adam"):
    mesh = mesh_of(spec)
    dp = dict(mesh.shape)["dp"]
    par = ParallelConfig(global_batch=4 * dp, micro_batch=2, zero_stage=zero,
                         **dict(mesh.shape), **extra)
    cluster = cluster_of(mesh)
    cluster.reset_stats()
    tokens, targets = token_data(cfg, par.global_batch)
    GPT(cfg, seed=0).fit(cluster, tokens, targets, steps=1, parallel=par, optimizer=optimizer,
                         lr=0.01)
    return mesh, par, cluster.stats()


@pytest.mark.parametrize("spec, stages, extra", CASES,
                         ids=[f"{s.replace(' ', '-')}-z{''.join(map(str, z))}"
                              + "".join(f"-{v}" for v in e.values()) for s, z, e in CASES])
def test_every_peak_within_5_percent_of_the_model(cluster_of, spec, stages, extra):
    policy = PrecisionPolicy.emulated(CFG.dtype, "adam")
    assert policy == PRECISIONS["fp64"]
    for zero in stages:
        mesh, par, st = _emulate(cluster_of, spec, zero, extra)
        for rank in range(mesh.size):
            pos = mesh.group("pp", rank).index(rank) if "pp" in mesh.axes else 0
            want = _model(CFG, par, pos, policy)
            got = {k: int(st[f"peak_{k}_bytes"][rank]) for k in KINDS}
            for k in KINDS:
                assert want[k] == pytest.approx(got[k], rel=0.05), (
                    f"{spec} zero={zero} {extra} rank {rank}: {k} model {want[k]} vs "
                    f"emulated {got[k]}")


def test_the_count_is_derived_not_fitted_it_agrees_to_the_byte(cluster_of):
    """The emulator's count is the program's saved tensors, so it matches exactly (the
    ZeRO paddings included), ZeRO-3's params at dp = 4 as much as DDP's activations."""
    for spec, zero in (("dp4", 3), ("dp2 pp2 tp2", 1)):
        mesh, par, st = _emulate(cluster_of, spec, zero, {})
        for rank in range(mesh.size):
            pos = mesh.group("pp", rank).index(rank) if "pp" in mesh.axes else 0
            want = _model(CFG, par, pos, "fp64")
            assert want == {k: int(st[f"peak_{k}_bytes"][rank]) for k in KINDS}, (spec, rank)


def test_fp32_with_sgd_is_its_own_policy(cluster_of):
    """float32 and SGD (one momentum slot): 4 + 4 + 4 bytes per parameter, 4-byte
    activations — the policy PrecisionPolicy.emulated("float32", "sgd")."""
    cfg = GPTConfig(hidden=32, layers=2, heads=4, seq=16, vocab=64, dtype="float32")
    policy = PrecisionPolicy.emulated("float32", "sgd")
    assert (policy.name, policy.bytes_per_param, policy.activation_bytes) == ("fp32-sgd", 12, 4)
    for zero in (0, 3):
        mesh, par, st = _emulate(cluster_of, "dp2 tp2", zero, {}, cfg, "sgd")
        for rank in range(mesh.size):
            want = _model(cfg, par, 0, policy)
            got = {k: int(st[f"peak_{k}_bytes"][rank]) for k in KINDS}
            assert want == pytest.approx(got, rel=0.05), (zero, rank, want, got)


def test_the_emulated_zero_stages_shrink_every_part_they_shard(cluster_of):
    """In the emulated program too: ZeRO 0 > 1 > 2 > 3 in total, and ZeRO-3 holds the
    optimizer state over dp, the params and grads over dp plus the modules held whole."""
    totals, peaks = [], {}
    for zero in (0, 1, 2, 3):
        _, _, st = _emulate(cluster_of, "dp4", zero, {})
        peaks[zero] = {k: int(st[f"peak_{k}_bytes"][0]) for k in KINDS}
        totals.append(sum(peaks[zero].values()))
    assert totals[0] > totals[1] > totals[2] > totals[3], totals
    layer = (12 * CFG.hidden ** 2 + 13 * CFG.hidden) * 8        # the largest module, fp64
    assert peaks[3]["optimizer"] == pytest.approx(peaks[0]["optimizer"] / 4, abs=64)
    assert peaks[3]["params"] == pytest.approx(peaks[0]["params"] / 4 + 2 * layer, abs=64)
    assert peaks[3]["grads"] == pytest.approx(peaks[0]["grads"] / 4 + layer, abs=64)


# --- the precision policies -----------------------------------------------------------
BIG = GPTConfig(hidden=1024, layers=8, heads=16, seq=512, vocab=32000)


def test_policies_bytes_per_parameter():
    assert {n: p.bytes_per_param for n, p in PRECISIONS.items()} == {
        "megatron": 18, "megatron_bf16": 16, "torch_amp": 16, "torch_compile": 16, "fp64": 32,
        "fp32": 16}
    assert PrecisionPolicy.emulated("float32", "sgd").optimizer_bytes == 4   # momentum slot
    assert "18 B/param" not in str(PRECISIONS["megatron"])    # says 2+4+12
    assert str(PRECISIONS["megatron"]).startswith("megatron (2+4+12 B/param")


def test_megatron_is_the_default_and_torch_amp_moves_bytes_from_optimizer_to_weights():
    """torch_amp: fp32 weights (2x Megatron's bf16), 8 of Megatron's 12 optimizer bytes,
    the same fp32 gradients (1F1B with m > in flight: they coexist with the activations),
    and its own count of what PyTorch saves (tests/planner/test_torch_amp_memory.py)."""
    from vcluster.planner.memory import torch_amp_activation_bytes
    par = ParallelConfig(global_batch=8, micro_batch=2, pp=2, tp=2)
    sched = gpt_schedule(par)
    default = gpt_memory(BIG, par, sched)
    assert default == gpt_memory(BIG, par, sched, precision="megatron")
    amp = gpt_memory(BIG, par, sched, precision="torch_amp")
    for r, (d, a) in enumerate(zip(default, amp)):
        assert a.params_bytes == pytest.approx(2 * d.params_bytes, abs=2)
        assert a.optimizer_bytes == pytest.approx(d.optimizer_bytes * 8 / 12, abs=2)
        assert a.grads_bytes == d.grads_bytes
        per_mb, logits = torch_amp_activation_bytes(BIG, par, r)
        assert a.activations_bytes == int((2 - r) * per_mb)       # min(m, p - r) in flight
        assert a.logits_bytes == int(12 * logits)                 # 0 off the last stage


def test_bad_policies_are_refused_by_name():
    with pytest.raises(ValueError, match=r"precision must be one of \('megatron', "
                                         r"'megatron_bf16', 'torch_amp', 'torch_compile', "
                                         r"'fp64', 'fp32'\).*'bf16'"):
        precision_policy("bf16")
    with pytest.raises(ValueError, match=r"gemm_input_bytes=2\.5 .*needs activation_count "
                                         r"'korthikanti' and a size in \(0, 2\) bytes"):
        PrecisionPolicy("x", 2, 2, 12, 2, 4, gemm_input_bytes=2.5)
    with pytest.raises(ValueError, match="gemm_input_bytes=1 .*needs activation_count"):
        PrecisionPolicy("x", 4, 4, 8, 2, 12, "torch_amp", gemm_input_bytes=1)
    with pytest.raises(ValueError, match="activation_count='korthikanti' is a 16-bit"):
        PrecisionPolicy("x", 4, 4, 8, 4, 4)
    with pytest.raises(ValueError, match="activation_count must be one of"):
        PrecisionPolicy("x", 4, 4, 8, 2, 4, "guess")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        PrecisionPolicy.emulated("float64", "lion")
    llama = GPTConfig(hidden=64, layers=2, heads=4, seq=16, vocab=64, arch="llama")
    with pytest.raises(ValueError, match="dense GPT without context parallelism"):
        rank_memory(llama, ParallelConfig(global_batch=2), 0, 1, precision="fp64")


def test_simulate_gpt_precision_flag(tmp_path, capsys):
    model = ["simulate", "gpt", "--hidden", "1024", "--layers", "8", "--heads", "16",
             "--seq", "512", "--vocab", "32000", "--dp", "4", "--global-batch", "8",
             "--hardware", "h100-dgx"]
    docs = {}
    for name in ("megatron", "megatron_bf16", "torch_amp", "fp32"):
        path = tmp_path / f"{name}.json"
        assert main(model + ["--precision", name, "--json", str(path)]) == 0
        docs[name] = json.loads(path.read_text())
        assert docs[name]["precision"] == name
    assert f"{'megatron'} precision" in capsys.readouterr().out
    path = tmp_path / "default.json"
    assert main(model + ["--json", str(path)]) == 0
    assert json.loads(path.read_text())["memory"] == docs["megatron"]["memory"]
    m, a = docs["megatron"]["memory"][0], docs["torch_amp"]["memory"][0]
    assert a["params_bytes"] == pytest.approx(2 * m["params_bytes"], abs=2)
    # bf16 main gradients (Megatron-Bridge's grad_reduce_in_fp32=False): half the
    # gradients' bytes, the rest as Megatron's
    b16 = docs["megatron_bf16"]["memory"][0]
    assert b16["grads_bytes"] == pytest.approx(m["grads_bytes"] / 2, abs=2)
    for key in ("params_bytes", "optimizer_bytes", "activations_bytes"):
        assert b16[key] == m[key], key
    assert main(model + ["--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert ("--precision must be one of megatron, megatron_bf16, torch_amp, torch_compile, "
            "fp64, fp32, got 'bf16'") in err


def test_plan_gpt_precision_flag(tmp_path, capsys):
    """plan gpt --precision: each candidate's peak is the chosen policy's model (PyTorch
    AMP: 16 bytes a parameter, its own activation count, per-step gradients); the JSON and
    the header say which; a bad name is refused."""
    from vcluster.planner.screen import peak_memory_bytes
    cli = ["plan", "gpt", "--hidden", "1024", "--layers", "12", "--heads", "16", "--seq",
           "512", "--vocab", "32000", "--gpus", "8", "--global-batch", "64", "--quiet",
           "--replay", "0"]
    docs = {}
    for name in ("megatron", "torch_amp"):
        path = tmp_path / f"{name}.json"
        assert main(cli + ["--precision", name, "--json", str(path)]) == 0
        docs[name] = json.loads(path.read_text())
        assert docs[name]["precision"] == name
        assert f"memory in {name} precision" in capsys.readouterr().out
    peak = {n: {(c["tp"], c["pp"], c["dp"], c["micro_batch"], c["schedule"], c["recompute"],
                 c["sequence_parallel"], c["zero_stage"], c["virtual_stages"]):
                c["peak_memory_gb"]
                for c in d["candidates"]} for n, d in docs.items()}
    cfg = GPTConfig(hidden=1024, layers=12, heads=16, seq=512, vocab=32000)
    for name, table in peak.items():
        assert table
        for (tp, pp, dp, b, schedule, recompute, sp, zero, v), gb in table.items():
            par = ParallelConfig(global_batch=64, micro_batch=b, tp=tp, pp=pp, dp=dp,
                                 schedule=schedule, recompute=recompute,
                                 sequence_parallel=sp, zero_stage=zero, virtual_stages=v)
            assert gb == pytest.approx(peak_memory_bytes(cfg, par, name) / 1e9, rel=1e-6)
    both = peak["megatron"].keys() & peak["torch_amp"].keys()
    assert both and any(peak["torch_amp"][k] != peak["megatron"][k] for k in both)
    assert main(cli + ["--precision", "fp16"]) == 2
    assert ("--precision must be one of megatron, megatron_bf16, torch_amp, torch_compile, "
            "fp64, fp32, got 'fp16'") in capsys.readouterr().err
