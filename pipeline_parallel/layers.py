"""The layers of one pipeline stage, on one device: forward, input- and weight-gradients.

A stage holds consecutive dense layers ``z = x W + b`` (with the activation after every
layer but the model's last). Per micro-batch j it keeps what the backward needs:

    F(j):  x_l, z_l for each layer l                      (activations: stored)
    I(j):  dz_l = act'(z_l) * dA_l,  dx = dz_l W_l^T       (input gradient, sent upstream)
    W(j):  dW_l += x_l^T dz_l,  db_l += sum_rows dz_l      (weight gradient; frees j)
    B(j) = I(j) then W(j)

The first W of a step writes the gradients (``zero_grads`` only marks them stale: no
pass that writes zeros only to add to them), the later ones add in the product's own
pass (one GEMM with beta = 1, :func:`tensor_parallel.matmul_accumulate`); the trace
declares every W alike, as the fused accumulation into a zeroed buffer that Megatron-LM
runs, so a step's trace does not depend on which W came first. For
data-parallel buckets the gradients can live back to back in one buffer
(:meth:`StageLayers.place_grads`), so that a bucket is a view the all-reduce sums in
place.

With tensor parallelism over ``tp`` the layers pair up as in Megatron-LM: a
column-parallel layer (W, b split by columns; its output stays split, so the activation
is applied to the local columns) followed by a row-parallel layer (W split by rows; the
partial product is all-reduced, then b is added once). A stage with an odd number of
layers ends with a column-parallel layer whose output is all-gathered (its b is
replicated and added after the gather), so activations
crossing stage boundaries are always replicated over tp. Products go through
:class:`tensor_parallel.MatMul`'s per-device functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharding import TensorSharding as TS
from tensor_parallel import MatMul, MatMulSharding, local_matmul, matmul_accumulate
from .functional import activation, activation_grad

__all__ = ["LayerSpec", "StageLayers", "layer_kinds"]


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``index`` of the model: (fan_in, fan_out), tp kind, activation or None."""

    index: int
    fan_in: int
    fan_out: int
    kind: str            # "dense" (no tp), "column", "row", "column_gather"
    activation: str | None

    @property
    def w_layout(self) -> TS:
        return {"dense": TS(None, None), "column": TS(None, "tp"), "row": TS("tp", None),
                "column_gather": TS(None, "tp")}[self.kind]

    @property
    def b_layout(self) -> TS:
        return TS("tp") if self.kind == "column" else TS(None)


def layer_kinds(n_layers: int, tp: bool) -> list[str]:
    """Megatron pairing of a stage's layers: column, row, column, row, ..., [column_gather]."""
    if not tp:
        return ["dense"] * n_layers
    kinds = ["column" if i % 2 == 0 else "row" for i in range(n_layers)]
    if n_layers % 2:
        kinds[-1] = "column_gather"
    return kinds


def _matmul_for(kind: str) -> MatMul | None:
    if kind == "dense":
        return None
    x = TS(None, "tp") if kind == "row" else TS(None, None)
    out = TS(None, "tp") if kind == "column" else TS(None, None)
    w = TS("tp", None) if kind == "row" else TS(None, "tp")
    return MatMul(MatMulSharding(x, w, out))


class StageLayers:
    """The layers of one stage on one device, with their local parameters and gradients."""

    def __init__(self, specs: list[LayerSpec], params: list[tuple[np.ndarray, np.ndarray]]):
        self.specs = specs
        self.params = [[w.copy(), b.copy()] for w, b in params]   # copy(): numpy or meta
        self.grads = [[np.zeros_like(w), np.zeros_like(b)] for w, b in self.params]
        self._stale = [False] * len(specs)      # layer l's grads await their first write
        self._ops = [_matmul_for(s.kind) for s in specs]
        self._saved: dict[int, list] = {}       # micro-batch -> [(x, z)] per layer
        self._dz: dict[int, list] = {}          # micro-batch -> dz per layer (I done, W not)
        self._held_bytes = 0                    # nbytes of everything in _saved and _dz
        self.param_hook = None     # ZeRO-3 (pipeline_parallel.zero): use(l, next) / done(l)

    # --- memory -----------------------------------------------------------------------
    @property
    def param_bytes(self) -> int:
        return sum(w.nbytes + b.nbytes for w, b in self.params)

    @property
    def grad_bytes(self) -> int:
        return sum(w.nbytes + b.nbytes for w, b in self.grads)

    @property
    def activation_bytes(self) -> int:
        """The saved x_l, z_l and dz_l of the micro-batches in flight. Counted as they
        come and go: the training executor asks after every action (issue 32), and
        summing the dicts each time was ~4 us of a ~70 us action at width 128."""
        return self._held_bytes

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose weight gradient is not computed yet."""
        return len(self._saved)

    def zero_grads(self) -> None:
        """Start a new sum: the next W of each layer writes its gradients instead of
        adding to them (nothing reads them before; :attr:`grads` stay valid until then)."""
        self._stale = [True] * len(self.specs)

    def place_grads(self, empty) -> np.ndarray | None:
        """Move the gradients into one buffer from ``empty(shape, dtype)`` (a device's
        memory), laid out in the order W completes them — the last layer first, W then
        b — so that the gradients a data-parallel bucket collects are adjacent. Returns
        the buffer (None, nothing moved, when the gradients' dtypes differ or
        ``empty`` gives no memory). Values are kept."""
        order = [g for l in reversed(range(len(self.grads))) for g in self.grads[l]]
        dtypes = {g.dtype for g in order}
        if len(dtypes) != 1 or not all(type(g) is np.ndarray for g in order):
            return None
        buffer = empty((sum(g.size for g in order),), dtypes.pop())
        if buffer is None:
            return None
        offset, views = 0, {}
        for g in order:
            views[id(g)] = view = buffer[offset:offset + g.size].reshape(g.shape)
            view[...] = g
            offset += g.size
        self.grads = [[views[id(gw)], views[id(gb)]] for gw, gb in self.grads]
        return buffer

    # --- the three passes ---------------------------------------------------------------
    def forward(self, dev, mb: int, x):
        saved, hook, n = [], self.param_hook, len(self.specs)
        for l, (spec, op, (w, b)) in enumerate(zip(self.specs, self._ops, self.params)):
            if hook is not None:
                hook.use(l, l + 1 if l + 1 < n else None)
            z = local_matmul(dev, x, w) if op is None else op.forward_local(dev, x, w)
            # elementwise work: declared with its bytes (memory-bound), 0 FLOPs, as the
            # FLOP formulas count only matrix products
            with dev.compute("bias + activation", flops=0, bytes=3 * z.nbytes):
                z = z + b
                out = activation(spec.activation, z) if spec.activation else z
            saved.append((x, z))
            x = out
            if hook is not None:
                hook.done(l)
        self._saved[mb] = saved
        self._held_bytes += sum(x.nbytes + z.nbytes for x, z in saved)
        return x

    def backward_input(self, dev, mb: int, dy, need_input_grad: bool = True):
        """I(mb): dz of every layer (kept for W) and dx (returned; None for the first
        stage, whose input gradient nobody needs)."""
        saved = self._saved[mb]
        dzs = [None] * len(self.specs)
        grad, hook = dy, self.param_hook
        for l in reversed(range(len(self.specs))):
            spec, op, (w, _) = self.specs[l], self._ops[l], self.params[l]
            if hook is not None:       # every layer, as FSDP's pre-backward hook does
                hook.use(l, l - 1 if l > 0 else None)
            x, z = saved[l]
            with dev.compute("activation grad", flops=0, bytes=3 * z.nbytes):
                dz = activation_grad(spec.activation, z, grad) if spec.activation else grad
            dzs[l] = dz
            if l == 0 and not need_input_grad:
                grad = None
            elif op is None:
                grad = local_matmul(dev, dz, w.T, name="matmul dx")
            else:
                grad_a, _ = op.gradient_ops()
                grad = grad_a.forward_local(dev, dz, w.T)
            if hook is not None:
                hook.done(l)
        self._dz[mb] = dzs
        self._held_bytes += sum(d.nbytes for d in dzs if d is not None)
        return grad

    def backward_weight(self, dev, mb: int, on_layer_done=None):
        """W(mb): accumulate dW, db of every layer (last layer first), free mb's state.

        ``on_layer_done(l)`` is called after layer l's gradient is accumulated.
        """
        saved, dzs = self._saved.pop(mb), self._dz.pop(mb)
        self._held_bytes -= sum(x.nbytes + z.nbytes for x, z in saved) + sum(
            d.nbytes for d in dzs if d is not None)
        for l in reversed(range(len(self.specs))):
            x, _ = saved[l]
            dz = dzs[l]
            gw, gb = self.grads[l]
            op, first = self._ops[l], self._stale[l]
            self._stale[l] = False
            if op is None:
                matmul_accumulate(dev, x.T, dz, gw, first=first, name="matmul dW")
            else:
                _, grad_b = op.gradient_ops()
                dw = grad_b.forward_local(dev, x.T, dz)
                with dev.compute("accumulate dW", flops=0, bytes=3 * gw.nbytes):
                    if first:
                        gw[...] = dw
                    else:
                        gw += dw
            with dev.compute("bias grad", flops=dz.size, bytes=dz.nbytes):
                if first:
                    dz.sum(axis=0, out=gb)
                else:
                    gb += dz.sum(axis=0)
            if on_layer_done is not None:
                on_layer_done(l)
