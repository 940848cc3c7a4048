"""The long-context validation (vcluster.planner.validation_long_context): torchtitan's
published runs mapped to plans as the module docstring says, refused where the source is
silent, each predicted now and as first run, and summarised by sequence band."""

import pytest

from vcluster.cli.validate_model_cmd import _long_context_summary, _print_long_context
from vcluster.planner.validation_long_context import (BANDS, GPU_SWEEP_TABLE,
                                                      LONG_CONTEXT_TABLE, META_H100_GEMMS,
                                                      band_of, meta_h100_device, row_config,
                                                      summary_by_band, validate_gpu_sweep,
                                                      validate_long_context)
from vcluster.timing.presets import hardware_from_dict, preset
from vcluster.timing import read_data_csv

pytestmark = pytest.mark.timeout(600)

ROWS = read_data_csv(LONG_CONTEXT_TABLE)[1]


def _row(source_row_start):
    return next(r for r in ROWS if r["source_row"].startswith(source_row_start))


def test_every_row_has_its_source_and_a_consistent_layout():
    assert len(ROWS) >= 40
    for r in ROWS:
        assert r["source_row"] and r["gpu"] in ("h100-sxm-hbm2e", "h200-sxm")
        assert int(r["gpus"]) == int(r["fsdp"]) * int(r["tp"]) * int(r["pp"]) * int(r["cp"])


def test_rows_become_the_plans_torchtitan_ran():
    cfg, par, fp8, refused = row_config(_row("[A] asyncTP_llama3_h100_2025-06 70B table "
                                             "float8 tensorwise async TP"))
    assert not refused and fp8 and (par.tp, par.dp, par.gpus) == (8, 32, 256)
    assert par.tp_overlap.value == "te" and par.sequence_parallel and par.zero_stage == 3
    assert par.attention.value == "flash2" and par.grad_reduce_dtype.value == "fp32"
    cfg, par, fp8, refused = row_config(_row("[P] arXiv 2410.06511 Table 5 row FSDP 2 CP 4"))
    assert (cfg.seq, par.cp, par.dp, par.zero_stage, par.recompute.value) == (
        131072, 4, 2, 3, "full-torch")          # PyTorch's checkpoint: stops before W_down
    cfg, par, fp8, refused = row_config(_row("[P] arXiv 2410.06511 Table 1 row FSDP"))
    assert par.recompute.value == "op" and not fp8          # torchtitan's per-op policy
    _, par, _, refused = row_config(_row("[P] arXiv 2410.06511 Table 4 row 1F1B"))
    assert par is None and refused == ["micro_batch='': the source does not state the "
                                       "micro-batch"]


def test_bands():
    assert [band_of(s) for s in (2048, 4096, 8192, 16384, 32768, 65536, 262144, 6000)] == [
        "<=4K", "<=4K", "8-16K", "8-16K", "32K", ">=64K", ">=64K", ""]
    assert [b[0] for b in BANDS] == ["<=4K", "8-16K", "32K", ">=64K"]


def test_rows_are_predicted_now_and_as_first_run_and_summarised():
    """Two context-parallel rows and one async-TP row: each predicted twice (now, and with
    fused attention at the GEMM rate and no TE overlap, as before issue 54); the
    long-context rows' first run was faster (the flat rate priced their attention too
    cheaply); the summary and the printed section carry both."""
    keep = {"[P] arXiv 2410.06511 Table 5 row FSDP 4 CP 2 (= [D] Table 2)",
            "[P] arXiv 2410.06511 Table 5 row FSDP 8 CP 1 (= [D] Table 2)",
            "[P] arXiv 2410.06511 Table 4 row 1F1B"}
    rows = validate_long_context(rows_of=lambda r: r["source_row"] in keep)
    assert [r["status"] for r in rows] == ["refused", "predicted", "predicted"]
    for r in rows[1:]:
        assert r["first_run"] > r["predicted"] > 0
        assert r["rel_error"] == pytest.approx(r["predicted"] / r["published"] - 1)
    by_band = summary_by_band(rows)
    assert by_band["32K"]["rows"] == by_band[">=64K"]["rows"] == 1 and by_band["<=4K"] is None
    summary = _long_context_summary(LONG_CONTEXT_TABLE, rows)
    assert summary["predicted"] == 2 and summary["refused"] == 1
    assert summary["first_run_mean_abs_rel_error"] > summary["mean_abs_rel_error"]


def test_metas_500w_h100_prices_the_gemms_measured_on_it():
    """Meta's H100 (the H100 rows' device): the DGX H100 with 96 GB of HBM2e and the
    compute speed its 500 W limit leaves, from GEMMs measured on a 500 W H100 (FBGEMM pull
    request 2546) — each of those GEMMs priced within 5% of its measured rate (the ratio is
    their mean), the datasheet peak (MFU's) kept, and the ratios below the datasheet
    part's."""
    device = hardware_from_dict({"base": "h100-dgx", "device": meta_h100_device()}).device
    full = preset("h100-dgx").device
    assert device.hbm_bandwidth_gbps == 2400.0 and device.peak_flops("bf16") == \
        full.peak_flops("bf16")
    assert 0.6 < device.sustained_ratio("bf16") < device.sustained_ratio("fp8") < 1.0
    for m, k, n, dtype, tflops in META_H100_GEMMS:
        priced = 2 * m * k * n / device.matmul_time_s(m, k, n, dtype) / 1e12
        assert priced == pytest.approx(tflops, rel=0.05)


@pytest.mark.slow
def test_the_table_stays_where_the_model_puts_it():
    """Every row of the table, held out: issue 54's goals, mean |error| <= 12% and every
    band's mean signed error within ±10% (11.5%; bands -8.1%, -4.8%, +5.4%). They held at
    11.8% until fused attention came to be priced by the work of its kernels and the
    optimizer step by the bytes it moves (12.8%, the >=64K band at +10.8%); since then the
    row-wise rows' GEMMs run PyTorch's row-scaled kernel (``fp8-row``: 11.8%) and the
    context-parallel rows PyTorch's ring (``torch_cp``: 11.5%, the >=64K band +5.4%). The
    two H200 rows (standard 700 W parts) within 5% (they were within 2% before; the
    one-GPU sweep below names the cost now over-priced: GEMMs); the four row-wise rows
    (held out from the share) within 16% (-1.9%, +3.0%, +13.4%, +15.5%), where they were
    +10% to +24%."""
    rows = [r for r in validate_long_context() if r["status"] == "predicted"]
    assert len(rows) == 35
    assert sum(abs(r["rel_error"]) for r in rows) / len(rows) <= 0.12
    rowwise = [r for r in rows if "rowwise" in r["source_row"]]
    assert len(rowwise) == 4 and all(abs(r["rel_error"]) <= 0.16 for r in rowwise)
    for band, summary in summary_by_band(rows).items():
        assert summary is None or abs(summary["mean_signed"]) <= 0.10, (band, summary)
    assert all(abs(r["rel_error"]) <= 0.05 for r in rows if r["hardware"] == "h200-dgx")


def test_the_section_prints(capsys):
    rows = validate_long_context(rows_of=lambda r: r["source_row"].startswith(
        "[P] arXiv 2410.06511 Table 5 row FSDP 4 CP 2"))
    _print_long_context(_long_context_summary(LONG_CONTEXT_TABLE, rows))
    out = capsys.readouterr().out
    assert "long context and overlapped TP (torchtitan_long_context.csv, held_out): 1 of 1" \
        in out and ">=64K" in out and "first run" in out



def test_the_one_gpu_sequence_sweep_is_within_ten_percent_in_every_band(capsys):
    """This project's H200 sweep of Llama 3.1 8B's and 70B's layers (2K-32K tokens, eager
    and compiled, torchtitan's checkpointing modes; held out): every band's mean signed
    error within ±10% (issue 54's goal), the attention's cost by sequence now tracking the
    measured steps where the first run's flat rate drifted (+24% at 32K), each compiled
    row within 5%, and torchtitan's ``op`` priced, over no checkpointing, near the measured
    compiled cost and below the eager one."""
    rows = validate_gpu_sweep()
    assert len(rows) == len(read_data_csv(GPU_SWEEP_TABLE)[1]) == 23
    assert all(r["status"] == "predicted" and r["role"] == "held_out" for r in rows)
    for r in rows:
        assert r["published"] == pytest.approx(
            int(r["case"].split("b=")[1].split()[0]) * r["seq"] / (r["step_ms"] / 1e3))
    now, first = summary_by_band(rows), summary_by_band(rows, "first_run_error")
    for band in ("<=4K", "8-16K", "32K"):
        assert abs(now[band]["mean_signed"]) <= 0.10, (band, now[band])
    assert first["32K"]["mean_signed"] > 0.2 > now["32K"]["mean_signed"]
    assert all(abs(r["rel_error"]) <= 0.10 for r in rows if r["compiled"])

    def step(case, key):
        return next(r[key] for r in rows if r["case"].startswith(case))
    for model in ("8b shapes, 4 layers", "70b shapes, 2 layers"):
        for how in ("eager", "compiled"):
            case = f"llama3.1-{model}, s=8K b=1 {how} AC="
            measured = step(case + "op", "step_ms") / step(case + "none", "step_ms")
            predicted = step(case + "op", "predicted_step_ms") / step(
                case + "none", "predicted_step_ms")
            assert 1.0 < predicted and 1.0 < measured < 1.12
            if how == "compiled":
                assert predicted == pytest.approx(measured, abs=0.02), model
        case = f"llama3.1-{model}, s=8K b=1 eager AC="
        assert step(case + "op", "predicted_step_ms") < step(case + "full",
                                                             "predicted_step_ms")
    _print_long_context(_long_context_summary(GPU_SWEEP_TABLE, rows), "one-GPU sweep")
    out = capsys.readouterr().out
    assert "one-GPU sweep (h200_llama_steps.csv, held_out): 23 of 23" in out and "32K" in out


def test_the_sweeps_step_by_kernel_kind_against_its_profile():
    """The compiled 8B-shapes step (4 layers, 8K tokens) as PyTorch's profiler saw it on the
    H200 (benchmarks/results/h200-2026-11-30/profile-8b-compiled.json: busy time by kernel
    kind) against the model's price of the same step's kernels, kind by kind: the fused
    AdamW step (16.9 ms measured) and the FlashAttention-2 kernels (30.6 ms) within 15%,
    and the GEMMs over-priced by exactly the training-kernel efficiency: priced at 0.75 of
    the device's achieved GEMM rate, they ran at it (the model's GEMM time x 0.75 within 5%
    of the measured 88.9 ms). That divisor is what keeps the sweep's rows 4-10% slow."""
    import json
    from collections import defaultdict
    from pathlib import Path
    from pipeline_parallel.gpt import GPTConfig, ParallelConfig
    from vcluster.planner import simulation as S
    from vcluster.planner.precision import MEGATRON
    from vcluster.planner.validation_long_context import GPU_SWEEP_HARDWARE
    from vcluster.runtime.tracing import TraceCompute
    from vcluster.timing import load_hardware
    from vcluster.timing.hardware_model import TRAINING_KERNEL_EFFICIENCY, HardwareCostModel
    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-2026-11-30"
            / "profile-8b-compiled.json")
    profile = json.loads(path.read_text())
    assert profile["compiled"] and profile["model"]["seq"] == 8192
    measured = profile["steps"][0]["busy_ms_by_kind"]
    m = profile["model"]
    cfg = GPTConfig(hidden=m["hidden"], layers=m["layers"], heads=m["heads"], seq=m["seq"],
                    vocab=m["vocab"], arch="llama", kv_heads=profile["llama"]["kv_heads"],
                    ffn_hidden=profile["llama"]["ffn_hidden"])
    par = ParallelConfig(global_batch=1, attention="flash2")
    costs = HardwareCostModel(load_hardware(GPU_SWEEP_HARDWARE), attention_kernel="flash2")
    reps, _ = S._short_layout(par, cfg.layers, S.TRACED_POSITIONS)
    _, raw = S._short_templates(cfg, par, reps, S.ADAM,
                                optimizer_step_bytes=MEGATRON.optimizer_step_bytes)
    priced = defaultdict(float)
    t = raw[0][0]
    for op in (op for body in [*t.bodies.values(), t.tail] for op in body):
        if isinstance(op, TraceCompute) and op.contains == 0 and op.kernel is not None:
            priced[op.kernel.kind.value] += costs.compute_time_s(op) * 1e3
    assert priced["optimizer"] == pytest.approx(measured["optimizer"], rel=0.15)
    assert priced["attention"] == pytest.approx(measured["attention"], rel=0.15)
    assert priced["gemm"] > 1.25 * measured["gemm"]
    assert priced["gemm"] * TRAINING_KERNEL_EFFICIENCY == pytest.approx(measured["gemm"],
                                                                        rel=0.05)
