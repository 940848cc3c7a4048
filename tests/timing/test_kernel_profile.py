"""The GEMM profile (issue 26): fitted to the measured H100 table, each row predicted by a
profile fitted without it (leave-one-out) within the issue's bounds, monotone in every
dimension, and exact on data made from known constants."""

import itertools
import statistics

import pytest

from vcluster.timing.kernel_profile import (TILE, GemmProfile, gemm_rows, h100_gemm_profile,
                                            leave_one_out)


def test_leave_one_out_on_the_h100_table_meets_the_issue():
    rows, source = gemm_rows()
    assert len(rows) == 160 and "H100" in source
    errors = [abs(e) for e in leave_one_out(rows)]
    assert statistics.median(errors) <= 0.08
    assert sum(e <= 0.20 for e in errors) / len(errors) >= 0.95


def test_prices_are_monotone_along_every_swept_dimension():
    profile = h100_gemm_profile()
    rows, _ = gemm_rows()
    dims = sorted({d for m, k, n, _ in rows for d in (m, k, n)})
    for m, k, n in itertools.product(dims, repeat=3):
        t = profile.time_s(m, k, n)
        assert profile.time_s(2 * m, k, n) > t
        assert profile.time_s(m, 2 * k, n) > t
        assert profile.time_s(m, k, 2 * n) > t
        assert profile.time_s(m + 1, k, n) >= t and profile.time_s(m, k, n + 1) >= t


def test_fit_recovers_known_constants():
    call, rate = 7e-6, 5e14
    shapes = [(128, 256, 512), (1024, 1024, 1024), (4096, 512, 8192), (256, 8192, 128)]
    rows = [(m, k, n, call + 2 * m * k * n / rate) for m, k, n in shapes]
    p = GemmProfile.fit(rows, "made up")
    assert p.call_s == pytest.approx(call, rel=1e-9)
    assert p.flops_per_s == pytest.approx(rate, rel=1e-9)
    assert (p.rows, p.source) == (4, "made up")
    # outputs are padded to whole tiles: 129 rows cost as much as 256
    assert p.time_s(129, 64, TILE) == p.time_s(2 * TILE, 64, TILE)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="needs at least 2 rows, got 1"):
        GemmProfile.fit([(128, 128, 128, 1e-5)])
    with pytest.raises(ValueError, match="do not tell a fixed cost from a rate"):
        GemmProfile.fit([(128, 128, 128, 1e-5)] * 3)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        h100_gemm_profile().time_s(128, 0, 128)
