"""The emulation engine: device processes, channels, collectives, cluster, trace events."""

from .algorithm import ALGORITHMS, AlgorithmSettings, choose_algorithm
from .channel import VirtualChannel
from .cluster import VirtualCluster
from .context import DeviceContext, Work
from .device import VirtualDevice
from .emulated_device import EmulatedDevice
from .errors import (ArenaFullError, ClusterBrokenError, CollectiveMismatch, CollectiveTimeout,
                     DeviceAborted, DeviceArenaFullError, DeviceCollectiveMismatch,
                     DeviceCollectiveTimeout, DeviceLeftoverMessagesError, DeviceLostError,
                     DeviceProgramError, HostTimeout, LeftoverMessagesError,
                     MessageOrderError, VClusterError)
from .events import CommEvent, ComputeEvent, Event

__all__ = ["ALGORITHMS", "AlgorithmSettings", "choose_algorithm", "VirtualChannel",
           "VirtualCluster", "DeviceContext", "Work", "VirtualDevice", "EmulatedDevice",
           "ArenaFullError", "ClusterBrokenError", "CollectiveMismatch", "CollectiveTimeout",
           "DeviceAborted", "DeviceLostError", "DeviceProgramError", "HostTimeout",
           "DeviceCollectiveTimeout", "DeviceCollectiveMismatch", "DeviceArenaFullError",
           "LeftoverMessagesError", "DeviceLeftoverMessagesError", "MessageOrderError", "VClusterError", "CommEvent", "ComputeEvent", "Event"]
