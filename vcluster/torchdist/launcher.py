"""The torch launcher: one clean Python process that imports torch once and forks the ranks.

``TorchCluster`` starts ``python -m vcluster.torchdist.launcher CONFIG`` (CONFIG: a
base64 pickle of the mesh, backend, store address, timeout, the host's ``sys.path`` and
one socket per rank, passed as inherited file descriptors). Importing torch costs ~2 s;
forking a process that has imported it but never ran a torch op is safe and costs
milliseconds, and unlike ``spawn``/``forkserver`` it never re-imports the user's
``__main__``. The launcher reaps the ranks and kills them all when the host goes away
(its stdin closes); the ranks die with the launcher (``PR_SET_PDEATHSIG``), so none is
ever orphaned.
"""

from __future__ import annotations

import base64
import os
import pickle
import select
import signal
import sys

from vcluster.runtime.launcher import die_with_parent

_REAP_INTERVAL_S = 0.05


def _fork_rank(rank: int, config: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # the host handles Ctrl-C
        for r, fd in enumerate(config["fds"]):
            if r != rank:
                os.close(fd)
        from multiprocessing.connection import Connection
        from .serve import serve_rank
        serve_rank(rank, config["mesh"], config["backend"], config["init_method"],
                   config["timeout_s"], Connection(config["fds"][rank]))
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def main() -> None:
    config = pickle.loads(base64.b64decode(sys.argv[1]))
    sys.path[:] = config["sys_path"]
    import torch  # noqa: F401  (loaded once here, shared by every fork)
    import torch.distributed  # noqa: F401
    import cloudpickle  # noqa: F401
    die_with_parent()
    pids = {_fork_rank(r, config): r for r in range(len(config["fds"]))}
    for fd in config["fds"]:
        os.close(fd)
    stdin = sys.stdin.fileno()
    host_gone = False
    while pids:
        ready, _, _ = select.select([] if host_gone else [stdin], [], [], _REAP_INTERVAL_S)
        if ready and not os.read(stdin, 4096):
            host_gone = True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while pids:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            pids.pop(pid, None)


if __name__ == "__main__":
    main()
