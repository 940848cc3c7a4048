"""argparse value types shared by the commands (each error names the value and the rule)."""

from __future__ import annotations

import argparse

from modeling import AttentionKernel, GradReduceDtype, ScheduleName, TPOverlap
from vcluster.scenario.units import parse_size

__all__ = ["positive_int", "int_at_least", "csv_of", "sizes", "add_arch_arguments",
           "add_moe_arguments", "moe_config", "model_title", "precision_name",
           "add_model_arguments", "gpt_config", "SCHEDULES", "SHAPE_FLAGS"]

#: --schedule's choices (modeling.choices.ScheduleName, the one list)
SCHEDULES = ScheduleName.values()
#: the shape flags a --model may leave out (and, given, override)
SHAPE_FLAGS = ("hidden", "layers", "heads", "seq", "vocab")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def precision_name(name: str) -> str:
    """``--precision``'s value (a :data:`vcluster.planner.precision.PRECISIONS` name), or
    ValueError naming it and the presets; checked when the command runs, not as an
    argparse type, so that only the commands that price memory load the planner."""
    # lazy: keeps vcluster --help fast (the planner package loads in ~0.27 s)
    from vcluster.planner.precision import PRECISIONS
    if name not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return name


def fraction(text: str) -> float:
    """A number in [0, 1), e.g. a share of memory left free."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value:g}")
    return value


def int_at_least(minimum: int, what: str):
    """An integer >= ``minimum``; the error says what the integer counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum} ({what}), "
                                             f"got {text!r}")
        return value
    return parse


def csv_of(allowed=None, what="value"):
    """A comma-separated list, each item one of ``allowed`` (when given)."""
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}s")
        if allowed is not None:
            bad = [i for i in items if i not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
        return items
    return parse


def sizes(text: str) -> list[int]:
    try:
        return [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arch_arguments(parser) -> None:
    """--arch gpt|llama, --kv-heads, --ffn-hidden, --head-dim, --qk-norm, --window,
    --window-layers, --attention-sinks, --qkv-bias, --out-bias, the multi-head latent
    attention flags
    (:data:`LATENT_FLAGS`), --tie-embeddings:
    GPTConfig's architecture fields
    (``pipeline_parallel.gpt.ARCHS``; a test keeps the choices equal)."""
    parser.add_argument("--arch", choices=("gpt", "llama"), default=None,
                        help="gpt (LayerNorm, gelu MLP 4h) or llama (RMSNorm, RoPE, "
                             "grouped-query attention, SwiGLU); default gpt, or the "
                             "--model's")
    parser.add_argument("--kv-heads", type=positive_int, default=None,
                        help="llama: key/value heads, dividing --heads (default --heads)")
    parser.add_argument("--ffn-hidden", type=positive_int, default=None,
                        help="llama: the SwiGLU width (default Llama's rule: 8h/3 rounded "
                             "up to a multiple of 256)")
    parser.add_argument("--head-dim", type=positive_int, default=None,
                        help="llama: each attention head's dimension d, even, independent "
                             "of --hidden (Qwen3: 128; default hidden/heads, or the "
                             "--model's)")
    parser.add_argument("--qk-norm", action="store_true",
                        help="llama: an RMSNorm of width d on every query and key head "
                             "before RoPE (Qwen3, OLMo 2; on with a --model that has it)")
    parser.add_argument("--window", type=positive_int, default=None, metavar="W",
                        help="llama: sliding-window attention, each query attending to its "
                             "last W positions (Mistral 4096, GPT-OSS 128; default none, or "
                             "the --model's): its FLOPs follow the window, not --seq")
    parser.add_argument("--window-layers", type=_layer_list, default=None,
                        metavar="I,J,...", help="llama: the layers with the --window, e.g. "
                        "0,2,4 (GPT-OSS alternates windowed and full layers; default every "
                        "layer, or the --model's)")
    parser.add_argument("--attention-sinks", action="store_true",
                        help="llama: attention sinks, one learned logit per query head in "
                             "every softmax's denominator (GPT-OSS; on with a --model that "
                             "has it)")
    parser.add_argument("--qkv-bias", action="store_true",
                        help="llama: biases on the attention's q, k and v projections "
                             "(Qwen2/Qwen2.5, GPT-OSS; on with a --model that has them)")
    parser.add_argument("--out-bias", action="store_true",
                        help="llama: a bias on the attention's output projection, added "
                             "after the tensor-parallel reduction (GPT-OSS; on with a "
                             "--model that has it)")
    for flag, text in LATENT_FLAGS.items():
        parser.add_argument(flag, type=positive_int, default=None, metavar="N",
                            help=f"llama, multi-head latent attention (DeepSeek-V2/V3): {text}")
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="the output head is the word embedding's transpose (GPT-2, "
                             "MPT, Gemma): V·h fewer parameters; on a pipeline the first and "
                             "last stage each keep a copy and sum its gradient every step")


#: multi-head latent attention's flags (GPTConfig's fields of the same names)
LATENT_FLAGS = {
    "--kv-lora-rank": "the rank of the one latent keys and values come from; turns MLA on "
                      "and needs the three head dims (default none, or the --model's)",
    "--q-lora-rank": "the queries' latent rank (default none: one h x heads·(d_n + d_r) "
                     "matrix, or the --model's)",
    "--qk-nope-head-dim": "each query/key head's dims without RoPE, d_n",
    "--qk-rope-head-dim": "each query/key head's rotary dims d_r, even (one rotary key "
                          "shared by the heads)",
    "--v-head-dim": "each value head's dims d_v"}


def add_tp_overlap_argument(parser) -> None:
    """--tp-overlap backward|te|none: ParallelConfig.tp_overlap
    (``pipeline_parallel.gpt.TP_OVERLAP``)."""
    parser.add_argument("--tp-overlap", choices=TPOverlap.values(), default="backward",
                        help="how tensor parallelism's collectives overlap compute: backward "
                             "(default: each column-parallel linear's input-gradient "
                             "all-reduce, or reduce-scatter under sequence parallelism, runs "
                             "during its weight-gradient GEMM, as Megatron-LM since 2021), te "
                             "(that, and every sequence-parallel all-gather and "
                             "reduce-scatter run as ring steps overlapping the GEMM they feed "
                             "or drain, forward and backward: Transformer Engine's "
                             "tp_comm_overlap, Megatron-LM --tp-comm-overlap, NeMo "
                             "tp_comm_overlap, torchtitan enable_async_tensor_parallel; needs "
                             "--sequence-parallel) or none (every TP collective blocking, as "
                             "the 2020/2021 Megatron runs)")


def add_grad_reduce_argument(parser) -> None:
    """--grad-reduce-dtype model|fp32: ParallelConfig.grad_reduce_dtype
    (``pipeline_parallel.gpt.GRAD_REDUCE_DTYPES``)."""
    parser.add_argument("--grad-reduce-dtype", choices=GradReduceDtype.values(),
                        default="model",
                        help="the dtype of the data-parallel gradient reductions: model "
                             "(default: the 16-bit gradients, PyTorch FSDP's default) or fp32 "
                             "(twice the bytes: Megatron-LM under --bf16, FSDP with "
                             "reduce_dtype=float32 as MosaicML's DEFAULT and torchtitan)")


def add_attention_argument(parser) -> None:
    """--attention flash|unfused|flash-v1|flash2|flash3|cudnn: ParallelConfig.attention
    (``pipeline_parallel.gpt.ATTENTION``)."""
    parser.add_argument("--attention", choices=AttentionKernel.values(), default="flash",
                        help="the attention kernel a real run uses: flash (default: fused, "
                             "no s² scores kept for the backward; the GPU's default kernel, "
                             "priced from its published curves where it has them), unfused "
                             "(the scores kept), flash-v1 (fused, a kernel built for Ampere: "
                             "FlashAttention 1, the Triton and xformers kernels of 2022-23, "
                             "priced at its measured speed on each GPU), or a fused kernel "
                             "by name, priced from its published curves on the GPU: flash2 "
                             "(FlashAttention-2, PyTorch SDPA's first choice), flash3 "
                             "(FlashAttention-3, Hopper), cudnn (cuDNN fused attention, "
                             "Transformer Engine's choice on Hopper and later)")


def add_fp8_argument(parser) -> None:
    """--fp8 and --gemm-format: the transformer layers' linear GEMMs priced in FP8 or in a
    block-scaled format (:func:`vcluster.planner.simulation.fp8_gemm`,
    :mod:`vcluster.timing.gemm_formats`); :func:`low_precision` reads them."""
    from vcluster.timing.gemm_formats import GEMM_FORMATS  # lazy: keeps --help fast
    parser.add_argument("--fp8", action="store_true",
                        help="the transformer layers' linear layers in FP8, as Transformer "
                             "Engine runs them (Megatron-LM --fp8-format): priced at the "
                             "device's FP8 peak (H100 and later; not A100); attention's "
                             "products, the output head and the rest stay BF16 "
                             "(= --gemm-format fp8)")
    parser.add_argument("--gemm-format", choices=tuple(GEMM_FORMATS), default=None,
                        help="the transformer layers' linear layers in this format: fp8 "
                             "(one scale per tensor), fp8-row (a scale per row: PyTorch's "
                             "row-scaled GEMM, torchao's rowwise recipe; 0.76 of fp8's "
                             "rate), fp8-block (DeepSeek-V3's 128-blocks), "
                             "mxfp8 (Blackwell, MI355X), nvfp4 (Blackwell), mxfp4 "
                             "(Blackwell, MI355X); each priced at its dtype's peak and "
                             "measured share; refused on hardware without it")


def low_precision(args) -> bool | str:
    """What --fp8 / --gemm-format ask for: False, True (FP8) or a format's name; both
    given must agree."""
    fmt = getattr(args, "gemm_format", None)
    if fmt is not None and args.fp8 and fmt != "fp8":
        raise ValueError(f"--fp8 and --gemm-format {fmt} disagree: --fp8 is --gemm-format "
                         f"fp8; give one of them")
    return fmt if fmt is not None and fmt != "fp8" else bool(args.fp8 or fmt)


def model_title(config, name: str | None = None) -> str:
    """"GPT h=... l=... a=... s=... V=..." (Llama: and kv=, f=; "(tied embeddings)")
    of a GPTConfig, after the model's ``name`` when there is one."""
    c = config
    if name:
        return f"{name} ({model_title(config)})"
    arch = f"{c.block} h={c.hidden}"
    extra = f" kv={c.kv_heads} f={c.ffn_hidden}" if c.block.grouped_query else ""
    if c.block.grouped_query and c.head_dim * c.heads != c.hidden:
        extra += f" d={c.head_dim}"
    extra += " qk-norm" if getattr(c, "qk_norm", False) else ""
    if getattr(c, "window", None) is not None:
        extra += f" window={c.window}" + ("" if c.window_layers is None else
                                          f" ({len(c.window_layers)}/{c.layers} layers)")
    extra += " sinks" if getattr(c, "attention_sinks", False) else ""
    extra += " qkv-bias" if getattr(c, "qkv_bias", False) else ""
    extra += " out-bias" if getattr(c, "out_bias", False) else ""
    extra += " router-bias" if getattr(c, "moe_router_bias", False) else ""
    extra += " expert-bias" if getattr(c, "moe_expert_bias", False) else ""
    if getattr(c, "kv_lora_rank", None):
        extra += f" mla(r_q={c.q_lora_rank}, r_kv={c.kv_lora_rank}, d_v={c.v_head_dim})"
    tied = " (tied embeddings)" if getattr(c, "tie_embeddings", False) else ""
    return f"{arch} l={c.layers} a={c.heads}{extra} s={c.seq} V={c.vocab}{tied}"


def _at_least_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1 (the busiest expert's "
                                         f"tokens over the mean), got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _layer_list(text: str) -> tuple[int, ...]:
    """'0,1,2' -> (0, 1, 2): layer indices, each an integer >= 0."""
    try:
        out = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        out = None
    if not out or any(i < 0 for i in out):
        raise argparse.ArgumentTypeError(f"expected layer indices like 0,1,2, got {text!r}")
    return out


def add_moe_arguments(parser, skew: bool = True) -> None:
    """--experts, --moe-top-k, --moe-ffn-hidden, --capacity-factor, --moe-router,
    --moe-shared-ffn-hidden, --moe-routed-scaling, --moe-router-bias, --moe-expert-bias
    (GPTConfig's MoE fields; llama only) and, with ``skew``, --expert-skew."""
    parser.add_argument("--experts", type=int_at_least(0, "experts per layer; 0: dense"),
                        default=None, help="llama: a mixture of this many experts in every "
                        "layer's MLP (default 0: dense, or the --model's)")
    parser.add_argument("--moe-top-k", type=positive_int, default=None,
                        help="experts per token, 1 to --experts (default 2, or the "
                             "--model's; DeepSeek-V3 and Qwen3 route 8)")
    parser.add_argument("--moe-ffn-hidden", type=positive_int, default=None,
                        help="each expert's SwiGLU width (default --ffn-hidden)")
    parser.add_argument("--capacity-factor", type=_positive_float, default=None,
                        help="per-expert capacity factor (default: dropless)")
    parser.add_argument("--moe-router", choices=("softmax", "sigmoid"), default=None,
                        help="the router's scores (default softmax, or the --model's; "
                             "DeepSeek-V3: sigmoid, gates normalised over the top k)")
    parser.add_argument("--moe-shared-ffn-hidden", type=int_at_least(0, "width"),
                        default=None, help="the always-on shared experts' total SwiGLU "
                        "width (default 0: none, or the --model's)")
    parser.add_argument("--moe-dense-layers", type=_layer_list, default=None,
                        metavar="I,J,...", help="layers whose MLP stays dense among the MoE "
                        "ones, e.g. 0,1,2 (DeepSeek-V3's first three; default none, or the "
                        "--model's)")
    parser.add_argument("--moe-groups", type=_layer_list, default=None, metavar="N,K",
                        help="group-limited routing: each token chooses among its K best of "
                        "N groups of experts (DeepSeek-V3: 8,4; default none, or the "
                        "--model's)")
    parser.add_argument("--moe-routed-scaling", type=_positive_float, default=None,
                        help="the routed experts' gate factor (default 1, or the "
                             "--model's; DeepSeek-V3 2.5)")
    parser.add_argument("--moe-router-bias", action="store_true",
                        help="a bias per expert on the router's logits (GPT-OSS; on with a "
                             "--model that has it)")
    parser.add_argument("--moe-expert-bias", action="store_true",
                        help="biases on every routed expert's gate, up and down projections "
                             "(GPT-OSS; on with a --model that has them)")
    if skew:
        parser.add_argument("--expert-skew", type=_at_least_one, default=1.0,
                            help="the busiest expert's tokens over the mean (>= 1, default "
                                 "1: balanced); the slowest expert sets the step")


def moe_config(args) -> dict:
    """GPTConfig's MoE keywords from the parsed arguments (defaults: dense, top-2)."""
    return dict(experts=args.experts or 0, moe_top_k=args.moe_top_k or 2,
                moe_ffn_hidden=args.moe_ffn_hidden, capacity_factor=args.capacity_factor,
                moe_router=args.moe_router or "softmax",
                moe_shared_ffn_hidden=args.moe_shared_ffn_hidden or 0,
                moe_routed_scaling=args.moe_routed_scaling or 1.0,
                moe_dense_layers=args.moe_dense_layers or (), moe_groups=args.moe_groups,
                moe_router_bias=bool(getattr(args, "moe_router_bias", False)),
                moe_expert_bias=bool(getattr(args, "moe_expert_bias", False)))


def add_model_arguments(parser, skew: bool = True) -> None:
    """--model NAME|PATH, the shape flags (:data:`SHAPE_FLAGS`), the architecture and MoE
    flags: a transformer as a preset, a Hugging Face config.json, or flags — flags given
    beside --model override the spec (``--model llama-3.1-405b --layers 8``: a proxy)."""
    parser.add_argument("--model", metavar="NAME|PATH", default=None,
                        help="a preset (vcluster model list) or a Hugging Face config.json; "
                             "the shape flags then override it")
    helps = {"hidden": "hidden size h", "layers": "transformer layers",
             "heads": "attention heads", "seq": "training sequence length (tokens)",
             "vocab": "vocabulary size"}
    for name in SHAPE_FLAGS:
        parser.add_argument(f"--{name}", type=positive_int, default=None,
                            help=helps[name] + (" (required)" if name == "seq" else
                                                " (required without --model)"))
    add_arch_arguments(parser)
    add_moe_arguments(parser, skew)


#: flags that override a --model's GPTConfig field of the same name
_OVERRIDES = ("hidden", "heads", "vocab", "arch", "kv_heads", "ffn_hidden", "head_dim",
              "window", "window_layers", "experts",
              "moe_top_k", "moe_ffn_hidden", "capacity_factor", "moe_router",
              "moe_shared_ffn_hidden", "moe_routed_scaling", "moe_dense_layers",
              "moe_groups")


def _latent_config(args) -> dict:
    """GPTConfig's multi-head latent attention fields from :data:`LATENT_FLAGS`."""
    return {f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_"))
            for f in LATENT_FLAGS}


def gpt_config(args, dtype: str = "float64"):
    """The GPTConfig of ``--model`` and the shape flags (:func:`add_model_arguments`);
    ValueError naming the flags missing without ``--model``."""
    # lazy: keeps vcluster --help fast (pipeline_parallel loads the emulator's programs)
    from pipeline_parallel.gpt import GPTConfig
    if args.seq is None:
        raise ValueError("--seq (the training sequence length) is required")
    if args.model is None:
        missing = [f"--{n}" for n in SHAPE_FLAGS if getattr(args, n) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or --model NAME|PATH: vcluster "
                             "model list)")
        return GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                         seq=args.seq, vocab=args.vocab, dtype=dtype, arch=args.arch or "gpt",
                         kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                         head_dim=args.head_dim, qk_norm=args.qk_norm,
                         window=args.window, window_layers=args.window_layers,
                         attention_sinks=args.attention_sinks,
                         qkv_bias=args.qkv_bias, out_bias=args.out_bias,
                         tie_embeddings=args.tie_embeddings, **moe_config(args),
                         **_latent_config(args))
    given = {f: getattr(args, f) for f in _OVERRIDES if getattr(args, f) is not None}
    given.update({f: v for f, v in _latent_config(args).items() if v is not None})
    for flag in ("tie_embeddings", "qk_norm", "attention_sinks", "qkv_bias",
                 "out_bias", "moe_router_bias",
                 "moe_expert_bias"):                           # switches: on when given
        if getattr(args, flag, False):
            given[flag] = True
    return GPTConfig.of_model(args.model, args.seq, dtype, timing_only=True,
                              layers=args.layers, **given)
