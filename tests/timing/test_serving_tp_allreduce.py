"""vLLM's custom all-reduce price: the measured table at its points, linear between
them, NCCL's model wherever vLLM would use NCCL, and faster than NCCL at decode sizes."""

from __future__ import annotations

import pytest

from vcluster.timing.collective_cost import collective_time_s
from vcluster.timing.presets import preset
from vcluster.timing.serving.tp_allreduce import (CUSTOM_ALLREDUCE_MAX_BYTES,
                                                  HOPPER_MEASURED_US, custom_allreduce_s,
                                                  tp_allreduce_s)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_measured_points_and_linear_between(tp):
    sizes = (512, 4096, 32768, 262144, 524288, 1048576)
    for size, us in zip(sizes, HOPPER_MEASURED_US[tp]):
        assert custom_allreduce_s("H100-SXM5-80GB", tp, size) == pytest.approx(us * 1e-6)
    mid = custom_allreduce_s("H100-SXM5-80GB", tp, (262144 + 524288) / 2)
    assert mid == pytest.approx((HOPPER_MEASURED_US[tp][3] + HOPPER_MEASURED_US[tp][4]) / 2e6)
    # beyond the table: the last interval's rate, and monotone
    a, b = (custom_allreduce_s("H100-SXM5-80GB", tp, n) for n in (2**21, 2**22))
    assert HOPPER_MEASURED_US[tp][-1] * 1e-6 < a < b


def test_where_vllm_uses_nccl_there_is_no_custom_price():
    assert custom_allreduce_s("A100-SXM4-80GB", 8, 4096) is None
    assert custom_allreduce_s("H100-SXM5-80GB", 16, 4096) is None
    assert custom_allreduce_s("H100-SXM5-80GB", 8, CUSTOM_ALLREDUCE_MAX_BYTES + 1) is None
    assert custom_allreduce_s("H100-SXM5-80GB", 8, 4096, same_node=False) is None
    assert custom_allreduce_s("H200-SXM-141GB", 6, 32768) == pytest.approx(
        (HOPPER_MEASURED_US[4][2] + HOPPER_MEASURED_US[8][2]) / 2e6)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 8])
def test_faster_than_nccl_at_decode_sizes(tp, tokens):
    """A decode step's all-reduce of tokens x 8192 bf16 (Llama-70B's width)."""
    hw = preset("h100-dgx")
    nbytes = tokens * 8192 * 2
    nccl = collective_time_s("all_reduce", nbytes, tuple(range(tp)), hw)
    assert custom_allreduce_s(hw.device.name, tp, nbytes) < nccl
    assert tp_allreduce_s(hw.device.name, tp, nbytes, nccl) < nccl


def test_the_engine_price_takes_nccl_where_vllm_does_or_where_cheaper_unmeasured():
    name = "H100-SXM5-80GB"
    assert tp_allreduce_s(name, 8, 4096, 1.0) == custom_allreduce_s(name, 8, 4096)
    assert tp_allreduce_s(name, 2, 2**20, 1e-9) == custom_allreduce_s(name, 2, 2**20)
    assert tp_allreduce_s(name, 2, 2**22, 1e-9) == 1e-9         # unmeasured: the lesser
    assert tp_allreduce_s(name, 2, 2**24, 5.0) == 5.0            # above 8 MiB: NCCL
    assert tp_allreduce_s("A100-SXM4-80GB", 8, 4096, 7.0) == 7.0
