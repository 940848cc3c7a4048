"""A run may not leave point-to-point state behind (issue 56): a message no receive took,
or an irecv no wait completed, would be matched by the next run's receive of the same
(source, tag) — its data silently replaced by the earlier run's. The run that leaves it
fails with LeftoverMessagesError naming who and what, the cluster forgets the leftovers
and stays usable, and the next run receives its own data."""

import numpy as np
import pytest

import vcluster
from mesh import Mesh

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster():
    with vcluster.VirtualCluster(Mesh((2,), ("x",)), timeout_s=5.0) as c:
        yield c


def _receive(value: float, n: int):
    """Rank 0 sends ``value`` (n elements) with tag 7; rank 1 returns what it receives."""
    def prog(dev):
        if dev.rank == 0:
            dev.send(np.full(n, value), 1, tag=7)
            return None
        return dev.recv(0, tag=7)
    return prog


# eager (inside the mailbox slot) and rendezvous (the payload in the sender's arena)
@pytest.mark.parametrize("n", [4, 1 << 14], ids=["eager", "rendezvous"])
def test_a_message_left_unreceived_fails_its_run_not_the_next(cluster, n):
    def leave(dev):
        if dev.rank == 0:
            dev.send(np.full(n, 1.0), 1, tag=7)        # rank 1 never receives it

    with pytest.raises(vcluster.LeftoverMessagesError,
                       match=rf"leave ended with 1 message\(s\) that no receive took: rank 0 "
                             rf"-> rank 1: send #\d+ \(tag 7, {8 * n} bytes\)"):
        cluster.run(leave)
    # before the guard, this run received the stale 1.0s of the run above
    assert (cluster.run(_receive(2.0, n))[1] == 2.0).all()


def test_an_irecv_never_waited_for_fails_its_run(cluster):
    def post_and_forget(dev):
        if dev.rank == 1:
            dev.irecv(0, tag=7)                        # posted, never waited
        else:
            dev.send(np.full(4, 1.0), 1, tag=7)

    with pytest.raises(vcluster.LeftoverMessagesError) as info:
        cluster.run(post_and_forget)
    assert isinstance(info.value, vcluster.DeviceProgramError) and info.value.rank == 1
    assert "1 receive(s) from rank 0 (tag 7) posted with irecv and never waited for" \
        in str(info.value)
    # before the guard, the stale request took this run's message and recv got the next
    assert (cluster.run(_receive(3.0, 4))[1] == 3.0).all()


def test_messages_set_aside_from_a_full_mailbox_and_never_received(cluster):
    """17 messages of tag 1 fill rank 0's 16 mailbox slots to rank 1; rank 1 wants tag 2,
    sets the full mailbox aside (16) in its own memory and returns holding them."""
    def prog(dev):
        if dev.rank == 0:
            for k in range(17):
                dev.send(np.full(2, float(k)), 1, tag=1)
            dev.send(np.zeros(2), 1, tag=2)
        else:
            dev.recv(0, tag=2)

    with pytest.raises(vcluster.LeftoverMessagesError,
                       match=r"rank 1: the run ended with 16 message\(s\) from rank 0 \(send, "
                             r"tag 1\) arrived and were never received"):
        cluster.run(prog)
    assert (cluster.run(_receive(4.0, 4))[1] == 4.0).all()


def test_ring_exchanges_back_to_back_leave_nothing(cluster):
    """The context-parallel ring's pattern (isend to the next, irecv from the previous,
    every request waited) run many times on one cluster: each run gets its own data."""
    def ring(dev, value):
        peer = 1 - dev.rank
        sends = [dev.isend(np.full(n, value + dev.rank), peer, tag=t)
                 for t, n in ((11, 4), (12, 1 << 14))]
        got = [dev.irecv(peer, tag=t).wait() for t in (11, 12)]
        for w in sends:
            w.wait()
        return [float(g[0]) for g in got]

    for value in range(20):
        assert cluster.run(ring, [(float(value),)] * 2) == [[value + 1.0] * 2, [value] * 2]
