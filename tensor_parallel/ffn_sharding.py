"""How the FeedForward y = act(x W1 + b1) W2 + b2 splits over a mesh: policies and layouts.

Notation: x, y, dy, dx of global shape (B, S, d) (batch, seq, d_model); W1 (d, f),
b1 (f,), W2 (f, d), b2 (d,) with f = d_ff; n = |tp| (the product of the sizes when tp
names several axes), m = |dp| (1 when dp is None); e = itemsize; r = (B/m)·S, the rows
of every device's products (x is reshaped to 2-D (rows, d) for them). Layouts are written
[dim 0, dim 1, ...] with S(axes) split and R replicated (see :mod:`sharding.spec`); every
gradient has its parameter's layout, dy has y's and dx has x's.

Bytes per device are the ring closed forms (the traffic of ``algorithms`` = ring):
all_gather sends (n-1)·|local piece|, reduce_scatter (n-1)/n·|input|, all_reduce
2(n-1)/n·|input| (input: the local array handed to the collective; the all_reduce
form is exact when n divides its element count, else the ring's chunks differ by one
element and ``FeedForward.explain`` gives the exact count), and a group of one moves
nothing. Data parallelism (dp set, any policy): x and y are split over dp on the
batch, and the parameter gradients, partial sums over the batch shards, are reduced over
dp — all-reduced (Unsharded, Megatron, SequenceParallel), or reduce-scattered into their
dp-split layouts (GSPMD's W1 and W2); all-reducing all four with ring costs

    G(m) = 2(m-1)/m · (|dW1| + |db1| + |dW2| + |db2|)   per device (local sizes).

Every policy multiplies the same local products: forward 2·r·d·(f/n) FLOPs for x W1 and
as many for a W2; backward recomputes h = x W1 + b1 and then dW2, da, dW1, dx (five
products, 10·r·d·f/n FLOPs) — see :mod:`tensor_parallel.ffn` for the elementwise work.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from sharding import TensorSharding as TS

__all__ = ["FeedForwardShardingPolicy", "FeedForwardSharding", "FeedForwardCollectives",
           "Collective"]

# Dimension names of each tensor (in error messages).
_DIM_NAMES = {"x": ("batch", "seq", "d_model"), "w1": ("d_model", "d_ff"), "b1": ("d_ff",),
              "w2": ("d_ff", "d_model"), "b2": ("d_model",)}


class FeedForwardShardingPolicy(Enum):
    """How the FFN is split; each member's docstring gives its layouts and collectives."""

    def __new__(cls, value: str, doc: str):
        obj = object.__new__(cls)
        obj._value_ = value
        obj.__doc__ = doc
        return obj

    Unsharded = ("Unsharded", """Every device computes the whole FFN on its rows.

        x, y: [S(dp), R, R]   W1: [R, R]   b1: [R]   W2: [R, R]   b2: [R]

        forward: no communication (0 bytes). backward: with dp, all_reduce(dp) of dW1,
        db1, dW2, db2: G(m) = 2(m-1)/m·(2df + f + d)·e bytes per device.""")

    Megatron = ("Megatron", """Column-parallel W1, row-parallel W2 (Megatron-LM).

        x, y: [S(dp), R, R]   W1: [R, S(tp)]   b1: [S(tp)]   W2: [S(tp), R]   b2: [R]

        forward: h = x W1_l + b1_l, a = act(h), y = all_reduce(tp)(a W2_l) + b2:
          all_reduce(tp) of the partial y, 2(n-1)/n·|y_l| with |y_l| = r·d·e.
        backward: dW2 = a^T dy, da = dy W2_l^T, dh = da·act'(h), dW1 = x^T dh, db1 and
          db2 row sums; dx = all_reduce(tp)(dh W1_l^T): 2(n-1)/n·r·d·e; with dp,
          all_reduce(dp) of the gradients: G(m) = 2(m-1)/m·(2df/n + f/n + d)·e.""")

    SequenceParallel = ("SequenceParallel", """Megatron with x, y split on the sequence.

        x, y: [S(dp), S(tp), R]   W1: [R, S(tp)]   b1: [S(tp)]   W2: [S(tp), R]   b2: [R]

        forward: all_gather(tp, seq) of x: (n-1)·|x_l| with |x_l| = r·d·e/n; Megatron's
          products; reduce_scatter(tp, seq) of the partial y (r, d): (n-1)/n·r·d·e; in
          all 2(n-1)/n·r·d·e, as Megatron's all-reduce.
        backward: all_gather(tp, seq) of x (recomputing h) and of dy, (n-1)/n·r·d·e
          each; db2 from the gathered dy (no collective); reduce_scatter(tp, seq) of the
          partial dx: (n-1)/n·r·d·e; in all 3(n-1)/n·r·d·e, plus G(m) as Megatron.""")

    GSPMD = ("GSPMD", """2-D: the GSPMD paper's FFN (batch over dp, d_model and d_ff over tp).

        x, y: [S(dp), R, S(tp)]   W1: [S(dp), S(tp)]   b1: [S(tp)]
        W2: [S(tp), S(dp)]        b2: [S(tp)]          (dp is required)

        forward: all_gather(tp, d_model) of x: (n-1)/n·r·d·e; all_gather(dp) of W1 on
          d_model and of W2 on d_model: (m-1)/m·d·f·e/n each; h = x W1 + b1 (r, f/n),
          a = act(h); reduce_scatter(tp, d_model) of the partial y = a W2 (r, d):
          (n-1)/n·r·d·e; + b2. In all 2(n-1)/n·r·d·e + 2(m-1)/m·d·f·e/n.
        backward: the forward's three all-gathers again (recompute) and all_gather(tp,
          d_model) of dy: 2(n-1)/n·r·d·e + 2(m-1)/m·d·f·e/n; reduce_scatter(dp) of dW2
          (f/n, d) and dW1 (d, f/n): 2(m-1)/m·d·f·e/n; all_reduce(dp) of db1 (f/n) and
          db2 (d/n): 2(m-1)/m·(f + d)·e/n; reduce_scatter(tp, d_model) of dx:
          (n-1)/n·r·d·e. In all 3(n-1)/n·r·d·e + 4(m-1)/m·d·f·e/n
          + 2(m-1)/m·(f + d)·e/n.""")


@dataclass(frozen=True)
class Collective:
    """One collective of the FFN program: ``kind`` over the group of mesh ``axes``
    (along ``dim`` for all_gather / reduce_scatter)."""

    kind: str
    axes: tuple[str, ...]
    dim: int | None = None

    @property
    def axis(self):
        """The ``axis`` argument of the device call: a name, or a tuple of names."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def __str__(self) -> str:
        axis = ",".join(self.axes)
        dim = "" if self.dim is None else f", dim={self.dim}"
        return f"{self.kind}({axis}{dim})"


@dataclass(frozen=True)
class FeedForwardCollectives:
    """The collectives of one policy (None: no communication at that point).

    ``x_in`` gathers x before x W1 (and dy before the backward products); ``w1_in`` /
    ``w2_in`` gather the weights; ``y_out`` turns the partial y (and dx) into y's (and
    x's) layout; ``dw1``.. ``db2`` reduce the gradients; ``db2_from_gathered``: db2 is
    the row sum of the gathered dy (else of the local dy).
    """

    x_in: Collective | None = None
    w1_in: Collective | None = None
    w2_in: Collective | None = None
    y_out: Collective | None = None
    dw1: Collective | None = None
    db1: Collective | None = None
    dw2: Collective | None = None
    db2: Collective | None = None
    db2_from_gathered: bool = True


def _axes(value, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or not all(
            isinstance(a, str) and a.isidentifier() for a in names):
        raise TypeError(f"FeedForwardSharding: {what} must be None, a mesh axis name or a "
                        f"non-empty tuple of names, got {value!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"FeedForwardSharding: {what} names an axis twice: {value!r}")
    return tuple(names)


def _shorthand(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclass(frozen=True)
class FeedForwardSharding:
    """``FeedForwardSharding(policy, tp="tp", dp=None)``: a policy (the enum or its
    name) and the mesh axes it uses; ``tp`` and ``dp`` are an axis name or a tuple of
    names (major to minor). See :class:`FeedForwardShardingPolicy` for each policy."""

    policy: FeedForwardShardingPolicy
    tp: str | tuple[str, ...] | None = "tp"
    dp: str | tuple[str, ...] | None = None

    def __post_init__(self):
        P = FeedForwardShardingPolicy
        policy = self.policy
        if isinstance(policy, str):
            if policy not in P.__members__:
                raise ValueError(f"FeedForwardSharding: unknown policy {policy!r}; choose one "
                                 f"of {list(P.__members__)}")
            policy = P[policy]
        if not isinstance(policy, P):
            raise TypeError(f"FeedForwardSharding: policy must be a FeedForwardShardingPolicy "
                            f"or its name, got {policy!r}")
        tp, dp = _axes(self.tp, "tp"), _axes(self.dp, "dp")
        if policy is not P.Unsharded and not tp:
            raise ValueError(f"FeedForwardSharding: {policy.name} needs a tp axis, got tp=None")
        if policy is P.GSPMD and not dp:
            raise ValueError("FeedForwardSharding: GSPMD needs a dp axis (the batch and the "
                             "weights' d_model are split over it), got dp=None")
        if policy is not P.Unsharded and set(tp) & set(dp):
            raise ValueError(f"FeedForwardSharding: tp {tp!r} and dp {dp!r} share an axis")
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "tp", _shorthand(tp))
        object.__setattr__(self, "dp", _shorthand(dp))

    # --- axes -----------------------------------------------------------------------
    @property
    def tp_axes(self) -> tuple[str, ...]:
        """The tensor-parallel axes the policy uses (() for Unsharded)."""
        return () if self.policy is FeedForwardShardingPolicy.Unsharded else _axes(self.tp, "tp")

    @property
    def dp_axes(self) -> tuple[str, ...]:
        return _axes(self.dp, "dp")

    # --- layouts --------------------------------------------------------------------
    @property
    def layouts(self) -> dict[str, TS]:
        """Name -> TensorSharding of x, w1, b1, w2, b2, y and of dy, dx, dw1, db1, dw2,
        db2 (each gradient in its tensor's layout)."""
        P = FeedForwardShardingPolicy
        tp, dp = _shorthand(self.tp_axes), _shorthand(self.dp_axes)
        if self.policy is P.Unsharded:
            out = dict(x=TS(dp, None, None), w1=TS(None, None), b1=TS(None),
                       w2=TS(None, None), b2=TS(None))
        elif self.policy is P.GSPMD:
            out = dict(x=TS(dp, None, tp), w1=TS(dp, tp), b1=TS(tp), w2=TS(tp, dp), b2=TS(tp))
        else:
            seq = tp if self.policy is P.SequenceParallel else None
            out = dict(x=TS(dp, seq, None), w1=TS(None, tp), b1=TS(tp), w2=TS(tp, None),
                       b2=TS(None))
        out["y"] = out["x"]
        out.update({"d" + k: v for k, v in list(out.items())})
        return out

    @property
    def collectives(self) -> FeedForwardCollectives:
        """The collectives the policy's program calls (see FeedForwardCollectives)."""
        P = FeedForwardShardingPolicy
        tp, dp = self.tp_axes, self.dp_axes
        grad = Collective("all_reduce", dp) if dp else None
        if self.policy is P.GSPMD:
            return FeedForwardCollectives(
                x_in=Collective("all_gather", tp, 2), w1_in=Collective("all_gather", dp, 0),
                w2_in=Collective("all_gather", dp, 1), y_out=Collective("reduce_scatter", tp, 2),
                dw1=Collective("reduce_scatter", dp, 0), db1=grad,
                dw2=Collective("reduce_scatter", dp, 1), db2=grad, db2_from_gathered=False)
        if self.policy is P.SequenceParallel:
            return FeedForwardCollectives(
                x_in=Collective("all_gather", tp, 1), y_out=Collective("reduce_scatter", tp, 1),
                dw1=grad, db1=grad, dw2=grad, db2=grad)
        y_out = Collective("all_reduce", tp) if self.policy is P.Megatron else None
        return FeedForwardCollectives(y_out=y_out, dw1=grad, db1=grad, dw2=grad, db2=grad)

    # --- validation and shapes -----------------------------------------------------
    def validate(self, mesh, x_shape=None, d_ff=None) -> None:
        """Check the axes against ``mesh`` and, given x's global shape (B, S, d) and
        d_ff, that every layout splits its dimensions evenly."""
        for what, axes in (("tp", self.tp_axes), ("dp", self.dp_axes)):
            for a in axes:
                if a not in mesh.axes:
                    raise ValueError(f"FeedForwardSharding({self.policy.name}): {what} axis "
                                     f"{a!r} is not one of the mesh's axes {mesh.axes!r}")
        if x_shape is None or d_ff is None:
            return
        for name, shape in self.global_shapes(x_shape, d_ff).items():
            layout = self.layouts[name]
            for i, (size, dim) in enumerate(zip(shape, layout.dims)):
                k = mesh.axis_size(dim.axes)
                if size % k:
                    raise ValueError(
                        f"FeedForward {self.policy.name}: {_DIM_NAMES[name][i]} (dimension {i} "
                        f"of {name}, shape {shape}) of size {size} does not split evenly into "
                        f"{k} shards over mesh axes {dim.axes!r}")

    @staticmethod
    def global_shapes(x_shape, d_ff) -> dict[str, tuple[int, ...]]:
        """Global shapes of x, w1, b1, w2, b2 from x's shape (B, S, d) and d_ff."""
        x_shape = tuple(x_shape)
        if len(x_shape) != 3 or not all(isinstance(n, int) and n > 0 for n in x_shape):
            raise ValueError(f"FeedForward: x must have a shape (batch, seq, d_model) of "
                             f"positive ints, got {x_shape!r}")
        if not isinstance(d_ff, int) or d_ff <= 0:
            raise ValueError(f"FeedForward: d_ff must be a positive int, got {d_ff!r}")
        d = x_shape[2]
        return {"x": x_shape, "w1": (d, d_ff), "b1": (d_ff,), "w2": (d_ff, d), "b2": (d,)}

    def local_shapes(self, mesh, x_shape, d_ff) -> dict[str, tuple[int, ...]]:
        """Each device's local shapes of x, w1, b1, w2, b2."""
        self.validate(mesh, x_shape, d_ff)
        return {name: tuple(n // mesh.axis_size(dim.axes)
                            for n, dim in zip(shape, self.layouts[name].dims))
                for name, shape in self.global_shapes(x_shape, d_ff).items()}

    def ring_bytes_per_device(self, mesh, x_shape, d_ff, itemsize: int = 8) -> dict:
        """The closed forms of the policy docstrings: bytes each device sends with ring
        algorithms, {"forward": ..., "backward": ...} (backward: one backward_local)."""
        self.validate(mesh, x_shape, d_ff)
        P = FeedForwardShardingPolicy
        n, m = mesh.axis_size(self.tp_axes), mesh.axis_size(self.dp_axes)
        B, S, d = x_shape
        f, e = d_ff, itemsize
        rde = B // m * S * d * e
        grads = 2 * (m - 1) / m * (2 * d * f // n + f // n + d) * e
        if self.policy is P.Unsharded:
            return {"forward": 0.0, "backward": grads}
        if self.policy is P.Megatron:
            return {"forward": 2 * (n - 1) / n * rde, "backward": 2 * (n - 1) / n * rde + grads}
        if self.policy is P.SequenceParallel:
            return {"forward": 2 * (n - 1) / n * rde, "backward": 3 * (n - 1) / n * rde + grads}
        weights = (m - 1) / m * d * f * e / n
        return {"forward": 2 * (n - 1) / n * rde + 2 * weights,
                "backward": 3 * (n - 1) / n * rde + 4 * weights
                + 2 * (m - 1) / m * (f + d) * e / n}
