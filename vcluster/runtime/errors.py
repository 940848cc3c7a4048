"""The errors a virtual cluster raises. Each names the rank(s) involved."""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["VClusterError", "DeviceProgramError", "DeviceLostError", "CollectiveTimeout",
           "CollectiveMismatch", "DeviceAborted", "ClusterBrokenError", "HostTimeout",
           "ArenaFullError", "MessageOrderError", "LeftoverMessagesError",
           "DeviceCollectiveTimeout",
           "DeviceCollectiveMismatch", "DeviceArenaFullError", "DeviceLeftoverMessagesError",
           "error_kind", "program_error"]


class VClusterError(RuntimeError):
    """Base class of every runtime error of vcluster."""


class DeviceProgramError(VClusterError):
    """The per-device program raised on one rank (the first one to fail is reported).

    ``rank`` is that rank, ``remote_traceback`` the device-side traceback text and
    ``errors`` maps every failing rank to a one-line description.
    """

    def __init__(self, rank: int, fn_name: str, remote_traceback: str, errors: dict[int, str]):
        self.rank, self.fn_name = rank, fn_name
        self.remote_traceback, self.errors = remote_traceback, errors
        others = {r: e for r, e in errors.items() if r != rank}
        also = ""
        if others:
            by_error: dict = {}
            for r, e in sorted(others.items()):
                by_error.setdefault(e, []).append(r)
            also = "\nother ranks: " + "; ".join(
                f"{_ranks_text(rs)}: {e}" for e, rs in by_error.items())
        super().__init__(f"rank {rank} raised in {fn_name}:\n{remote_traceback.rstrip()}{also}")


def _ranks_text(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> "ranks 1-3, 5" (sorted ranks; "rank 4" for one)."""
    runs, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r is None or r != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


class DeviceLostError(VClusterError):
    """A device process died; the cluster must be restarted."""

    def __init__(self, rank: int, how: str):
        self.rank, self.how = rank, how
        super().__init__(f"rank {rank} died ({how}); the cluster must be restarted "
                         "(cluster.restart() or a new VirtualCluster)")


class CollectiveTimeout(VClusterError):
    """A device waited longer than the cluster's timeout for a peer."""


class CollectiveMismatch(VClusterError):
    """Members of a group called different collectives (or shapes) at the same point."""


class DeviceAborted(VClusterError):
    """Raised inside a device when the host aborts the run (another rank failed)."""


class ClusterBrokenError(VClusterError):
    """The cluster lost a device or was interrupted and must be restarted first."""


class HostTimeout(VClusterError):
    """The host waited longer than ``run_timeout_s`` for devices to finish."""


class ArenaFullError(VClusterError):
    """A device's shared-memory arena has no room for a buffer."""


class MessageOrderError(VClusterError):
    """A receive was about to take a message of a (source, kind, tag) before an earlier
    one of the same: the channel's order guarantee broke (a bug of vcluster, reported
    rather than computed with: the wrong message's data would be a wrong number)."""


class LeftoverMessagesError(VClusterError):
    """A run ended with point-to-point state left behind: a message no receive took, or
    a posted receive no wait completed. Left in place, the next run on the cluster would
    take the stale message in place of its own (a wrong number, not an error), so the
    run fails instead and the cluster forgets the leftovers (it stays usable)."""


# --- a device's error, raised again in the host ----------------------------------------
class DeviceCollectiveTimeout(DeviceProgramError, CollectiveTimeout):
    """A device's :class:`CollectiveTimeout`, raised in the host: ``except
    CollectiveTimeout`` catches it, and it carries ``rank`` and ``remote_traceback`` as
    every :class:`DeviceProgramError` does."""


class DeviceCollectiveMismatch(DeviceProgramError, CollectiveMismatch):
    """A device's :class:`CollectiveMismatch`, raised in the host (see
    :class:`DeviceCollectiveTimeout`)."""


class DeviceArenaFullError(DeviceProgramError, ArenaFullError):
    """A device's :class:`ArenaFullError`, raised in the host (see
    :class:`DeviceCollectiveTimeout`)."""


class DeviceLeftoverMessagesError(DeviceProgramError, LeftoverMessagesError):
    """A device's :class:`LeftoverMessagesError`, raised in the host (see
    :class:`DeviceCollectiveTimeout`)."""


# the kinds a device reports (error_kind) -> the class the host raises (program_error)
_HOST_CLASSES = MappingProxyType({
    "CollectiveTimeout": DeviceCollectiveTimeout,
    "CollectiveMismatch": DeviceCollectiveMismatch,
    "ArenaFullError": DeviceArenaFullError,
    "LeftoverMessagesError": DeviceLeftoverMessagesError,
})
_KINDS = ((CollectiveTimeout, "CollectiveTimeout"), (CollectiveMismatch, "CollectiveMismatch"),
          (ArenaFullError, "ArenaFullError"), (LeftoverMessagesError, "LeftoverMessagesError"))


def error_kind(exc: BaseException) -> str | None:
    """What a device reports of ``exc``'s type: the runtime error it is an instance of
    (``"CollectiveTimeout"``, ...), or None for any other exception."""
    for cls, name in _KINDS:
        if isinstance(exc, cls):
            return name
    return None


def program_error(rank: int, fn_name: str, remote_traceback: str, errors: dict[int, str],
                  kind: str | None) -> DeviceProgramError:
    """The error the host raises for rank's failure: a :class:`DeviceProgramError` that is
    also the runtime error the device raised (``kind`` from :func:`error_kind`), so
    ``except CollectiveTimeout`` works in the host as the device's code would expect."""
    return _HOST_CLASSES.get(kind, DeviceProgramError)(rank, fn_name, remote_traceback, errors)
