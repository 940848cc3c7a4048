"""The closed choices of a model and of a parallel plan, each defined once as an enum.

Each is a ``str`` enum (``Choice(str, Enum)``): a member *is* its text, so comparisons
with plain strings, dict lookups, ``json.dumps`` and the functions that take names keep
working, while ``str()`` and f-strings give the plain value (``f"{ScheduleName.GPIPE}" ==
"gpipe"``). The CLI's ``choices=`` and the scenario schema's ``enum`` lists are made from
``values()``, so no front door keeps its own list (a test says so).

``ZeroStage`` is the one integer choice: an ``IntEnum`` (``ZeroStage(1) == 1``).
"""

from __future__ import annotations

from enum import Enum, IntEnum

__all__ = ["Choice", "ScheduleName", "Recompute", "AttentionKernel", "CPAlgorithm",
           "TPOverlap", "GradReduceDtype", "ZeroStage", "NormKind", "MLPKind", "Positions",
           "RouterScore", "FlopConvention", "Engine", "Router", "FULL_RECOMPUTE",
           "RECOMPUTE_MODULES", "RECOMPUTE_MODULES_MEGATRON", "DEFAULT_RECOMPUTE_MODULES"]


class Choice(str, Enum):
    """A closed choice: a ``str`` whose ``str()`` and format are its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every allowed text, in declaration order."""
        return tuple(member.value for member in cls)


# --- the parallel plan ------------------------------------------------------------------

class ScheduleName(Choice):
    """A pipeline schedule of :mod:`pipelining`."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"


class Recompute(Choice):
    """Activation recomputation: ``none`` keeps every activation, ``selective`` re-runs
    the core attention (Korthikanti et al. 2022), ``full`` re-runs every layer's forward
    from its input (Megatron-LM's ``--recompute-granularity full``), ``full-torch`` is full
    recomputation as PyTorch's non-reentrant ``torch.utils.checkpoint`` runs it (torchtitan's
    ``full``, FSDP's activation checkpointing): the recomputation stops once the tensors the
    backward needs are rebuilt, so the layer's last GEMM (the MLP's W_down / W2), its
    tensor-parallel reduction and the residual add are not re-run (dense GPT and Llama
    layers); ``op`` is torchtitan's per-op selective policy (the Llama layer only: the
    attention kernel's and every other matmul's outputs kept, the other matmuls — W_k, W_o,
    W_up — and every elementwise op re-run; :mod:`tensor_parallel.llama`)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    FULL_TORCH = "full-torch"
    OP = "op"


#: Megatron-Core's ``recompute_modules`` (megatron/core/transformer/transformer_config.py,
#: ``TransformerConfig.recompute_modules``: the submodules ``--recompute-granularity
#: selective`` re-runs in the backward; default ``("core_attn",)``), in its order
RECOMPUTE_MODULES_MEGATRON = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                              "shared_experts", "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")
#: the ones modelled here (:mod:`tensor_parallel.transformer`): the core attention, the
#: routed experts' activation, the two input norms, MLA's up-projections and RoPE, the
#: dense MLP
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp")
#: Megatron-Core's default (every plan without ``recompute_modules`` recomputes the core)
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


#: the recompute policies that keep only a layer's input (Megatron's and PyTorch's full
#: recomputation keep the same tensors; they differ in what the backward re-runs)
FULL_RECOMPUTE = (Recompute.FULL, Recompute.FULL_TORCH)


class AttentionKernel(Choice):
    """The attention kernel a real run uses: ``flash`` (today's fused kernels: one kernel
    forward and one backward, O(s) bytes, no s² scores kept; the timing model prices the
    device's default fused kernel), ``unfused`` (the scores kept for the backward),
    ``flash-v1`` (fused, built for Ampere — FlashAttention 1, the Triton and xformers
    kernels of 2022-23) or one fused kernel by name, priced from its published curves:
    ``flash2`` (FlashAttention-2: PyTorch's SDPA flash backend), ``flash3``
    (FlashAttention-3, Hopper) or ``cudnn`` (cuDNN's fused attention: Transformer Engine's
    FusedAttention, PyTorch's SDPA cuDNN backend). Every fused kernel has the same memory
    and trace as ``flash``."""

    FLASH = "flash"
    UNFUSED = "unfused"
    FLASH_V1 = "flash-v1"
    FLASH2 = "flash2"
    FLASH3 = "flash3"
    CUDNN = "cudnn"

    @property
    def fused(self) -> bool:
        return self is not AttentionKernel.UNFUSED

    @classmethod
    def fused_values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls if m.fused)


class CPAlgorithm(Choice):
    """How context-parallel attention exchanges K/V: around the ``ring`` (overlapping the
    attention) or ``all_gather``."""

    RING = "ring"
    ALL_GATHER = "all_gather"


class TPOverlap(Choice):
    """``backward``: each column-parallel linear's input-gradient reduction runs during
    its weight-gradient GEMM (Megatron-LM since 2021); ``te``: that, and every
    sequence-parallel all-gather and reduce-scatter run as ring steps overlapping the
    GEMM they feed or drain, forward and backward (Transformer Engine's
    ``tp_comm_overlap``: Megatron-LM ``--tp-comm-overlap``, NeMo ``tp_comm_overlap``,
    torchtitan ``enable_async_tensor_parallel``; :mod:`tensor_parallel.collective_matmul`);
    ``none``: every tensor-parallel collective on the critical path (Megatron's 2020 and
    SC'21 runs)."""

    BACKWARD = "backward"
    TE = "te"
    NONE = "none"


class GradReduceDtype(Choice):
    """The dtype of the data-parallel gradient reductions: the gradients' own (``model``)
    or ``fp32`` (Megatron-LM under --bf16, FSDP with reduce_dtype=float32)."""

    MODEL = "model"
    FP32 = "fp32"


class ZeroStage(IntEnum):
    """0: DDP (replicated optimizer state); 1: optimizer state sharded over data
    parallelism (Megatron's distributed optimizer); 2: + gradients; 3: + parameters
    (FSDP's full shard)."""

    DDP = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def values(cls) -> tuple[int, ...]:
        return tuple(member.value for member in cls)


# --- the model ---------------------------------------------------------------------------

class NormKind(Choice):
    """``layernorm`` (weight and bias, mean subtracted: GPT-2) or ``rmsnorm`` (weight
    only: Llama and its descendants)."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class MLPKind(Choice):
    """A dense MLP or expert: ``gelu`` (W2·gelu(W1·x), two matrices h×f) or a gated
    unit with three, W2·(act(W1·x) ⊙ W3·x): ``swiglu`` (SiLU, Llama) or ``geglu`` (GELU,
    Gemma)."""

    GELU = "gelu"
    SWIGLU = "swiglu"
    GEGLU = "geglu"

    @property
    def matrices(self) -> int:
        """Weight matrices of width f: 2 plain, 3 gated."""
        return 2 if self is MLPKind.GELU else 3


class Positions(Choice):
    """``learned`` absolute position embeddings (GPT-2: a table of max_seq × h) or
    ``rope`` (rotary, no parameters)."""

    LEARNED = "learned"
    ROPE = "rope"


class RouterScore(Choice):
    """How an MoE router turns logits into expert weights: ``softmax`` (Switch, Mixtral,
    Qwen) or ``sigmoid`` (DeepSeek-V3, with its auxiliary-loss-free bias)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class FlopConvention(Choice):
    """How attention's score products are counted in model FLOPs (the rest is 2 FLOPs per
    parameter that enters a product, per token, forward):

    * ``causal``: each query against the keys it sees — s/2 on average under a causal
      mask, fewer under a sliding window (FlashAttention's and torchtitan's count);
    * ``megatron``: each query against all s keys, the weights' products without the
      embedding lookup (Narayanan et al. 2021, eq. 3: 72·B·s·l·h²·(1 + s/6h + V/12lh));
    * ``palm``: 6·N per token with N every parameter, the embedding's included, plus
      12·L·H·Q·T for attention over all T keys (Chowdhery et al. 2022, App. B).
    """

    CAUSAL = "causal"
    MEGATRON = "megatron"
    PALM = "palm"


# --- serving ----------------------------------------------------------------------------

class Engine(Choice):
    """The serving engine whose scheduler a run imitates (:mod:`serving.scheduler`):
    ``vllm-v1`` — vLLM's v1 engine (0.8–0.11): continuous batching with chunked prefill
    under a token budget and a sequence cap, FCFS, recompute preemption; ``static`` —
    static batching as FasterTransformer and early TGI ran it: a batch prefilled
    together and decoded until its last request ends, no request joining mid-batch."""

    VLLM_V1 = "vllm-v1"
    STATIC = "static"


class Router(Choice):
    """How requests are spread over data-parallel replicas: ``round_robin`` in arrival
    order, or ``least_loaded`` — the replica with the fewest unfinished requests (ties to
    the lowest index)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
