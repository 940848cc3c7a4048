"""The hardware of 2026: presets with a source for every field, scale-up domains larger
than a node (GB200 NVL72), switchless full meshes (AMD Infinity Fabric), NVLink SHARP —
each priced against its closed form and the published measurements it was read from."""

import dataclasses
import math
import re
import statistics

import pytest

from vcluster.timing import PRESET_NAMES, hardware_from_dict, load_hardware, preset
from vcluster.timing.collective_cost import NCCL_BASE_LATENCY_US, collective_cost
from vcluster.timing.hardware_model import HardwareCostModel
from vcluster.timing.gemm_formats import GEMM_FORMATS
from vcluster.timing.nccl_validation import validate_nccl_2026
from vcluster.timing.presets import preset_source_gaps

GIB = 2 ** 30
US = 1e-6
NEW = ("b200-dgx", "b300-dgx", "gb200-nvl72", "gb300-nvl72", "mi300x", "mi325x", "mi355x")


# ------------------------------------------------------------------ presets and sources
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_field_has_a_source(name):
    hw = preset(name)
    assert preset_source_gaps(hw) == []
    assert all(len(s) > 10 for s in hw.sources.values())


def test_the_new_presets_are_listed_with_their_datasheet_peaks():
    assert set(NEW) <= set(PRESET_NAMES)
    peaks = {n: dict(preset(n).device.peak_tflops) for n in NEW}
    # hardware-2026.md, dense per GPU
    assert peaks["b200-dgx"] == {"bf16": 2250, "fp16": 2250, "tf32": 1125, "fp32": 80,
                                 "fp8": 4500, "fp4": 9000}
    assert peaks["gb300-nvl72"]["fp4"] == 15000 and peaks["gb200-nvl72"]["fp4"] == 10000
    assert peaks["mi300x"]["bf16"] == 1307.4 and "fp4" not in peaks["mi300x"]
    assert peaks["mi355x"]["fp4"] == 10066
    assert preset("gb200-nvl72").gpus_per_node == 4 and preset("gb200-nvl72").domain_gpus == 72
    assert preset("mi300x").node.fabric.value == "full_mesh"


def test_a_user_file_keeps_the_base_sources_and_sources_what_it_changes(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: b200-dgx\nname: mine\nnetwork:\n  nics_per_node: 4\n"
                    "device:\n  hbm_bandwidth_gbps: {value: 7672, source: 'a 7680-bit bus'}\n")
    hw = load_hardware(path)
    base = preset("b200-dgx")
    assert hw.network.nics_per_node == 4 and hw.device.hbm_bandwidth_gbps == 7672
    assert hw.sources["device.hbm_bandwidth_gbps"] == "a 7680-bit bus"
    assert hw.sources["network.nics_per_node"] == f"given in {path}: hardware"
    assert hw.sources["device.peak_tflops.bf16"] == base.sources["device.peak_tflops.bf16"]
    assert preset_source_gaps(hw) == []
    # sources are documentation: two specs with the same values are equal
    assert dataclasses.replace(base, sources={}) == base
    with pytest.raises(ValueError, match=r"hardware.device.hbm_bytes.source: expected a "
                                         r"non-empty text"):
        hardware_from_dict({"base": "b200-dgx",
                            "device": {"hbm_bytes": {"value": 1, "source": ""}}})


@pytest.mark.parametrize("bad, says", [
    ({"node": {"domain_gpus": 6}}, "domain_gpus: must be a whole number of nodes of 4"),
    ({"node": {"fabric": "full_mesh"}}, "nvls_efficiency: NVLink SHARP needs an NVSwitch"),
    ({"node": {"nvls_efficiency": 1.5}}, "nvls_efficiency: must be in (0, 1]"),
    ({"node": {"host_memory_bytes": -1}}, "host_memory_bytes: must be > 0"),
])
def test_bad_topology_names_the_key(bad, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        hardware_from_dict({"base": "gb200-nvl72", **bad})


# ------------------------------------------------------------------ scale-up domains
def test_domains_are_independent_of_hosts():
    gb, dgx = preset("gb200-nvl72"), preset("b200-dgx")
    assert [gb.node_of(r) for r in (0, 3, 4, 71, 72)] == [0, 0, 1, 17, 18]
    assert [gb.domain_of(r) for r in (0, 3, 4, 71, 72)] == [0, 0, 0, 0, 1]
    assert [dgx.domain_of(r) for r in (0, 7, 8)] == [0, 0, 1]


def _nvl72_and_dgx():
    """GB200 NVL72 and the same GPU in 8-GPU DGX nodes (B200's NVLink and NICs)."""
    gb = preset("gb200-nvl72")
    dgx = dataclasses.replace(
        gb, name="gb200-in-dgx-nodes",
        node=dataclasses.replace(gb.node, gpus_per_node=8, domain_gpus=8),
        network=dataclasses.replace(gb.network, nics_per_node=8))
    return gb, dgx


def test_a_tp16_group_is_priced_on_nvlink_in_nvl72_and_on_infiniband_across_dgx_nodes():
    gb, dgx = _nvl72_and_dgx()
    group, n = tuple(range(16)), GIB
    inside = collective_cost("all_gather", n, group, gb)
    across = collective_cost("all_gather", n, group, dgx)
    assert (inside.nodes, across.nodes) == (1, 2)
    # a ring's bandwidth term: NVLink's effective rate against the 8 NICs of a node
    nvlink = gb.node.gpu_link.effective_gbps
    infiniband = dgx.network.nics_per_node * dgx.network.nic.effective_gbps
    assert across.time_s / inside.time_s == pytest.approx(nvlink / infiniband, rel=0.10)
    assert inside.bandwidth_s == pytest.approx(15 / 16 * n / (nvlink * 1e9))
    # tp's all_reduce: NVLink SHARP inside the rack, a ring or NVLSTree across nodes
    ar_in = collective_cost("all_reduce", n, group, gb)
    ar_out = collective_cost("all_reduce", n, group, dgx)
    assert ar_in.algorithm.value == "nvls" and ar_out.nodes == 2
    assert ar_in.time_s < ar_out.time_s


def test_an_ep64_all_to_all_is_priced_on_nvlink_in_nvl72_and_on_infiniband_across_dgx_nodes():
    gb, dgx = _nvl72_and_dgx()
    p, n = 64, 8 * GIB            # large: the 63 steps' latency is <2% of the time
    inside = collective_cost("all_to_all", n, tuple(range(p)), gb)
    across = collective_cost("all_to_all", n, tuple(range(p)), dgx)
    nvlink = gb.node.gpu_link.effective_gbps * 1e9
    nic_per_gpu = dgx.network.nic.effective_gbps * 1e9      # one rail NIC per GPU
    # pairwise: every member sends (p-1)/p n, over NVLink inside the rack; across 8-GPU
    # nodes its (p-8)/p n leaving the node go through its own NIC
    expected = ((p - 8) / p * n / nic_per_gpu) / ((p - 1) / p * n / nvlink)
    assert across.bandwidth_s / inside.bandwidth_s == pytest.approx(expected, rel=1e-9)
    assert across.time_s / inside.time_s == pytest.approx(expected, rel=0.10)


# ------------------------------------------------------------------ full mesh (Infinity Fabric)
def test_a_pair_of_mi300x_gets_one_link_and_eight_get_the_port():
    hw = preset("mi300x")
    link = hw.node.gpu_link.effective_gbps / 7
    two = collective_cost("all_reduce", 4 * GIB, (0, 1), hw)
    eight = collective_cost("all_reduce", 4 * GIB, tuple(range(8)), hw)
    assert two.busbw_gbps == pytest.approx(link, rel=0.01)
    assert eight.busbw_gbps == pytest.approx(hw.node.gpu_link.effective_gbps, rel=0.01)
    # published: 47.7 and 312.9-319.0 GB/s busbw (stas00/ml-engineering; rocm-blogs)
    assert two.busbw_gbps == pytest.approx(47.671, rel=0.10)
    assert eight.busbw_gbps == pytest.approx(318.98, rel=0.02)
    # m members of the mesh: m - 1 links each
    for m in (3, 4, 6):
        cost = collective_cost("all_gather", GIB, tuple(range(m)), hw, algorithm="ring")
        assert cost.bandwidth_s == pytest.approx((m - 1) / m * GIB / ((m - 1) * link * 1e9))
    # a point-to-point transfer crosses one link, not the port
    costs = HardwareCostModel(hw)
    assert costs.p2p_time_s(0, 5, GIB) == pytest.approx(
        hw.node.gpu_link.latency_us * US + NCCL_BASE_LATENCY_US * US + GIB / (link * 1e9))
    switch = preset("b200-dgx")
    assert HardwareCostModel(switch).p2p_time_s(0, 5, GIB) < costs.p2p_time_s(0, 5, GIB) / 5


# ------------------------------------------------------------------ NVLink SHARP
def test_nvls_closed_form_and_where_it_runs():
    hw = preset("b200-dgx")
    node = hw.node
    rate = node.gpu_link.bandwidth_gbps * node.nvls_efficiency * 1e9
    cost = collective_cost("all_reduce", GIB, tuple(range(8)), hw, algorithm="nvls")
    assert cost.time_s == pytest.approx((NCCL_BASE_LATENCY_US + 2 * node.gpu_link.latency_us)
                                        * US + GIB / rate)
    assert collective_cost("all_reduce", GIB, tuple(range(8)), hw).algorithm.value == "nvls"
    assert collective_cost("all_reduce", GIB, tuple(range(4)), hw).algorithm.value == "ring"
    for group, why in (((0, 1, 2, 3), "needs 5 or more"), (tuple(range(16)), "spans")):
        with pytest.raises(ValueError, match=f"nvls: .*{why}"):
            collective_cost("all_reduce", GIB, group, hw, algorithm="nvls")
    with pytest.raises(ValueError, match="no NVLink SHARP"):
        collective_cost("all_reduce", GIB, tuple(range(8)), preset("h100-dgx"), algorithm="nvls")
    # NVLSTree across two DGX nodes: a node's 8 NICs carry n each way
    tree = collective_cost("all_reduce", GIB, tuple(range(16)), hw)
    nics = hw.network.nics_per_node * hw.network.nic.effective_gbps * 1e9
    assert tree.algorithm.value == "nvls_tree"
    assert tree.bandwidth_s == pytest.approx(GIB * max(1 / rate, 1 / nics))


# ------------------------------------------------------------------ measured collectives
def test_published_collectives_of_2026_hardware():
    """nccl_2026.csv: the rows a constant was read from within 1%; the held-out rows within
    15% but for those the model does not reach, each named with why."""
    known_misses = {
        # NCCL's tree between partitions beats the model's 2n-per-node tree by ~1.4x
        "GB200 3 x NVL4 over IB tree", "GB200 3 x NVL8 over IB tree",
        # 20 racks halve the measured busbw; the model has no spine congestion
        "GB200 NVL72 20 racks",
    }
    rows = validate_nccl_2026()
    assert len(rows) == 19
    for r in rows:
        system = r["case"].split(":")[0]
        if r["role"] == "fit":
            assert abs(r["rel_error"]) < 0.01, r
        elif system not in known_misses:
            assert abs(r["rel_error"]) <= 0.15, r
    held = [abs(r["rel_error"]) for r in rows if r["role"] == "held_out"]
    assert statistics.median(held) < 0.10
    assert not math.isnan(statistics.mean(held))


# ------------------------------------------------------------------ low-precision GEMM formats
class _Gemm:
    """A traced GEMM's price inputs (what HardwareCostModel reads of a compute op)."""

    def __init__(self, flops, nbytes):
        self.flops, self.bytes, self.seconds, self.kernel = flops, nbytes, None, None


@pytest.mark.parametrize("name, fmt, dtype", [
    ("h100-dgx", "fp8", "fp8"), ("h100-dgx", "fp8-block", "fp8"), ("h100-dgx", "fp8-row", "fp8"),
    ("b200-dgx", "mxfp8", "fp8"), ("b200-dgx", "nvfp4", "fp4"),
    ("gb300-nvl72", "nvfp4", "fp4"), ("mi355x", "mxfp4", "fp4"), ("mi355x", "mxfp8", "fp8")])
def test_a_gemm_format_is_priced_at_its_dtypes_peak_and_measured_share(name, fmt, dtype):
    hw = preset(name)
    op = _Gemm(2.0 * 16384 ** 3, 3 * 16384 ** 2)
    costs = HardwareCostModel(hw, fp8_gemms=lambda o: True, gemm_format=fmt)
    d = hw.device
    share = GEMM_FORMATS[fmt].rate_share        # 1 but for fp8-row (PyTorch's row-scaled)
    expected = d.compute_time_s(op.flops, op.bytes, dtype,
                                flops_per_s=d.achieved_flops(dtype) * share) / costs.efficiency
    assert costs.compute_time_s(op) == pytest.approx(expected)
    compute_s = op.flops / (d.peak_tflops[dtype] * 1e12 * d.e_max(dtype) * share)
    assert expected == pytest.approx((d.kernel_overhead_us * US + compute_s) / costs.efficiency)
    plain = HardwareCostModel(hw).compute_time_s(op)
    assert costs.compute_time_s(op) < plain               # faster than BF16


@pytest.mark.parametrize("name, fmt, says", [
    ("h100-dgx", "mxfp8", "mxfp8 GEMMs need tensor cores that read mxfp8 block scales: "
                          "h100-dgx (H100-SXM5-80GB) has none"),
    ("h100-dgx", "nvfp4", "nvfp4 GEMMs need FP4 tensor cores: h100-dgx"),
    ("mi355x", "nvfp4", "block-scaled formats: mxfp8, mxfp6, mxfp4"),
    ("a100-80gb-dgx", "fp8", "fp8 GEMMs need FP8 tensor cores: a100-80gb-dgx"),
    ("b200-dgx", "int4", "GEMM format 'int4' is not known; use one of fp8, fp8-row, fp8-block"),
])
def test_a_format_the_hardware_lacks_is_refused_by_name(name, fmt, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        HardwareCostModel(preset(name), fp8_gemms=lambda o: True, gemm_format=fmt)


def test_a_job_is_placed_in_equal_segments_of_its_domains():
    gb = preset("gb200-nvl72")
    assert gb.for_job(72) is gb and gb.for_job(144) is gb and gb.for_job(8) is gb
    job = gb.for_job(256)                      # 4 racks of 64 (16 of 18 trays)
    assert job.domain_gpus == 64 and job.name == "gb200-nvl72-64per-domain"
    assert "4 equal segments of 64" in job.sources["node.domain_gpus"]
    ep = tuple(range(64, 128))                 # the second stage's expert group
    assert collective_cost("all_to_all", GIB, ep, job).nodes == 1
    assert collective_cost("all_to_all", GIB, ep, gb).nodes == 2
    assert gb.for_job(100) is gb               # 2 x 50 is not a whole number of trays
    b200 = preset("b200-dgx")
    assert b200.for_job(20) is b200            # 20 = 2 x 10: not whole nodes
    with pytest.raises(ValueError, match="gpus must be an integer >= 1"):
        gb.for_job(0)


def test_hardware_show_prints_a_cluster_file_part_by_part(tmp_path, capsys):
    from vcluster.cli.main import main
    path = tmp_path / "mixed.yaml"
    path.write_text("name: mixed\nparts:\n  - {hardware: h100-dgx, nodes: 2}\n"
                    "  - {hardware: b200-dgx, nodes: 1}\n")
    assert main(["hardware", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("name: mixed (a cluster of 24 GPUs in 2 parts")
    assert "parts[0]: h100-dgx: 2 nodes x 8 H100-SXM5-80GB, ranks 0-15" in out
    assert "parts[1]: b200-dgx: 1 nodes x 8 B200, ranks 16-23" in out
    assert "    bf16: 2250 TFLOP/s  # source: " in out          # each part's fields, sourced


def test_a_hardware_file_may_not_set_sources_directly():
    with pytest.raises(ValueError, match=r"hardware.sources: unknown key 'sources'; write a "
                                         r"field's source beside its value"):
        hardware_from_dict({"base": "b200-dgx", "sources": {}})
    with pytest.raises(ValueError) as err:
        hardware_from_dict({"base": "b200-dgx", "nodes": 4})
    assert "allowed: name, device, node, network, source" in str(err.value)
    assert "sources" not in str(err.value).split("allowed:")[1]
