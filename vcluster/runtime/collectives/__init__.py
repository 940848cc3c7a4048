"""Collective algorithms over one group: shared-memory direct (``shm``) and message-based."""

from . import common, messages, shm

__all__ = ["common", "messages", "shm"]
