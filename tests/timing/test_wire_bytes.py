"""What a hardware model says a collective carries (issue 31, item 9): the algorithm it
priced, never the emulator's ``shm``, and bytes on the links that are sent as often as
received.

``wire_bytes`` is checked against an independent count: the emulator's own ring and tree
algorithms (vcluster/runtime/traffic.py), summed over the members, move exactly the
closed form; and a scenario's predicted traffic equals the sum worked out by hand.
"""

from pathlib import Path

import pytest

from vcluster.runtime.traffic import collective_traffic
from vcluster.scenario import load_scenario, run_scenario
from vcluster.timing.collective_cost import wire_bytes

ROOT = Path(__file__).resolve().parents[2]
CASES = [("all_reduce", "ring"), ("all_gather", "ring"), ("reduce_scatter", "ring"),
         ("all_reduce", "tree"), ("broadcast", "tree"), ("reduce", "tree")]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("collective, algorithm", CASES)
def test_wire_bytes_equals_what_the_emulators_algorithms_move(collective, algorithm, n):
    itemsize, elements = 4, 840                       # divisible by every n
    local = itemsize * elements                       # a member's input
    members = tuple(range(10, 10 + n))
    moves = [collective_traffic(collective, algorithm, members, i, local, itemsize)
             for i in range(n)]
    sent = sum(b for t in moves for _, b, _ in t.sent)
    received = sum(b for t in moves for _, b, _ in t.received)
    nccl = local * n if collective == "all_gather" else local    # nccl-tests' size
    assert sent == received == pytest.approx(wire_bytes(collective, nccl, n))


def test_wire_bytes_closed_forms_and_errors():
    assert wire_bytes("all_reduce", 100, 4) == 600
    assert wire_bytes("all_to_all", 100, 4) == 300
    assert wire_bytes("scatter", 100, 4) == 75
    assert wire_bytes("gather", 100, 4) == 75
    assert wire_bytes("send", 100, 2) == 100
    assert wire_bytes("barrier", 100, 8) == 0
    assert wire_bytes("all_reduce", 100, 1) == 0
    with pytest.raises(ValueError, match="n must be a number of ranks >= 1, got 0"):
        wire_bytes("all_reduce", 100, 0)
    with pytest.raises(ValueError, match="all_reduse"):
        wire_bytes("all_reduse", 100, 2)


def test_a_dgx_prediction_names_nccl_algorithms_and_symmetric_traffic():
    """The quickstart (dp 2 x pp 4, float32) simulated on the A100 DGX model."""
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml",
                             ["run.mode=simulate", "run.steps=1"])
    record = run_scenario(scenario, progress=False)
    predicted = record.collectives[record.collectives["source"] == "predicted"]
    assert set(predicted["algorithm"]) <= {"ring", "tree", "p2p"}
    assert "ring" in set(predicted["algorithm"]) or "tree" in set(predicted["algorithm"])
    s = record.summary
    # by hand: pipeline messages, dp 2 replicas x 3 stage boundaries x 8 micro-batches x
    # 2 directions x (8 rows x 128 wide x 4 bytes); the gradients' all_reduce over dp = 2
    # puts 2 (2 - 1) x the parameters' bytes on the links
    sizes = [64] + [128] * 7 + [16]
    params = sum(i * j + j for i, j in zip(sizes[:-1], sizes[1:]))
    expected = 2 * 3 * 8 * 2 * (8 * 128 * 4) + 2 * params * 4
    assert s["predicted_bytes_sent"] == s["predicted_bytes_received"] == expected
    assert s["predicted_messages_sent"] is None
    assert 0 < s["predicted_exposed_comm_fraction"] < 1
    assert s["predicted_exposed_comm_fraction"] == pytest.approx(
        s["predicted_exposed_comm_s"] / s["predicted_total_s"])
