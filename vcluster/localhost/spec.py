"""``LocalhostSpec``: the microbenchmarks of this machine that the ``localhost`` hardware
is made of, and their files.

:func:`~vcluster.localhost.calibrate.calibrate_localhost` measures a spec;
:class:`~vcluster.localhost.cost_model.LocalhostCostModel` prices traces from it (the module
docstring there says how each figure is used); :func:`save_localhost_spec` and
:func:`load_localhost_spec` keep it in a JSON or YAML file. Specs saved before a group of
figures existed still load, with those figures None.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from vcluster.runtime.files import write_text_atomic

from .calls import CallCpu
from .gaps import CallGap
from .messages import MessageSides
from vcluster.timing.core_pool import CorePoolSpec

__all__ = ["LocalhostSpec", "load_localhost_spec", "save_localhost_spec",
           "is_localhost_spec_data"]

_DTYPES = ("float32", "float64")
_CALIBRATED = ("all_gather", "reduce_scatter", "all_reduce")   # order of channel_fixed_s


@dataclass(frozen=True)
class LocalhostSpec:
    """Microbenchmarks of this machine (rates per single core; times are medians).

    Measured by :func:`~vcluster.localhost.calibrate.calibrate_localhost` on a
    :class:`~vcluster.VirtualCluster` of ``calibration_devices`` (N) devices, each running
    BLAS with one thread; "alone" means one device (or one group) busy, the others idle;
    "busy" all N devices at once. A speedup is an aggregate throughput over one alone.
    """

    cores: int                        # cores.usable_cores(): affinity, cgroup quota
    pool_throughput: tuple            # ((cores, T), (N, T)): float32 GEMM speedup with
    #                                   `cores` and with N devices busy (the pool's T(k))
    gemm_float32_flops_per_s: float   # alone: (1024, 1024) @ (1024, 1024) float32, its
    #                                   operands' streaming at memcpy_bytes_per_s taken out
    gemm_float64_flops_per_s: float   # ... float64
    vector_float32_flops_per_s: float  # alone: a * b + c on 2^18 float32 elements (2 flops
    #                                   per element; results freed: reused pages)
    vector_float64_flops_per_s: float  # ... float64
    vector_busy_speedup: float        # a * b + c float32 on N devices busy
    memcpy_bytes_per_s: float         # alone: np.copyto of 16 MiB, warm buffers
    iadd_bytes_per_s: float           # alone: a += b on 16 MiB (bytes of a per second)
    memcpy_busy_speedup: float        # np.copyto of 16 MiB on N devices busy
    compute_overhead_s: float         # host work of one compute op: CPU seconds per op
    #                                   of a loop of `dev.compute` blocks each around three
    #                                   numpy calls on tiny arrays (fresh result), all N
    #                                   devices at once (~8 us here; an empty block ~3 us)
    group_sizes: tuple                # group sizes of the latency tables below
    barrier_s: tuple                  # barrier wall time per group size (one group alone)
    small_all_reduce_s: tuple         # 8-byte all_reduce (inline, one phase), same
    large_all_reduce_s: tuple         # 4 KiB all_reduce (two phases), same
    channel_copy_bytes_per_s: float   # all_gather on N devices: bytes a member reads per
    #                                   pool core-second (the slope between the two
    #                                   largest message_bytes)
    channel_reduce_bytes_per_s: float  # reduce_scatter: source bytes combined, same
    channel_all_reduce_bytes_per_s: float  # all_reduce: bytes read + written, same
    channel_fixed_s: tuple            # all_gather, reduce_scatter, all_reduce on N devices:
    #                                   wall time at 0 bytes (the smallest size's, less its
    #                                   bytes at the slope)
    p2p_latency_s: float              # 8-byte message, two devices alone: RTT / 2
    p2p_copy_bytes_per_s: float       # 4 MiB messages, two devices alone: bytes one side
    #                                   copies per second (sender in, receiver out)
    calibration_devices: int          # N
    message_bytes: tuple              # per-device sizes of the channel calibration
    # Host CPU per call with every device busy (None in specs measured before them: the
    # shares then come from the wall times above). CPU seconds a member spends per call,
    # every group of that size calling at once, back to back (process time / calls):
    barrier_cpu_s: tuple | None = None            # barrier, per group size
    small_all_reduce_cpu_s: tuple | None = None   # 8-byte all_reduce, same
    large_all_reduce_cpu_s: tuple | None = None   # 4 KiB all_reduce, same
    p2p_message_cpu_s: float | None = None  # one side of an 8-byte message, every device
    #                                   in a ping-pong pair at once (process time / messages)
    # Host work of host-timed traces (vcluster.localhost.host_work; None in older specs),
    # CPU seconds with every device busy:
    block_overhead_s: float | None = None   # an empty `dev.compute` block
    numpy_call_s: float | None = None       # one numpy call of reference_calls (small arrays)
    python_unit_s: float | None = None      # one pass of reference_python
    # CPU per communication call as programs make them (vcluster.localhost.calls;
    # None in older specs): rows (devices, call, group, seconds)
    call_cpu_s: tuple | None = None
    # A run started on all devices at once (vcluster.localhost.start; None in
    # older specs): rows (devices, wall time of an empty program, factor of the first
    # synchronisation's CPU)
    start_s: tuple | None = None
    # Large messages with every device busy (None in older specs: then the alone rate
    # p2p_copy_bytes_per_s over the busy factor of memcpy): bytes one side of a message
    # copies per CPU second, every device in a ping-pong pair at once (process time; the
    # slope between CALL_BYTES and 4 MiB messages)
    p2p_busy_copy_bytes_per_s: float | None = None
    # A call's CPU after longer stretches of its caller's work (vcluster.timing.
    # localhost_gap; None in older specs): rows (devices, group, gap_s, seconds) of a
    # 4 KiB all_reduce
    call_gap_cpu_s: tuple | None = None
    # One message side inside a message algorithm (vcluster.localhost.messages;
    # None in older specs: then p2p_message_cpu_s plus the bytes at the ping-pong slope):
    # rows (message bytes, CPU seconds) of a ring all_gather on all N devices
    message_side_cpu_s: tuple | None = None
    # How devices released together were spread over the cores (vcluster.timing.
    # localhost_start; None in older specs or where a process's core is unknown: then
    # one pool serves every core): rows (devices, devices per core, most first, runs)
    start_split: tuple | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _OPTIONAL:
                continue
            if f.name == "call_cpu_s":
                object.__setattr__(self, f.name, CallCpu(v).rows)
            elif f.name == "start_s":
                object.__setattr__(self, f.name, _start_rows(v))
            elif f.name == "start_split":
                object.__setattr__(self, f.name, _split_rows(v, self.cores))
            elif f.name == "call_gap_cpu_s":
                object.__setattr__(self, f.name, CallGap(v).rows)
            elif f.name == "message_side_cpu_s":
                object.__setattr__(self, f.name, MessageSides(v).rows)
            elif f.name == "group_sizes":
                object.__setattr__(self, f.name, tuple(int(x) for x in v))
            elif f.name in _TABLES + _BUSY_CPU[:3] or f.name == "channel_fixed_s":
                object.__setattr__(self, f.name, tuple(float(x) for x in v))
            elif f.name == "pool_throughput":
                object.__setattr__(self, f.name, tuple((int(k), float(t)) for k, t in v))
            elif f.name == "message_bytes":
                object.__setattr__(self, f.name, tuple(int(x) for x in v))
            elif f.name in ("cores", "calibration_devices"):
                object.__setattr__(self, f.name, int(v))
            else:
                object.__setattr__(self, f.name, float(v))
        bad = [f.name for f in fields(self) if f.name not in _ROWS
               and not _positive(getattr(self, f.name))
               and not (f.name in _OPTIONAL and getattr(self, f.name) is None)]
        if bad:
            raise ValueError(f"LocalhostSpec: {', '.join(bad)} must be positive and finite")
        n = len(self.group_sizes)
        tables = _TABLES + tuple(t for t in _BUSY_CPU[:3] if getattr(self, t) is not None)
        if n == 0 or any(len(getattr(self, t)) != n for t in tables) \
                or list(self.group_sizes) != sorted(set(self.group_sizes)) \
                or self.group_sizes[0] < 2:
            raise ValueError(f"LocalhostSpec: group_sizes must be increasing sizes >= 2 with "
                             f"one entry each in {', '.join(tables)}, got "
                             f"{self.group_sizes}, " + ", ".join(
                                 str(getattr(self, t)) for t in tables))
        if len(self.channel_fixed_s) != len(_CALIBRATED):
            raise ValueError(f"LocalhostSpec: channel_fixed_s needs one intercept each for "
                             f"{', '.join(_CALIBRATED)}, got {self.channel_fixed_s}")
        self.core_pool                                     # validates pool_throughput

    @property
    def core_pool(self) -> CorePoolSpec:
        return CorePoolSpec(self.cores, self.pool_throughput)

    def busy_factor(self, speedup: float) -> float:
        """``T(N) / s``: pool work per second alone of a kind whose busy speedup is ``s``."""
        return self.core_pool.throughput_at(self.calibration_devices) / speedup

    def gemm_flops_per_s(self, dtype: str) -> float:
        return getattr(self, f"gemm_{_dtype(dtype)}_flops_per_s")

    def vector_flops_per_s(self, dtype: str) -> float:
        return getattr(self, f"vector_{_dtype(dtype)}_flops_per_s")

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("group_sizes", "message_bytes", "channel_fixed_s") + _TABLES + _BUSY_CPU[:3]:
            if d[k] is not None:
                d[k] = list(d[k])
        d["pool_throughput"] = [list(p) for p in d["pool_throughput"]]
        for k in _ROWS:
            if d[k] is not None:
                d[k] = [[list(x) if isinstance(x, tuple) else x for x in row] for row in d[k]]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "LocalhostSpec":
        names = {f.name for f in fields(cls)}
        missing, unknown = names - set(data) - set(_OPTIONAL), set(data) - names
        if missing or unknown:
            raise ValueError(f"LocalhostSpec: missing fields {sorted(missing)}, unknown "
                             f"fields {sorted(unknown)}")
        return cls(**data)


_TABLES = ("barrier_s", "small_all_reduce_s", "large_all_reduce_s")
_BUSY_CPU = ("barrier_cpu_s", "small_all_reduce_cpu_s", "large_all_reduce_cpu_s",
             "p2p_message_cpu_s")
_HOST_RATES = ("block_overhead_s", "numpy_call_s", "python_unit_s")
_ROWS = ("call_cpu_s", "start_s", "call_gap_cpu_s",     # tables of rows, validated apart
         "message_side_cpu_s", "start_split")
_OPTIONAL = _BUSY_CPU + _HOST_RATES + _ROWS + ("p2p_busy_copy_bytes_per_s",)


def _start_rows(rows) -> tuple:
    try:
        out = tuple(sorted((int(d), float(w), float(f)) for d, w, f in rows))
    except (TypeError, ValueError):
        raise ValueError(f"LocalhostSpec.start_s: rows must be (devices, seconds, "
                         f"first-call factor), got {rows!r}") from None
    if not out or len({d for d, _, _ in out}) != len(out) or any(
            d < 1 or not 0 <= w < math.inf or not 1 <= f < math.inf for d, w, f in out):
        raise ValueError(f"LocalhostSpec.start_s: rows must be distinct (devices >= 1, "
                         f"seconds >= 0, factor >= 1), got {rows!r}")
    return out


def _split_rows(rows, cores) -> tuple:
    try:
        out = tuple(sorted((int(d), tuple(int(c) for c in split), int(n))
                           for d, split, n in rows))
    except (TypeError, ValueError):
        raise ValueError(f"LocalhostSpec.start_split: rows must be (devices, devices per "
                         f"core, runs), got {rows!r}") from None
    for d, split, n in out:
        if n < 1 or len(split) != int(cores) or sum(split) != d \
                or list(split) != sorted(split, reverse=True) or split[-1] < 0:
            raise ValueError(f"LocalhostSpec.start_split: row {(d, split, n)} needs runs >= "
                             f"1 and one count per core (cores={cores}), most first, "
                             f"summing to the devices")
    if len({(d, split) for d, split, _ in out}) != len(out):
        raise ValueError(f"LocalhostSpec.start_split: a split is listed twice: {rows!r}")
    return out


def _positive(v) -> bool:
    if isinstance(v, tuple):
        return all(_positive(x) for x in v)
    return isinstance(v, (int, float)) and 0 < v < math.inf


def _dtype(dtype) -> str:
    name = str(getattr(dtype, "name", dtype))
    if name not in _DTYPES:
        raise ValueError(f"localhost: dtype must be one of {_DTYPES}, got {dtype!r}")
    return name


def save_localhost_spec(spec: LocalhostSpec, path) -> None:
    """Write ``spec`` as JSON, or YAML when ``path`` ends in .yaml / .yml (atomically: a
    crash leaves the previous file or the new one, never half of one)."""
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml
        text = yaml.safe_dump(spec.to_dict(), sort_keys=False)
    else:
        text = json.dumps(spec.to_dict(), indent=2) + "\n"
    write_text_atomic(str(path), text)


def is_localhost_spec_data(data) -> bool:
    """Whether a parsed file (JSON or YAML) holds a saved calibration's fields rather than
    a hardware description: only a :class:`LocalhostSpec` has ``pool_throughput``."""
    return isinstance(data, dict) and "pool_throughput" in data


def load_localhost_spec(path) -> LocalhostSpec:
    """Read a spec written by :func:`save_localhost_spec` (JSON or YAML)."""
    path = Path(path)
    text = path.read_text("utf-8")
    import yaml
    try:
        data = yaml.safe_load(text) if path.suffix.lower() in (".yaml", ".yml") \
            else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:         # ValueError: JSONDecodeError
        raise ValueError(f"{path}: not a LocalhostSpec file ({exc}); write one with "
                         "vcluster hardware calibrate --out FILE") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of LocalhostSpec fields")
    return LocalhostSpec.from_dict(data)
