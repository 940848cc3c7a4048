"""plan_gpt's and plan gpt's MoE dispatcher and all-to-all overlap: every candidate with
ep > 1 takes the dispatcher given; the overlap where ParallelConfig's rule allows it for
that candidate, off elsewhere (the ``moe_comm_overlap`` column); flex across scale-up
domains sets ``moe_ep_node_ranks`` from the hardware; the replays run the candidates'
settings."""

import dataclasses
import json

import pytest

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.cli.main import main
from vcluster.planner.search import _flex_node_ranks, plan_gpt
from vcluster.planner.simulation import simulate_gpt
from vcluster.timing import load_hardware

pytestmark = pytest.mark.timeout(300)

H100 = "h100-dgx"
KEY = ["tp", "pp", "dp", "cp", "ep", "etp", "micro_batch", "schedule", "virtual_stages",
       "sequence_parallel", "recompute", "zero_stage"]
KW = dict(hidden=256, layers=4, heads=8, seq=128, vocab=1024, gpus=4, global_batch=8,
          hardware=H100, arch="llama", kv_heads=4, ffn_hidden=512, experts=8,
          recompute=("none", "full"), sequence_parallel=(False,),
          schedules=("1f1b", "interleaved_1f1b"), max_virtual_stages=2, micro_batches=(1,),
          max_tp=1, max_ep=4, replay=100, workers=1, progress=False)


def _allowed(r) -> bool:
    interleaved = r["schedule"] == "interleaved_1f1b" and r["virtual_stages"] >= 2
    return (r["ep"] > 1 and r["recompute"] != "full"
            and (interleaved or (r["pp"] == 1 and r["schedule"] == "1f1b")))


def test_overlap_where_the_rule_allows_it_and_never_slower():
    base = plan_gpt(**KW)
    over = plan_gpt(**KW, moe_comm_overlap=True)
    assert not base["moe_comm_overlap"].any()
    assert len(over) == len(base) and over["replayed"].all()     # no candidate refused
    assert over.attrs["moe_comm_overlap"] is True
    for _, r in over.iterrows():
        assert bool(r["moe_comm_overlap"]) == _allowed(r), dict(r)
    on = over[over["moe_comm_overlap"]]
    # pp 1 1f1b and pp 2 interleaved rows both run it; full recomputation and pp 2 1f1b not
    assert set(on["pp"]) == {1, 2} and set(on["ep"]) == {2, 4}
    assert ((over["ep"] > 1) & ~over["moe_comm_overlap"]).any()
    both = on.merge(base, on=KEY, suffixes=("", "_base"))
    assert len(both) == len(on)
    assert (both["step_time_s"] <= both["step_time_s_base"] * (1 + 1e-9)).all()
    assert (both["step_time_s"] < both["step_time_s_base"]).any()
    # rows it does not apply to are the same candidates as without it
    off = over[~over["moe_comm_overlap"]].merge(base, on=KEY, suffixes=("", "_base"))
    assert (off["step_time_s"] == off["step_time_s_base"]).all()


def test_flex_reaches_the_screen_and_the_replays():
    kw = dict(KW, recompute=("none",), schedules=("1f1b",))
    a2a, flex = plan_gpt(**kw), plan_gpt(**kw, moe_dispatcher="flex")
    both = flex.merge(a2a, on=KEY, suffixes=("", "_a2a"))
    assert len(both) == len(flex) == len(a2a) and flex["replayed"].all()
    moe = both["ep"] > 1
    assert moe.any() and (~moe).any()
    # top-k 2: flex sends a token once per destination rank, alltoall once per expert
    assert (both[moe]["step_time_s"] != both[moe]["step_time_s_a2a"]).all()
    assert (both[moe]["screen_step_time_s"] != both[moe]["screen_step_time_s_a2a"]).all()
    assert (both[~moe]["step_time_s"] == both[~moe]["step_time_s_a2a"]).all()
    # the replayed figure is simulate_gpt's of the flex candidate
    r = flex[flex["ep"] > 1].iloc[0]
    cfg = GPTConfig(hidden=256, layers=4, heads=8, seq=128, vocab=1024, arch="llama",
                    kv_heads=4, ffn_hidden=512, experts=8)
    par = ParallelConfig(global_batch=8, micro_batch=1, dp=int(r["dp"]), pp=int(r["pp"]),
                         ep=int(r["ep"]), zero_stage=int(r["zero_stage"]),
                         moe_dispatcher="flex")
    assert simulate_gpt(cfg, par, H100).step_time_s == pytest.approx(r["step_time_s"])
    assert simulate_gpt(cfg, dataclasses.replace(par, moe_dispatcher="alltoall"),
                        H100).step_time_s != pytest.approx(r["step_time_s"])


def test_flex_across_nodes_takes_the_ranks_per_domain():
    df = plan_gpt(**dict(KW, gpus=16, global_batch=16, experts=16, max_ep=16,
                         recompute=("none",), schedules=("1f1b",), replay=2),
                  moe_dispatcher="flex")
    for _, r in df.iterrows():      # h100-dgx: 8 GPUs per NVLink domain, tp 1
        want = 8 if r["ep"] > 8 else None
        assert r["moe_ep_node_ranks"] == want, dict(r)
    assert (df["ep"] == 16).any()
    hw = load_hardware(H100)
    par = ParallelConfig(global_batch=16, micro_batch=1, dp=16, ep=16, moe_dispatcher="flex")
    assert _flex_node_ranks(par, (hw,)).moe_ep_node_ranks == 8
    assert _flex_node_ranks(dataclasses.replace(par, moe_dispatcher="alltoall"),
                            (hw,)).moe_ep_node_ranks is None


def test_defaults_and_bad_values():
    base = plan_gpt(**dict(KW, replay=0))
    assert not base["moe_comm_overlap"].any() and base["moe_ep_node_ranks"].isna().all()
    with pytest.raises(ValueError, match=r"moe_dispatcher='deepep'.*alltoall, allgather, flex"):
        plan_gpt(**KW, moe_dispatcher="deepep")
    with pytest.raises(ValueError, match=r"moe_comm_overlap='yes'.*True or False"):
        plan_gpt(**KW, moe_comm_overlap="yes")


CLI = ["plan", "gpt", "--arch", "llama", "--hidden", "256", "--layers", "4", "--heads", "8",
       "--kv-heads", "4", "--ffn-hidden", "512", "--seq", "128", "--vocab", "1024",
       "--experts", "8", "--gpus", "4", "--global-batch", "8", "--max-ep", "4",
       "--max-tp", "1", "--hardware", H100, "--replay", "3",
       "--workers", "1", "--quiet"]


def test_cli_flags_print_and_json_the_column(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(CLI + ["--moe-dispatcher", "flex", "--moe-comm-overlap",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "a2a-ovl" in text and "MoE flex dispatcher" in text
    cands = json.loads(out.read_text())["candidates"]
    assert all(isinstance(c["moe_comm_overlap"], bool) for c in cands)
    assert any(c["moe_comm_overlap"] for c in cands)
    assert not any(c["moe_comm_overlap"] for c in cands if c["ep"] == 1)
    assert all("moe_ep_node_ranks" in c for c in cands)
    assert main(CLI + ["--json", str(out)]) == 0
    assert not any(c["moe_comm_overlap"] for c in json.loads(out.read_text())["candidates"])
    assert "a2a-ovl" not in capsys.readouterr().out


def test_cli_bad_dispatcher_names_the_flag_and_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(CLI + ["--moe-dispatcher", "deepep"])
    err = capsys.readouterr().err
    assert "--moe-dispatcher" in err and "deepep" in err
    assert all(v in err for v in ("alltoall", "allgather", "flex"))
