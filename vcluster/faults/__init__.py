"""Faults: specs (crash, slow device, slow link), emulated delays, simulated costs, goodput.

Engine layer: it imports only the runtime and the timing model. Training-level recovery
(checkpoints, restarts) lives in :mod:`pipeline_parallel.checkpoint` and
:mod:`pipeline_parallel.resilient`.
"""

from .delays import NO_DELAYS, DeviceDelays, crash_this_device, delays_for
from .specs import FAULT_KINDS, CrashFault, Fault, LinkFault, SlowFault, parse_fault, parse_faults

__all__ = ["CrashFault", "SlowFault", "LinkFault", "Fault", "FAULT_KINDS", "parse_fault",
           "parse_faults", "DeviceDelays", "NO_DELAYS", "delays_for", "crash_this_device"]
