"""The long-context validation (vcluster.planner.validation_long_context): torchtitan's
published runs mapped to plans as the module docstring says, refused where the source is
silent, each predicted now and as first run, and summarised by sequence band."""

import pytest

from vcluster.cli.validate_model_cmd import _long_context_summary, _print_long_context
from vcluster.planner.validation_long_context import (BANDS, LONG_CONTEXT_TABLE, band_of,
                                                      row_config, summary_by_band,
                                                      validate_long_context)
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
    assert par.tp_overlap.value == "te" and par.sequence_parallel and par.zero_stage == 1
    assert par.attention.value == "flash2" and par.grad_reduce_dtype.value == "fp32"
    cfg, par, fp8, refused = row_config(_row("[P] arXiv 2410.06511 Table 5 row FSDP 2 CP 4"))
    assert (cfg.seq, par.cp, par.dp, par.zero_stage, par.recompute.value) == (
        131072, 4, 2, 3, "full")
    cfg, par, fp8, refused = row_config(_row("[P] arXiv 2410.06511 Table 1 row FSDP"))
    assert par.recompute.value == "selective" and not fp8
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


def test_the_section_prints(capsys):
    rows = validate_long_context(rows_of=lambda r: r["source_row"].startswith(
        "[P] arXiv 2410.06511 Table 5 row FSDP 4 CP 2"))
    _print_long_context(_long_context_summary(LONG_CONTEXT_TABLE, rows))
    out = capsys.readouterr().out
    assert "long context and overlapped TP (torchtitan_long_context.csv, held_out): 1 of 1" \
        in out and ">=64K" in out and "first run" in out

