"""The timing model against published training throughput and collectives on the hardware
of 2026 (Blackwell DGX and NVL72, AMD Instinct): every row mapped, simulated or refused
with its reason, the errors reported by GPU kind and role."""

import json

import pytest

from vcluster.planner.validation_2026 import (CONTAINER_CUDNN, FIT_ROWS, PRECISION_FORMATS,
                                              SYSTEM_PRESETS, TABLES_2026, row_attention,
                                              row_config, row_precision, summary_by_kind,
                                              validate_2026)
from vcluster.timing import read_data_csv
from vcluster.timing.gemm_formats import GEMM_FORMATS

pytestmark = pytest.mark.timeout(600)


def test_every_row_maps_to_a_preset_and_a_format():
    for table in TABLES_2026:
        for r in read_data_csv(table)[1]:
            assert r["system"] in SYSTEM_PRESETS, r["system"]
            assert r["precision"] in PRECISION_FORMATS, r["precision"]
            assert PRECISION_FORMATS[r["precision"]] in (None, *GEMM_FORMATS)
    keys = {(t, r["model"], r["system"], r["precision"], r["release"])
            for t in TABLES_2026 for r in read_data_csv(t)[1]}
    assert FIT_ROWS <= keys


def test_a_row_config_is_the_published_layout():
    rows = read_data_csv("megatron_bridge_blackwell.csv")[1]
    r = next(r for r in rows if r["model"] == "LLAMA3.1_405B" and r["system"] == "DGX-GB300"
             and r["precision"] == "NVFP4" and r["latest"] == "1")
    cfg, par, fmt, assumed, refusals = row_config(r)
    assert refusals == [] and assumed == [] and fmt == "nvfp4"
    assert (par.tp, par.pp, par.dp, par.virtual_stages, par.global_batch) == (4, 8, 8, 4, 1536)
    assert sum(par.stage_layers(cfg.layers)) == 126 == cfg.layers
    amd = read_data_csv("amd_instinct_training.csv")[1]
    cfg, par, fmt, assumed, refusals = row_config(amd[0])          # no global batch, no pp
    assert par.microbatches == 1 and "one micro-batch per step" in assumed[0]
    *_, refusals = row_config(amd[3])                              # pp 4: the bubble
    assert "global_batch" in refusals[0]


def test_published_layouts_with_an_end_stage_of_no_layer_are_replayed():
    """Llama 3.1 405B's 126 layers on pp 16 x vp 8 (0, 1 x 126, 0: the embedding and the
    head each a stage of their own) and DeepSeek-V3's 61 on pp 8 x vp 4 (1, 2 x 30, 0:
    Megatron-Bridge's layout "Et|(tt|)*30mL") run as published: refused before
    2026-12-01, now mapped with no refusal."""
    rows = read_data_csv("megatron_bridge_blackwell.csv")[1]
    for model, system, precision, split in (
            ("LLAMA3.1_405B", "DGX-GB200", "MXFP8", (0,) + (1,) * 126 + (0,)),
            ("DeepSeekV3 (w/o MTP)", "DGX-GB200", "FP8-MX", (1,) + (2,) * 30 + (0,))):
        r = next(r for r in rows if r["model"] == model and r["system"] == system
                 and r["precision"] == precision and r["latest"] == "1")
        cfg, par, _, _, refusals = row_config(r)
        assert refusals == [], refusals
        assert par.stage_layers(cfg.layers) == split


def test_a_rows_attention_is_its_containers_cudnn_on_its_silicon():
    """A row's cuDNN attention is priced by the published release nearest the one its NeMo
    container ships, among the GPUs of the same silicon: a 25.11 GB200 row (cuDNN 9.13.1)
    by B200's 9.13.1 curves, a 26.04.01 B200 row (9.20.0) by GB200's 9.19.1, a 26.06 GB300
    row (9.21.1) by GB300's 9.22.0, a 25.11 B300 row by GB300's nearest, 9.19.1; a
    container whose release is not published (26.08, NeMo 2.0's) or an AMD row keep the
    preset's default, and each choice is written into the row's ``assumed``."""
    assert CONTAINER_CUDNN["25.11"] == "9.13.1" and CONTAINER_CUDNN["26.04"] == "9.20.0"
    cases = {("25.11 NeMo container (Megatron-Bridge)", "gb200-nvl72"): ("b200", "9.13.1"),
             ("26.04.01 NeMo container (Megatron-Bridge)", "b200-dgx"): ("gb200", "9.19.1"),
             ("26.06 NeMo container (Megatron-Bridge)", "gb300-nvl72"): ("gb300", "9.22.0"),
             ("25.11 NeMo container (Megatron-Bridge)", "b300-dgx"): ("gb300", "9.19.1"),
             ("26.02.01 NeMo container (Megatron-Bridge)", "gb200-nvl72"): ("gb200", "9.19.1")}
    for (release, name), (gpu, cudnn) in cases.items():
        device, note = row_attention({"release": release}, name)
        assert device == {"attention_gpu": gpu, "attention_kernel": "cudnn",
                          "attention_cudnn": cudnn}, (release, name)
        assert f"cuDNN {cudnn}'s {gpu} curves" in note
    for release, name in (("26.08 NeMo container (Megatron-Bridge)", "gb300-nvl72"),
                          ("25.04 NeMo container (NeMo 2.0)", "gb200-nvl72"),
                          ("25.11 NeMo container (Megatron-Bridge)", "mi325x")):
        assert row_attention({"release": release}, name) == ({}, "")
    rows = validate_2026(select=lambda r: r["model"] == "LLAMA3_8B" and r["latest"] == "1"
                         and r["system"] == "DGX-GB200")
    assert rows and all("cuDNN 9.13.1's b200 curves" in r["assumed"] for r in rows)


def test_the_vocabulary_is_padded_as_megatron_pads_it():
    """GPT-3 175B's 50,257 tokens at tp 4 were refused (they do not split over 4 ranks);
    Megatron pads them to 50,688 (128 x tp), and so does each row's config."""
    rows = read_data_csv("megatron_bridge_blackwell.csv")[1]
    gpt3 = [r for r in rows if r["model"] == "GPT3-175B"]
    assert gpt3
    for r in gpt3:
        cfg, par, fmt, assumed, refusals = row_config(r)
        assert refusals == [] and par.tp == 4 and cfg.vocab == 50688, (r, refusals)
    llama = next(r for r in rows if r["model"] == "LLAMA3.1_405B" and r["tp"] == "4")
    assert row_config(llama)[0].vocab == 128512                    # 128,256 -> 128 x 4 x 251


@pytest.mark.slow
def test_dense_llama_rows_on_blackwell_and_mi325x(tmp_path):
    """The latest dense Llama rows of every system: predicted, each within the band the
    documentation reports (docs/hardware.md), the fit row within 3%."""
    rows = validate_2026(latest_only=True,
                         select=lambda r: not r["experts"] and ("8B" in r["model"].upper()
                                                                or "70B" in r["model"].upper()))
    predicted = [r for r in rows if r["status"] == "predicted"]
    assert len(predicted) >= 14
    for r in predicted:
        assert r["rel_error"] == pytest.approx(r["predicted"] / r["published"] - 1)
        # NVFP4's quantisation kernels are not modelled: its rows run fast, the GB200
        # Llama 3 70B one +35.4% since issue 54 overlapped its TP as its recipe does
        assert abs(r["rel_error"]) < 0.40, r
        if r["role"] == "fit":       # -0.3% when the GB300's GEMM shares were chosen on
            assert abs(r["rel_error"]) < 0.03, r    # it; -2.7% since attention is priced
            #                      by its kernels' work and Adam by its bytes (2026-12-01)
    by_kind = summary_by_kind(rows)
    assert {"b200-dgx", "gb200-nvl72", "gb300-nvl72", "mi325x"} <= set(by_kind)
    for kind, k in by_kind.items():
        if k["held_out"]:
            assert k["held_out"]["mean_abs"] < 0.25, (kind, k["held_out"])
    for r in rows:
        if r["status"] != "predicted":
            assert r["reason"] and r["predicted"] is None
    json.dumps(by_kind)                                            # JSON-ready


def test_worker_processes_give_the_same_rows_in_the_same_order(capsys):
    """The rows are independent: simulated on 2 worker processes they equal the rows of
    one process, field for field and in table order, refused rows included, each row
    reported to ``on_row`` once; the command line refuses --workers 0."""
    from vcluster.cli.main import main

    def select(r):
        return (r["gpus"] == "8" and not r["experts"]) or (      # refused: ep over tp x cp
            r["model"] == "Mixtral-8x22B" and r["gpus"] == "256")
    counted = []
    one = validate_2026(latest_only=True, select=select, workers=1)
    two = validate_2026(latest_only=True, select=select, workers=2,
                        on_row=lambda: counted.append(1))
    assert one == two and len(counted) == len(two)
    assert {r["status"] for r in two} >= {"predicted", "refused"}
    assert main(["validate-model", "--table", "amd_instinct_training.csv",
                 "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err


def test_each_row_carries_the_memory_models_verdict_in_its_recipes_precision():
    """Every row is a configuration that ran: each predicted row says whether the memory
    model lets it fit, with the peak and the limit, counted per GPU kind. Its bytes per
    parameter are its recipe's: Megatron-Bridge's performance recipes keep bf16 main
    gradients (``grad_reduce_in_fp32 = False``: ``megatron_bf16``), the unread NeMo 2.0
    and AMD recipes Megatron's fp32 ones; the gradients' bytes halve, nothing else moves."""
    from vcluster.planner.memory import rank_memory
    from vcluster.timing.presets import preset

    def name(release, system="DGX-GB200", precision="BF16", arch="llama"):
        return row_precision({"release": release, "system": system,
                              "precision": precision, "arch": arch}).name
    assert name("26.04.01 NeMo container (Megatron-Bridge)") == "megatron_bf16"
    assert name("25.02 NeMo container (NeMo 2.0)") == "megatron"
    # low-precision GEMMs under Transformer Engine keep their quantised inputs
    assert name("26.04.01 NeMo container (Megatron-Bridge)", precision="MXFP8") == \
        "megatron_bf16+mxfp8"
    assert name("25.11 NeMo container (Megatron-Bridge)", "DGX-B200", "FP8-CS") == \
        "megatron_bf16+fp8"
    assert name("25.04 NeMo container (NeMo 2.0)", precision="NVFP4") == "megatron+nvfp4"
    # counted for the Llama block: GPT-3 175B's rows keep the bf16 count
    assert name("25.04 NeMo container (NeMo 2.0)", precision="FP8-CS", arch="gpt") == \
        "megatron"
    amd = [r for r in read_data_csv("amd_instinct_training.csv")[1] if r["precision"] == "FP8"]
    assert amd and row_precision(amd[0]).name == "megatron"       # recipes not read
    rows = validate_2026(select=lambda r: r["model"] == "LLAMA3_8B" and r["latest"] == "1"
                         and r["system"] == "DGX-GB200")
    assert len(rows) == 2
    table = read_data_csv("megatron_bridge_blackwell.csv")[1]
    for r in rows:
        published_precision = r["case"].split()[1]              # "LLAMA3_8B FP8-CS ..."
        assert r["status"] == "predicted" and r["precision"] == "megatron_bf16+" + \
            PRECISION_FORMATS[published_precision]
        assert r["fits"] is True and 0 < r["peak_memory_gb"] <= r["memory_limit_gb"]
        assert r["memory_limit_gb"] == pytest.approx(
            0.95 * preset("gb200-nvl72").device.hbm_bytes / 1e9)
    assert summary_by_kind(rows)["gb200-nvl72"]["fits"] == 2
    r = next(r for r in table if r["model"] == "LLAMA3_8B" and r["latest"] == "1"
             and r["system"] == "DGX-GB200")
    cfg, par, *_ = row_config(r)
    fp32, bf16 = (rank_memory(cfg, par, 0, 1, precision=p)
                  for p in ("megatron", "megatron_bf16"))
    assert bf16.grads_bytes == pytest.approx(fp32.grads_bytes / 2, abs=2)
    assert (bf16.params_bytes, bf16.optimizer_bytes, bf16.activations_bytes) == \
        (fp32.params_bytes, fp32.optimizer_bytes, fp32.activations_bytes)
