"""The float8 cast kernels of torchao's float8 training, beside each FP8 GEMM.

Transformer Engine (Megatron-LM, NeMo) fuses the cast to FP8 into the kernel that makes
the GEMM's operand (the norm before QKV, the activation before the MLP's second linear),
so the FP8 rows of those frameworks are priced with the GEMMs alone (``fp8_casts=None``).
torchao's float8 training (``convert_to_float8_training``, the ``float8`` option of
torchtitan) instead casts each ``nn.Linear``'s three operands — input, weight and output
gradient — in kernels of their own, each reading the bf16 tensor from HBM. Their bytes are
those of torchao's own roofline model of the recipes
(``torchao/testing/float8/roofline_utils.py``, ``get_tensor_memory_traffic_ovhd_s``, at
pytorch/ao 042170ff590a18993e2b939a85d7eb3cd8db8d5c), without its fusion of an operand's
first read into the op before it (its script's default; that file itself notes torch.compile
does not always fuse it). Bytes read plus written per element of the operand, one entry per
kernel:

=============  =================================  ==================================
recipe         input, output gradient             weight
=============  =================================  ==================================
``tensorwise`` amax: 2; amax of the partial       amax: 2; partial maxima: ~0;
               maxima: ~0; cast: 2 + 2·1 (both    cast: 2 + 1 (forward); cast of the
               layouts in FP8) — 6 B              other layout: 2 + 1 (backward) — 8 B
``rowwise``    cast + bf16 transpose: 2 + 1 + 2;  cast: 2 + 1 (forward); transpose:
               cast of the transpose: 2 + 1 —     2 + 2 and its cast 2 + 1 (backward)
               8 B                                — 10 B
=============  =================================  ==================================

Where they go in the traced step (:func:`with_float8_casts`): after a forward GEMM
(``x @ W``, its recomputation included) the input's and the weight's forward kernels;
after an input-gradient GEMM (``dx = dy W^T``) the output gradient's and the weight's
backward kernels; after a weight-gradient GEMM (``dW = x^T dy``) nothing for tensorwise
(it reads the FP8 layouts cast before) and the input's second kernel for rowwise (its
transpose is cast in the backward). Only the GEMMs priced in FP8 get them
(:func:`~.simulation.fp8_gemm`: the layers' linears; never the output head or a router).
The program's ``W_kv`` is torchtitan's ``wk`` and ``wv``, two ``nn.Linear``s: its input
is cast twice. Under sequence parallelism torchtitan's tensorwise tensor parallelism
casts the operands it gathers (a column-parallel linear's input, a row-parallel one's
output gradient) on this rank's sequence shard and gathers them in FP8
(:data:`CAST_BEFORE_GATHER`); rowwise gathers in bf16 and casts the whole gathered
operand. When the TE overlap splits a linear into tp pieces, each piece casts its share of
the weight, so a weight is cast once per linear and pass. Each kernel is priced as an elementwise kernel of its bytes by the cost
model that prices the others (analytic: launch overhead plus bytes over the achieved HBM
bandwidth) — nothing here is fitted. Not modelled: FSDP2's float8 all-gather (the
weight cast on the shard, before the gather), the FP8 bytes of tensorwise's tensor-parallel
gathers (priced as bf16), the scale all-reduces of tensor parallelism (a few bytes). The recipe
also names its GEMMs' format (:func:`recipe_gemm_format`): tensorwise runs cuBLAS's
per-tensor FP8 GEMM (``fp8``), rowwise PyTorch's row-scaled one (``fp8-row``, priced at its
measured share of the FP8 rate, :mod:`vcluster.timing.gemm_formats`; since 2026-12-01,
before, as tensorwise's). The dense Llama layer only (the
traced names of its linears are read; an MoE's experts run grouped GEMMs torchao casts
otherwise): :func:`~.simulation.simulate_gpt` refuses the others.
"""

from __future__ import annotations

from types import MappingProxyType

from vcluster.runtime.tracing import TraceCompute

__all__ = ["FP8_CASTS", "CAST_BEFORE_GATHER", "CAST_NAME", "with_float8_casts",
           "check_fp8_casts", "RECIPE_GEMM_FORMATS", "recipe_gemm_format"]

#: the added ops' names end ``float8 cast: <operand>``, after the GEMM they serve
CAST_NAME = "float8 cast:"

#: a kernel that reads only the partial maxima (torchao: "mem traffic not modeled"):
#: priced as a launch with this many bytes
_TINY_BYTES = 4

# bytes per element of each kernel, by recipe and (operand, pass); "~0": a tiny kernel
_TENSORWISE = MappingProxyType({
    ("input", "forward"): (2, 0, 2 + 2 * 1),
    ("grad_output", "backward"): (2, 0, 2 + 2 * 1),
    ("weight", "forward"): (2, 0, 2 + 1),
    ("weight", "backward"): (2 + 1,),
    ("input", "weight gradient"): (),
})
_ROWWISE = MappingProxyType({
    ("input", "forward"): (2 + 1 + 2,),
    ("grad_output", "backward"): (2 + 1 + 2, 2 + 1),
    ("weight", "forward"): (2 + 1,),
    ("weight", "backward"): (2 * 2, 2 + 1),
    ("input", "weight gradient"): (2 + 1,),
})
#: the recipes priced: name -> {(operand, pass): bytes per element of each kernel}
FP8_CASTS = MappingProxyType({"torchao-tensorwise": _TENSORWISE, "torchao-rowwise": _ROWWISE})
#: the GEMM format each recipe's GEMMs run in (:mod:`vcluster.timing.gemm_formats`):
#: ``torch._scaled_mm`` with per-tensor scales calls cuBLAS, with row scales PyTorch's
#: own CUTLASS kernel (pytorch issue 147971)
RECIPE_GEMM_FORMATS = MappingProxyType({"torchao-tensorwise": "fp8",
                                        "torchao-rowwise": "fp8-row"})
#: the recipes whose tensor parallelism gathers operands in FP8, cast on their sequence
#: shard before the gather; the others gather in bf16 and cast the gathered operand
#: (torchtitan's parallelize: "float8 all-gather with TP is only supported for tensorwise
#: float8 scaling recipes. For rowwise recipes, we use regular TP and all-gather happens
#: in high precision")
CAST_BEFORE_GATHER = frozenset({"torchao-tensorwise"})


def check_fp8_casts(fp8_casts, fp8: bool, gemm_format: str = "fp8"):
    """``fp8_casts`` if it names a recipe of :data:`FP8_CASTS` (or is None) and the GEMMs
    it casts for run in FP8; ValueError naming the argument, the value and what is allowed
    otherwise."""
    if fp8_casts is None:
        return None
    if fp8_casts not in FP8_CASTS:
        raise ValueError(f"fp8_casts={fp8_casts!r} is not known; use None (casts fused into "
                         f"the kernels before the GEMMs, Transformer Engine's) or one of "
                         f"{', '.join(FP8_CASTS)}")
    allowed = ("fp8", RECIPE_GEMM_FORMATS[fp8_casts])
    if not fp8 or gemm_format not in allowed:
        raise ValueError(f"fp8_casts={fp8_casts!r} prices torchao's casts to FP8 with one "
                         f"scale per {'row' if allowed[1] == 'fp8-row' else 'tensor'}: it "
                         f"needs fp8=True and gemm_format "
                         f"{' or '.join(repr(a) for a in dict.fromkeys(allowed))} (got "
                         f"fp8={fp8!r}, gemm_format={gemm_format!r})")
    return fp8_casts


def recipe_gemm_format(fp8_casts, gemm_format: str = "fp8") -> str:
    """The format the GEMMs of ``fp8_casts``'s recipe run in (:data:`RECIPE_GEMM_FORMATS`;
    ``gemm_format`` itself without a recipe): torchao's rowwise recipe runs PyTorch's
    row-scaled FP8 GEMM whether the caller asked for ``fp8`` or ``fp8-row``."""
    return gemm_format if fp8_casts is None else RECIPE_GEMM_FORMATS[fp8_casts]


def _pass(base: str) -> str:
    """"forward", "backward" (input gradient) or "weight gradient" of a linear's GEMM by
    its traced name: ``x @ W_q``, ``dx = dq W_q^T``, ``dW_q = x^T dq``."""
    if base.startswith("dW"):
        return "weight gradient"
    return "backward" if base.startswith("d") else "forward"


def _kernels(name: str, elements: int, per_element: tuple) -> list[TraceCompute]:
    """One kernel per entry of ``per_element`` (bytes per element of the operand; 0: a
    kernel of :data:`_TINY_BYTES`)."""
    return [TraceCompute.memory_bound(name, b * elements) if b else
            TraceCompute.memory_bound(name, _TINY_BYTES, 1) for b in per_element]


def _gathered(base: str, step: str) -> bool:
    """Whether a GEMM's first operand is the one sequence parallelism all-gathers: ``x``,
    the input of a column-parallel linear (``x @ W_q``, ``dW_q = x^T dq``), or ``dy``,
    the output gradient of a row-parallel one (``dctx = dy W_o^T``)."""
    if step == "forward":
        operand = base.split(" @ ")[0]
    else:
        operand = base.split(" = ")[-1].split(" ")[0].removesuffix("^T")
    return operand in ("x", "dy")


def with_float8_casts(ops, recipe: str, is_fp8_gemm, tokens: int,
                      sequence_parallel_tp: int = 1) -> tuple:
    """``ops`` with torchao's cast kernels for ``recipe`` (:data:`FP8_CASTS`) after each
    GEMM ``is_fp8_gemm`` selects (module docstring). A GEMM's kernel shape is
    (batch, M, K, N): its first operand M×K (the input, or the output gradient), its
    second K×N (the weight; in a weight-gradient GEMM, M×K is the input transposed).
    ``tokens``: the rows of a linear's undivided GEMM in one micro-batch (micro-batch ·
    sequence / cp). ``sequence_parallel_tp``: the tensor-parallel degree when sequence
    parallelism gathers the linears' operands (torchtitan's float8 tensor parallelism
    casts an operand on its sequence shard and gathers it in FP8), else 1: a gathered
    operand (:func:`_gathered`) is cast as the 1/tp of its rows this rank holds. A GEMM
    of fewer rows is one piece of a linear that overlaps its communication (``tp_overlap``
    ``te``: the gathered rows in tp pieces): each piece casts its share of the weight,
    rows / ``tokens``, so the weight is cast once per linear and pass."""
    table = FP8_CASTS[recipe]
    shard = sequence_parallel_tp if recipe in CAST_BEFORE_GATHER else 1
    out = []
    for op in ops:
        out.append(op)
        if type(op) is not TraceCompute or not is_fp8_gemm(op):
            continue
        head, _, base = op.name.rpartition(": ")
        suffix = " (recompute)" if base.endswith(" (recompute)") else ""
        base = base[:len(base) - len(suffix)]
        _, m, k, n = op.kernel.shape
        step = _pass(base)
        linears = 2 if "W_kv" in base and step != "backward" else 1   # torchtitan's wk, wv
        first = "grad_output" if step == "backward" else "input"
        name = f"{head}: {base}: {CAST_NAME}"
        rows = m // shard if _gathered(base, step) else m
        out += _kernels(f"{name} {first}{suffix}", rows * k, table[(first, step)] * linears)
        if step != "weight gradient":
            out += _kernels(f"{name} weight{suffix}", k * n * min(m, tokens) // tokens,
                            table[("weight", step)])
    return tuple(out)
