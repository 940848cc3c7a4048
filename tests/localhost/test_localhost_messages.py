"""One message side inside a message algorithm (vcluster.localhost.messages): the
lookup interpolates as documented, the spec keeps and validates its rows (older specs
load without them and keep the ping-pong pricing), the model prices a ring call's sides
from the rows and a reducing algorithm's working copy as a local copy, and a real
measurement on a cluster gives a row per size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.localhost_specs import spec
from tests.localhost.test_localhost import BUSY

from mesh import Mesh
from vcluster.runtime.cluster import VirtualCluster
from vcluster.runtime.layout import INLINE_BYTES
from vcluster.runtime.tracing.ops import TraceCollective
from vcluster.runtime.traffic import collective_traffic
from vcluster.localhost.cost_model import LocalhostCostModel
from vcluster.localhost.bytes import message_work, p2p_copy_s_per_byte
from vcluster.localhost.messages import (SIDE_BYTES, MessageSides, measure_message_sides,
                                               working_copy_bytes)

pytestmark = pytest.mark.timeout(120)

US = 1e-6
KIB = 1 << 10
ROWS = ((256, 20 * US), (4 * KIB, 30 * US), (64 * KIB, 60 * US), (1024 * KIB, 120 * US))


def test_lookup_is_eager_flat_then_linear_in_bytes():
    m = MessageSides(ROWS)
    assert m.seconds(8) == m.seconds(INLINE_BYTES) == pytest.approx(20 * US)   # eager
    assert m.seconds(INLINE_BYTES + 1) == pytest.approx(30 * US)   # rendezvous, clamped
    assert m.seconds(4 * KIB) == pytest.approx(30 * US)
    # between 4 and 64 KiB: a straight line in bytes (12 of the 60 KiB between the rows)
    assert m.seconds(16 * KIB) == pytest.approx((30 + 30 * 12 / 60) * US)
    # (not a chord in log-log: the geometric mean, above the line on these rows)
    assert m.seconds(16 * KIB) < math.sqrt(30 * 60) * US
    assert m.seconds(64 * KIB) == pytest.approx(60 * US)
    slope = 60 * US / (960 * KIB)                              # per byte, the two largest
    assert m.seconds(2048 * KIB) == pytest.approx(120 * US + 1024 * KIB * slope)
    assert m.work(0, 0) == 0.0
    assert m.work(3, 3 * 64 * KIB) == pytest.approx(3 * 60 * US)


def test_a_falling_top_end_is_not_extrapolated_below_its_last_row():
    m = MessageSides(((256, 20 * US), (4 * KIB, 90 * US), (64 * KIB, 60 * US)))
    assert m.seconds(1 << 20) == pytest.approx(60 * US)


@pytest.mark.parametrize("rows", [
    ((4 * KIB, 30 * US), (64 * KIB, 60 * US)),                       # no eager row
    ((256, 20 * US), (4 * KIB, 30 * US)),                            # one rendezvous row
    ((256, 20 * US), (128, 20 * US), (4 * KIB, 30 * US), (8 * KIB, 40 * US)),  # two eager
    ((256, 20 * US), (4 * KIB, 30 * US), (4 * KIB, 40 * US)),        # a size twice
    ((256, 20 * US), (4 * KIB, 0.0), (8 * KIB, 40 * US)),            # zero seconds
    ((256, 20 * US), (4 * KIB, math.inf), (8 * KIB, 40 * US)),
    ((256,), (4 * KIB, 30 * US)),                                    # not pairs
])
def test_rows_are_validated_and_the_spec_names_its_field(rows):
    with pytest.raises(ValueError, match="message_side_cpu_s"):
        MessageSides(rows)
    with pytest.raises(ValueError, match="message_side_cpu_s"):
        spec(message_side_cpu_s=rows)


def test_spec_keeps_the_rows_and_older_specs_load():
    s = spec(message_side_cpu_s=ROWS)
    assert s.message_side_cpu_s == ROWS
    assert type(s).from_dict(s.to_dict()) == s
    d = s.to_dict()
    del d["message_side_cpu_s"]
    assert type(s).from_dict(d).message_side_cpu_s is None


@pytest.mark.parametrize("algorithm, n, nbytes", [
    ("ring", 4, 16 * KIB), ("ring", 8, 2 * KIB), ("ring", 8, 300), ("tree", 4, 256 * KIB),
    ("ring", 2, 4 * 1024 * KIB)])
def test_a_message_algorithm_pays_each_side_at_its_size(algorithm, n, nbytes):
    """Every side at the curve's price for the mean message size of its kind; the
    ping-pong formula for a spec without the rows."""
    members = tuple(range(n))
    op = "broadcast" if algorithm == "tree" else "all_gather"
    with_rows, without = spec(**BUSY, message_side_cpu_s=ROWS), spec(**BUSY)
    m = MessageSides(ROWS)
    for position in range(n):
        call = TraceCollective(op, members, nbytes, 4, algorithm)
        t = collective_traffic(op, algorithm, members, position, nbytes, 4, call.root)
        expect = sum(k * m.seconds(b / k) for k, b in ((t.messages_sent, t.bytes_sent),
                                                      (t.messages_received, t.bytes_received))
                     if k)
        assert LocalhostCostModel(with_rows, 8).collective_cpu_s(call, position) == \
            pytest.approx(expect)
        assert message_work(with_rows, t) == pytest.approx(expect)
        sides = t.messages_sent + t.messages_received
        moved = t.bytes_sent + t.bytes_received
        assert message_work(without, t) == pytest.approx(
            sides * 55 * US + moved * p2p_copy_s_per_byte(without))
    if algorithm == "ring" and op == "all_gather":        # every member: 2 (n - 1) sides
        assert message_work(with_rows, t) == pytest.approx(2 * (n - 1) * m.seconds(nbytes))


def test_measurement_gives_a_row_per_size_on_real_devices():
    """Two devices in back-to-back ring all_gathers: a positive CPU figure per size, and
    a 1 MiB side costs more than a 4 KiB one (its copy alone is ~100 us at 10 GB/s)."""
    with VirtualCluster(Mesh((2,), ("x",))) as cluster:
        rows = measure_message_sides(cluster)
    assert [b for b, _ in rows] == list(SIDE_BYTES)
    assert all(0 < s < 0.01 for _, s in rows)
    sides = dict(rows)
    assert sides[1 << 20] > sides[4 * KIB]
    assert np.isfinite(MessageSides(rows).seconds(3 << 20))


@pytest.mark.parametrize("name, algorithm, n, nbytes, expect", [
    ("all_reduce", "ring", 4, 4096, 4096), ("all_reduce", "tree", 4, 4096, 4096),
    ("reduce", "tree", 8, 8192, 8192), ("reduce_scatter", "ring", 4, 4096, 4096 + 1024),
    ("all_gather", "ring", 4, 4096, 0), ("broadcast", "tree", 4, 4096, 0),
    ("all_to_all", "pairwise", 4, 4096, 0), ("all_reduce", "ring", 1, 4096, 0)])
def test_reducing_algorithms_copy_their_input_first(name, algorithm, n, nbytes, expect):
    assert working_copy_bytes(name, algorithm, n, nbytes) == expect


def test_the_working_copy_is_priced_as_a_local_copy_with_the_curve_only():
    """With the rows, a ring all_reduce member pays its sides plus the working copy at the
    memcpy rate under its busy factor; without them, the ping-pong pricing alone."""
    with_rows, without = spec(**BUSY, message_side_cpu_s=ROWS), spec(**BUSY)
    members, nbytes = tuple(range(4)), 4 * 1024 * KIB
    op = TraceCollective("all_reduce", members, nbytes, 4, "ring")
    t = collective_traffic("all_reduce", "ring", members, 2, nbytes, 4)
    copy = nbytes * with_rows.busy_factor(with_rows.memcpy_busy_speedup) \
        / with_rows.memcpy_bytes_per_s
    assert LocalhostCostModel(with_rows, 8).collective_cpu_s(op, 2) == pytest.approx(
        message_work(with_rows, t) + copy)
    assert LocalhostCostModel(without, 8).collective_cpu_s(op, 2) == pytest.approx(
        message_work(without, t))
    assert message_work(without, t, nbytes) == message_work(without, t)
