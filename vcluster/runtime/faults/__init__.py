"""Faults as the runtime injects them: specs (crash, slow device, slow link, jitter) and
the delays an emulated device applies.

What faults cost in simulated time (slow links and devices in a replay, goodput under a
failure rate) is the timing model's: :mod:`vcluster.timing.faults`. Training-level
recovery (checkpoints, restarts) lives in :mod:`pipeline_parallel.checkpoint` and
:mod:`pipeline_parallel.resilient`.
"""

from .delays import NO_DELAYS, DeviceDelays, crash_this_device, delays_for
from .specs import (FAULT_KINDS, CrashFault, Fault, JitterFault, LinkFault, SlowFault,
                    parse_fault, parse_faults)

__all__ = ["CrashFault", "SlowFault", "LinkFault", "JitterFault", "Fault", "FAULT_KINDS",
           "parse_fault", "parse_faults", "DeviceDelays", "NO_DELAYS", "delays_for",
           "crash_this_device"]
