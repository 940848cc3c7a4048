"""A local rank's life: join the world, report ready, serve ``run`` calls until stopped."""

from __future__ import annotations

import os
import traceback

__all__ = ["serve_rank"]


def serve_rank(rank, mesh, backend, init_method, timeout_s, conn) -> None:
    """Messages from the host: ("run", cloudpickled fn, args) -> ("ok", result) or
    ("error", one line, traceback); ("trace",) -> ("ok", events since the last
    ("reset_stats",)); ("stop",) or a closed connection -> leave."""
    import cloudpickle
    import torch
    import torch.distributed as dist
    from .rank import backend_info, init_rank

    torch.set_num_threads(1)
    try:
        dev = init_rank(mesh, rank, backend, init_method, timeout_s)
        conn.send(("ready", {**backend_info(), "pid": os.getpid()}))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                   traceback.format_exc()))
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:        # the host went away
                return
            if msg[0] == "stop":
                return
            if msg[0] in ("trace", "reset_stats"):
                conn.send(("ok", list(dev.events)))
                if msg[0] == "reset_stats":
                    dev.reset_stats()
                continue
            _, fn_bytes, args = msg
            try:
                fn = cloudpickle.loads(fn_bytes)
                result = fn(dev, *args)
                dev.synchronize(timeout_s)
                reply = ("ok", result)
            except BaseException as exc:
                reply = ("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                         traceback.format_exc())
            try:
                conn.send(reply)
            except Exception as exc:     # e.g. a result that cannot be pickled
                conn.send(("error", f"the result cannot be sent to the host: {exc}"[:300],
                           traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
