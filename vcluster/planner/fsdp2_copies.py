"""The copies PyTorch FSDP2 makes around its collectives, beside ZeRO's gathers and reductions.

The program's ZeRO (:mod:`pipeline_parallel.zero`) keeps each module as one flat
parameter, as FSDP1 and Megatron's distributed optimizer do: a gather lands in the buffer
the parameters are views of, and the gradients are reduced where they lie. FSDP2
(``torch.distributed.fsdp.fully_shard``: torchtitan) shards each parameter on its own, so
around every collective it copies (``torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py``, PyTorch 2.4-2.9):

* before an all-gather, the rank's shards into the all-gather input
  (``foreach_all_gather``: ``torch._foreach_copy_`` / ``split_with_sizes_copy``): the
  shard read and written, 2·S bytes (S: the gather's input bytes);
* after it, the gathered bytes into each parameter (``foreach_all_gather_copy_out``:
  ``split_with_sizes_copy``): read and written, 2·n·S bytes over a group of n;
* before a reduce-scatter, the unsharded gradients into its input, cast to the reduce
  dtype (``foreach_reduce``: ``torch._chunk_cat``): the bf16 gradients read (2 bytes an
  element) and the input written, 2·E + R bytes (R: the reduce-scatter's input bytes, E =
  R / its element size);
* after it, the reduced shard into the sharded gradient (cast back, accumulated): read
  and written, 2·R/n bytes.

:func:`with_fsdp2_copies` adds them, as elementwise kernels of those bytes, around each
data-parallel parameter gather and gradient reduce-scatter of a traced step (the per-op
table's ``param gather (dp)`` and ``grad reduce (dp)`` rows,
:func:`~.simulation.data_parallel_row`): the copies that read a collective's result after the wait for
it, the others before their collective. Priced by the cost
model that prices the other kernels (analytic: launch overhead plus bytes over the
achieved HBM bandwidth); nothing fitted. Where it applies: ZeRO-2/3 runs of PyTorch FSDP2
(``simulate_gpt(..., fsdp2_copies=True)``, torchtitan's rows). Not counted: a group of cp
ranks alone (dp = 1), whose reductions the per-op table keeps with their op.
"""

from __future__ import annotations

from vcluster.runtime.tracing import (TraceCollective, TraceCompute,
                                      TraceWait)

__all__ = ["with_fsdp2_copies", "COPY_NAME", "GRAD_BYTES"]

#: the added ops' names: ``fsdp2 copy: <what>``
COPY_NAME = "fsdp2 copy:"
#: bytes per gradient element FSDP2's reduce-scatter copy-in reads (bf16 gradients under
#: its mixed precision, torchtitan's ``param_dtype``)
GRAD_BYTES = 2


def _copy(what: str, nbytes: int) -> TraceCompute:
    """One elementwise kernel reading and writing ``nbytes`` in all."""
    return TraceCompute.memory_bound(f"{COPY_NAME} {what}", nbytes)


def with_fsdp2_copies(ops, row_of, gather: str, reduce: str) -> tuple:
    """``ops`` with FSDP2's copies (module docstring) around each collective ``row_of(op)``
    calls ``gather`` (an all-gather of parameters) or ``reduce`` (a reduce-scatter of
    gradients); the copy that needs a collective's result goes after the wait for it, or
    right after the collective when that wait is not among ``ops``."""
    ops = tuple(ops)
    waited = {op.handle for op in ops if type(op) is TraceWait}
    pending: dict = {}                     # collective handle -> the copy after its wait
    out = []
    for op in ops:
        kind = row_of(op) if type(op) is TraceCollective else None
        if kind == gather and op.collective == "all_gather":
            before = _copy("shards into the all-gather input", 2 * op.nbytes)
            after = _copy("all-gather output into the parameters",
                          2 * len(op.group) * op.nbytes)
        elif kind == reduce and op.collective == "reduce_scatter":
            before = _copy("gradients into the reduce-scatter input",
                           GRAD_BYTES * (op.nbytes // op.itemsize) + op.nbytes)
            after = _copy("reduced shard into the sharded gradient",
                          2 * op.nbytes // len(op.group))
        else:
            out.append(op)
            if type(op) is TraceWait and op.handle in pending:
                out.append(pending.pop(op.handle))
            continue
        out += [before, op]
        if op.handle is not None and op.handle in waited:
            pending[op.handle] = after
        else:
            out.append(after)
    return tuple(out)
