"""Timing model: hardware descriptions, collective costs, cost models and the SimPy replay.

The engine layer: imports nothing above it (no cli, algorithms or plans) and no pandas or
matplotlib at import time.
"""

from .collective_cost import (ALGORITHMS, NCCL_ALGORITHMS, NCCL_BASE_LATENCY_US, Algorithm,
                              Collective, CollectiveCost, algbw_gbps, bus_factor, busbw_gbps,
                              collective_cost, collective_time_s)
from .cluster import (ClusterPart, ClusterSpec, axis_major_placement, cluster_from_dict,
                      load_cluster)
from .cost_model import CostModel, core_pool_of, for_many_programs, model_traces
from .hardware import (DTYPE_BYTES, DeviceSpec, HardwareSpec, IntraNodeFabric, LinkSpec,
                       NetworkSpec, NetworkTopology, NodeSpec, canonical_dtype)
from .nccl_validation import format_validation_table, validate_nccl
from .presets import (PRESET_NAMES, hardware_from_dict, hardware_to_dict, load_hardware,
                      preset, read_data_csv)

__all__ = [
    # hardware
    "DeviceSpec", "LinkSpec", "NodeSpec", "NetworkSpec", "HardwareSpec", "IntraNodeFabric",
    "NetworkTopology", "DTYPE_BYTES", "canonical_dtype",
    # presets and user hardware
    "PRESET_NAMES", "preset", "load_hardware", "hardware_from_dict", "hardware_to_dict",
    "read_data_csv",
    # heterogeneous clusters (several GPU kinds)
    "ClusterSpec", "ClusterPart", "load_cluster", "cluster_from_dict", "axis_major_placement",
    # collective costs
    "Collective", "Algorithm", "CollectiveCost", "ALGORITHMS", "NCCL_ALGORITHMS",
    "NCCL_BASE_LATENCY_US", "collective_cost", "collective_time_s", "bus_factor",
    "algbw_gbps", "busbw_gbps",
    # what the replay asks a cost model
    "CostModel", "model_traces", "core_pool_of", "for_many_programs",
    # validation
    "validate_nccl", "format_validation_table",
]
