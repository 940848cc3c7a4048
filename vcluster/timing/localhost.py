"""The ``localhost`` hardware: this machine, so the simulator predicts the emulator itself.

:class:`LocalhostSpec` holds microbenchmarks of the machine the emulator runs on
(:func:`~vcluster.timing.localhost_calibrate.calibrate_localhost` measures them);
:class:`LocalhostCostModel` prices a trace of emulated programs from them. The devices
are processes sharing ``cores`` cores, so every duration below is **work in single-core
seconds**, and the replay serves it from one pool of cores
(:class:`~vcluster.timing.localhost_pool.CorePool`, processor sharing with the measured
aggregate speedup ``S``)::

    simulate_trace(traces, model, core_pool=model.core_pool)

Work of one op, per device (``e`` the dtype's rates):

* compute: ``overhead + max(flops / F, bytes / B_copy)`` with ``F`` the single-thread
  GEMM rate when the op's arithmetic intensity ``flops / bytes`` is at least
  :data:`BLAS_MIN_FLOPS_PER_BYTE` (a BLAS product), else numpy's elementwise rate (an
  expression of ufuncs, each declared flop one pass over one element);
* collective over ``n`` members (shm, the emulator's default): the shares of the
  synchronisation, ``c(n) = L(n) T(n) / n`` for a wall latency ``L(n)`` measured with
  one group of ``n`` busy (``T`` the pool's throughput), plus the bytes it moves as
  :func:`~vcluster.runtime.traffic.collective_traffic` counts them, its own piece
  included::

      barrier           c_b(n)
      inline (<= 512 B) c_i(n)                                    (one phase)
      copy collectives  c_i(n) + c_b(n) + read / B_chan_copy      (all_gather, all_to_all,
                                                                   broadcast, scatter, gather)
      reductions        c_i(n) + c_b(n) + read / B_chan_reduce + written / B_chan_write

  Message algorithms (ring, tree, pairwise) are priced as their messages (below);
* point to point: the sender and the receiver each ``p2p_latency / 2`` plus, above 512 B,
  one copy of the payload at ``B_p2p`` (the sender stages it, the receiver copies it out).

Assumptions: large collective inputs are resident (in the device's arena, as products and
collective results are), and send payloads are not; work the program does outside
``dev.compute`` is not in the trace and so not predicted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from vcluster.runtime.layout import INLINE_BYTES
from vcluster.runtime.traffic import collective_traffic

from .localhost_pool import CorePoolSpec

__all__ = ["LocalhostSpec", "LocalhostCostModel", "BLAS_MIN_FLOPS_PER_BYTE",
           "load_localhost_spec", "save_localhost_spec"]

#: Arithmetic intensity (declared flops per declared byte) from which a compute op is a
#: BLAS product priced at the GEMM rate. numpy elementwise expressions declare at most
#: ~20 flops per element over >= 2 operands of >= 4 bytes (<= 2.5 flop/byte: gelu' 1.5 in
#: float32); a product (m, k) @ (k, n) has 2mkn / ((mk + kn + mn) e), which passes 4 once
#: every dimension is >= 24 (float32) or 48 (float64).
BLAS_MIN_FLOPS_PER_BYTE = 4.0

_COPY = ("all_gather", "all_to_all", "broadcast", "scatter", "gather")
_REDUCE = ("all_reduce", "reduce_scatter", "reduce")
_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class LocalhostSpec:
    """Microbenchmarks of this machine (rates per single core, times are medians).

    Measured by :func:`~vcluster.timing.localhost_calibrate.calibrate_localhost` on a
    :class:`~vcluster.VirtualCluster` of ``calibration_devices`` devices (each running
    BLAS with one thread); "alone" means one device (or one group) busy, the others idle.
    """

    cores: int                        # os.cpu_count()
    core_speedup: float               # T(busy): aggregate float32 GEMM throughput of all the
    #                                   devices at once / one device's alone, in (0, cores]
    gemm_float32_flops_per_s: float   # one device alone: (1024, 1024) @ (1024, 1024) float32
    gemm_float64_flops_per_s: float   # ... float64
    vector_float32_flops_per_s: float  # one device alone: a * b + c on 2^20 float32
    #                                   elements (2 flops per element, temporaries allocated)
    vector_float64_flops_per_s: float  # ... float64
    memcpy_bytes_per_s: float         # one device alone: np.copyto of 16 MiB, warm buffers
    iadd_bytes_per_s: float           # one device alone: a += b on 16 MiB (bytes of a / s)
    compute_overhead_s: float         # one device alone: an empty `with dev.compute(...)`
    group_sizes: tuple                # group sizes of the latency tables below
    barrier_s: tuple                  # barrier wall time per group size (one group alone)
    small_all_reduce_s: tuple         # 8-byte all_reduce wall time (inline: one phase)
    channel_copy_bytes_per_s: float   # all_gather on all devices: bytes read per core-second
    channel_reduce_bytes_per_s: float  # reduce_scatter: source bytes combined per core-second
    channel_write_bytes_per_s: float  # all_reduce's writes of the reduced chunk, per core-s
    p2p_latency_s: float              # 8-byte message, two devices alone: half a round trip
    p2p_copy_bytes_per_s: float       # large messages, two devices alone: bytes one side
    #                                   copies per second (sender in, receiver out)
    calibration_devices: int          # devices of the calibration cluster
    message_bytes: int                # per-device input of the bandwidth collectives

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "group_sizes":
                object.__setattr__(self, f.name, tuple(int(x) for x in v))
            elif f.name in ("barrier_s", "small_all_reduce_s"):
                object.__setattr__(self, f.name, tuple(float(x) for x in v))
            elif f.name in ("cores", "calibration_devices", "message_bytes"):
                object.__setattr__(self, f.name, int(v))
            else:
                object.__setattr__(self, f.name, float(v))
        bad = [f.name for f in fields(self) if not _positive(getattr(self, f.name))]
        if bad:
            raise ValueError(f"LocalhostSpec: {', '.join(bad)} must be positive and finite")
        n = len(self.group_sizes)
        if n == 0 or len(self.barrier_s) != n or len(self.small_all_reduce_s) != n \
                or list(self.group_sizes) != sorted(set(self.group_sizes)) \
                or self.group_sizes[0] < 2:
            raise ValueError(f"LocalhostSpec: group_sizes must be increasing sizes >= 2 with "
                             f"one barrier_s and small_all_reduce_s each, got "
                             f"{self.group_sizes}, {self.barrier_s}, {self.small_all_reduce_s}")
        if self.core_speedup > self.cores:
            raise ValueError(f"LocalhostSpec: core_speedup {self.core_speedup} exceeds cores "
                             f"{self.cores}")

    @property
    def core_pool(self) -> CorePoolSpec:
        return CorePoolSpec(self.cores, self.core_speedup)

    def gemm_flops_per_s(self, dtype: str) -> float:
        return getattr(self, f"gemm_{_dtype(dtype)}_flops_per_s")

    def vector_flops_per_s(self, dtype: str) -> float:
        return getattr(self, f"vector_{_dtype(dtype)}_flops_per_s")

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("group_sizes", "barrier_s", "small_all_reduce_s"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "LocalhostSpec":
        names = {f.name for f in fields(cls)}
        missing, unknown = names - set(data), set(data) - names
        if missing or unknown:
            raise ValueError(f"LocalhostSpec: missing fields {sorted(missing)}, unknown "
                             f"fields {sorted(unknown)}")
        return cls(**data)


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
    """Write ``spec`` as JSON, or YAML when ``path`` ends in .yaml / .yml."""
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml
        text = yaml.safe_dump(spec.to_dict(), sort_keys=False)
    else:
        text = json.dumps(spec.to_dict(), indent=2) + "\n"
    path.write_text(text, "utf-8")


def load_localhost_spec(path) -> LocalhostSpec:
    """Read a spec written by :func:`save_localhost_spec` (JSON or YAML)."""
    path = Path(path)
    text = path.read_text("utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of LocalhostSpec fields")
    return LocalhostSpec.from_dict(data)


def _interpolate(sizes: tuple, values: tuple, n: int) -> float:
    """``values`` at group size ``n``: log-log linear between (and beyond) the table."""
    if n in sizes:
        return values[sizes.index(n)]
    if len(sizes) == 1:
        return values[0] * (n / sizes[0])
    j = 1
    while j < len(sizes) - 1 and sizes[j] < n:
        j += 1
    (x0, x1), (y0, y1) = sizes[j - 1:j + 1], values[j - 1:j + 1]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * math.exp(slope * math.log(n / x0))


@dataclass(frozen=True)
class LocalhostCostModel:
    """The replay's cost model for ``n_devices`` emulated devices on this machine.

    Durations are single-core seconds (see the module docstring); replay with
    ``core_pool=model.core_pool``. ``dtype`` picks the GEMM and elementwise rates.
    """

    spec: LocalhostSpec
    n_devices: int
    dtype: str = "float64"
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, LocalhostSpec):
            raise TypeError(f"LocalhostCostModel: spec must be a LocalhostSpec, got "
                            f"{self.spec!r}")
        if isinstance(self.n_devices, bool) or not isinstance(self.n_devices, int) \
                or self.n_devices < 1:
            raise ValueError(f"LocalhostCostModel: n_devices must be an int >= 1, got "
                             f"{self.n_devices!r}")
        object.__setattr__(self, "dtype", _dtype(self.dtype))

    @property
    def core_pool(self) -> CorePoolSpec:
        """The pool to replay with: the spec's cores and measured speedup."""
        return self.spec.core_pool

    # --- synchronisation shares ---------------------------------------------------------
    def _share(self, table: tuple, n: int) -> float:
        """Single-core seconds one member spends: ``L(n) T(n) / n`` (L interpolated)."""
        if n <= 1:
            return 0.0
        s = self.spec
        wall = _interpolate(s.group_sizes, table, n)
        return wall * s.core_pool.throughput(n) / n

    def barrier_share_s(self, n: int) -> float:
        return self._share(self.spec.barrier_s, n)

    def inline_share_s(self, n: int) -> float:
        return self._share(self.spec.small_all_reduce_s, n)

    # --- the cost protocol ----------------------------------------------------------------
    def compute_time_s(self, op) -> float:
        if getattr(op, "seconds", None) is not None:
            return op.seconds
        s = self.spec
        blas = op.flops >= BLAS_MIN_FLOPS_PER_BYTE * op.bytes
        rate = s.gemm_flops_per_s(self.dtype) if blas else s.vector_flops_per_s(self.dtype)
        return s.compute_overhead_s + max(op.flops / rate, op.bytes / s.memcpy_bytes_per_s)

    def collective_cpu_s(self, op, position: int) -> float:
        """Single-core seconds member ``position`` of ``op.group`` spends on the call."""
        key = (op.collective, op.algorithm, len(op.group), position, op.nbytes, op.itemsize,
               op.root)
        work = self._memo.get(key)
        if work is None:
            work = self._memo[key] = self._collective_work(op, position)
        return work

    def collective_time_s(self, op, concurrent: int = 1) -> float:
        """The call's duration when every member has a core of its own."""
        return max(self.collective_cpu_s(op, p) for p in range(len(op.group)))

    def p2p_cpu_s(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(sender, receiver) single-core seconds of one message."""
        s = self.spec
        copy = nbytes / s.p2p_copy_bytes_per_s if nbytes > INLINE_BYTES else 0.0
        side = s.p2p_latency_s / 2 + copy
        return side, side

    def p2p_time_s(self, src: int, dst: int, nbytes: int) -> float:
        if src == dst:
            return 0.0
        return sum(self.p2p_cpu_s(src, dst, nbytes))

    # --- one member's work in a collective ------------------------------------------------
    def _collective_work(self, op, position: int) -> float:
        s, n, name = self.spec, len(op.group), op.collective
        if name == "barrier":
            return self.barrier_share_s(n)
        if n <= 1 or op.algorithm == "local":
            return op.nbytes / s.memcpy_bytes_per_s          # a group of one copies x
        members = tuple(range(n))
        t = collective_traffic(name, op.algorithm, members, position, op.nbytes,
                               op.itemsize or 1, op.root)
        if op.algorithm != "shm":                            # messages through the channel
            snd, rcv = self.p2p_cpu_s(0, 1, 0)
            return (t.messages_sent * snd + t.messages_received * rcv
                    + (t.bytes_sent + t.bytes_received) / s.p2p_copy_bytes_per_s)
        if op.nbytes <= INLINE_BYTES:
            return self.inline_share_s(n)
        read, written = _moved_bytes(name, n, position, op, t)
        fixed = self.inline_share_s(n) + self.barrier_share_s(n)
        if name in _COPY:
            return fixed + read / s.channel_copy_bytes_per_s
        return (fixed + read / s.channel_reduce_bytes_per_s
                + written / s.channel_write_bytes_per_s)


def _moved_bytes(name: str, n: int, position: int, op, traffic) -> tuple[int, int]:
    """(bytes read, bytes written) by one member of a large shm call: the traffic model's
    reads from and writes to its peers, plus its own piece (which the model leaves out:
    all_gather and gather's root copy their own input, all_to_all and reduce_scatter
    their own 1/n, all_reduce and reduce combine their own chunk, broadcast's and
    scatter's roots copy their input or piece into the result)."""
    x, root = op.nbytes, position == op.root
    chunk = max((b for _, b, _ in traffic.received), default=0)
    own = {"all_gather": x, "gather": x if root else 0, "all_to_all": x // n,
           "reduce_scatter": x // n, "all_reduce": chunk, "reduce": chunk,
           "broadcast": x if root else 0, "scatter": x // n if root else 0}[name]
    written = 0
    if name == "all_reduce" or (name == "reduce" and root):
        written = traffic.bytes_sent + own                # the reduced chunk, to every output
    elif name == "reduce":
        written = traffic.bytes_sent                      # ... to the root's
    return traffic.bytes_received + own, written
