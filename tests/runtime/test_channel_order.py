"""Messages of one (source, kind, tag) are received in the order they were sent, however
the receiver's scan of the mailbox is interleaved with the sender's posts.

The interleaving that broke it (issue 56): a receiver reads its slots' state words one
after another; descheduled after reading slot 0 (free), it let the sender post message
#1 into slot 0 and #2 into slot 1, then read slot 1 and saw #2 without #1 — and took #2
first. On a loaded machine this swapped two K blocks of a context-parallel ring about
once in 150 training runs: a wrong loss, no error. Here the preemption is made to
happen, deterministically, on two real channels over real shared memory in one process.
"""

from __future__ import annotations

import numpy as np
import pytest

from vcluster.runtime.channel import USER_KIND, VirtualChannel
from vcluster.runtime.errors import MessageOrderError
from vcluster.runtime.fabric import fabric_from_segments
from vcluster.runtime.layout import ControlLayout, S
from vcluster.runtime.segments import create_segment

TAG = 7
ARENA_BYTES = 1 << 20


@pytest.fixture
def fabrics():
    """Fabrics of ranks 0 and 1 over one control segment and two arenas (4 mailbox slots
    per pair); the segments are unlinked at once and unmapped with the fabrics."""
    layout = ControlLayout(2, 2, mailbox_slots=4)
    segments = [create_segment("control", layout.size_bytes)]
    segments += [create_segment(f"arena{r}", ARENA_BYTES) for r in range(2)]
    segments.append(create_segment("host", ARENA_BYTES))
    for s in segments:
        s.unlink()
    control, arenas, host = segments[0], segments[1:3], segments[3]
    yield [fabric_from_segments(r, layout, control, arenas, host, "auto", 5.0)
           for r in range(2)]
    for s in segments:
        s.close_fd()


class _Descheduled(VirtualChannel):
    """A receiving channel that, in its next scan, stops after reading slot 0's state and
    lets ``meanwhile()`` run (the sender, while this process is off the CPU) before it
    reads the other slots."""

    def __init__(self, fabric, meanwhile):
        super().__init__(fabric)
        self._meanwhile = meanwhile

    def _read_states(self, box):
        first = int(box[0, S.STATE])
        if self._meanwhile is not None:
            meanwhile, self._meanwhile = self._meanwhile, None
            meanwhile()
        return [first] + box[1:, S.STATE].tolist()


def _receive(channel, tag=TAG):
    return channel.recv_into(0, USER_KIND, tag, "recv", None, lambda shape, dtype:
                             np.empty(shape, dtype))


def test_a_later_message_seen_before_an_earlier_one_is_not_taken_first(fabrics):
    sender = VirtualChannel(fabrics[0])
    first, second = np.full(4, 1.0), np.full(4, 2.0)

    def sender_runs():                 # both land while the receiver is descheduled:
        sender.isend(1, USER_KIND, TAG, first)    # #1 into slot 0, already read as free
        sender.isend(1, USER_KIND, TAG, second)   # #2 into slot 1, read next

    receiver = _Descheduled(fabrics[1], sender_runs)
    np.testing.assert_array_equal(_receive(receiver), first)
    np.testing.assert_array_equal(_receive(receiver), second)


def test_messages_of_other_tags_in_between_keep_each_tags_order(fabrics):
    """Three tags interleaved, a torn scan in the first receive, receives in another
    order than the sends: each tag's messages still come in their own send order."""
    sender = VirtualChannel(fabrics[0])
    sent = [(tag, np.full(3, 10.0 * tag + i)) for i in range(2) for tag in (1, 2, 3)]

    def sender_runs():
        for tag, x in sent[:4]:        # the mailbox holds 4
            sender.isend(1, USER_KIND, tag, x)

    receiver = _Descheduled(fabrics[1], sender_runs)
    got = {tag: [] for tag in (1, 2, 3)}
    got[1].append(_receive(receiver, 1))   # the torn scan sees tag 1's #4, not its #1
    got[2].append(_receive(receiver, 2))
    for tag, x in sent[4:]:
        sender.isend(1, USER_KIND, tag, x)
    for tag in (3, 1, 2, 3):
        got[tag].append(_receive(receiver, tag))
    for tag in (1, 2, 3):
        np.testing.assert_array_equal(got[tag], [x for t, x in sent if t == tag])


def test_a_message_that_would_go_back_in_order_is_an_error_not_data(fabrics):
    """The guard: a receive that finds a (kind, tag)'s message numbered below the one it
    last took — here message #1 put back into the mailbox after #1 and #2 were received,
    as a stale or misrouted message would be — raises instead of returning its data."""
    sender, receiver = VirtualChannel(fabrics[0]), VirtualChannel(fabrics[1])
    slots = fabrics[0].mailbox[0, 1]
    sender.isend(1, USER_KIND, TAG, np.full(4, 1.0))
    first = slots[0].copy()                            # message #1 as it was posted
    np.testing.assert_array_equal(_receive(receiver), np.full(4, 1.0))
    sender.isend(1, USER_KIND, TAG, np.full(4, 2.0))
    np.testing.assert_array_equal(_receive(receiver), np.full(4, 2.0))
    slots[0] = first                                   # #1 again, numbered below posted
    with pytest.raises(MessageOrderError, match=r"rank 1: recv from rank 0 took message "
                                                r"#1 after message #2 of the same "
                                                r"\(kind send, tag 7\)"):
        _receive(receiver)
