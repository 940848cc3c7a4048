"""Starting a child that Ctrl-C can interrupt, however the test run was started.

A process started with SIGINT ignored passes that on to its children, and Python then
installs no KeyboardInterrupt handler: ``cmd &`` in a non-interactive shell, ``nohup``
and some CI runners start the test session so. A test that sends SIGINT to a child
would then see the signal ignored and the child run to its end. The child here starts
with SIGINT at its default, as from an interactive shell.
"""

from __future__ import annotations

import signal
import subprocess


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_interruptible(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` with the child's SIGINT at its default."""
    return subprocess.Popen(args, preexec_fn=_sigint_default, **kwargs)
