"""``vcluster simulate serve`` and ``vcluster plan serve``: a model served on modelled
hardware.

    vcluster simulate serve --model llama-3.1-70b --hardware h100-dgx --tp 4 \\
        --engine vllm-v1 --rate 4 --input-len 1024 --output-len 128 --requests 1000

simulates a serving deployment (``--replicas`` engines of ``--tp`` × ``--pp`` GPUs behind
``--router``; ``--prefill-replicas N`` adds N prefill-only replicas and makes it
disaggregated) under a load — ``--rate R`` requests/s (Poisson, or gamma with
``--burstiness``; inf: all at once, the default), ``--concurrency C`` requests outstanding
(closed loop, vLLM bench's ``--max-concurrency``), or ``--trace CSV`` (columns
arrival_s,input_len,output_len) — and prints the metrics as ``vllm bench serve`` does
(TTFT; TPOT, excluding the first token; ITL; E2E latency; mean, median, P90, P99;
throughput in requests, output and total tokens per second, and output tokens per second
per GPU), the physical floors beside the prediction, the KV cache (blocks per replica and
peak use) and preemptions. ``--json`` prints the same under vLLM's result keys
(``mean_ttft_ms``, ``p90_tpot_ms``, ``output_throughput``, ...); ``--json PATH`` writes them.
Exit 1 when the weights and the KV of one longest request do not fit a GPU (unless
``--allow-oom``), 2 on a bad flag.

    vcluster plan serve --model llama-3.1-70b --gpus 16 --rate 20 --slo-ttft 1000 --slo-tpot 50

searches TP × PP × EP × replicas (and prefill:decode pools with ``--disaggregated``) on
at most ``--gpus`` GPUs for the most goodput per GPU: the rate of requests that meet both
SLOs (TTFT and TPOT at their P90 by default, ``--slo-percentile``), per GPU used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from modeling.choices import Engine, Router

from .args import fraction, int_at_least, positive_int

__all__ = ["add_simulate_parser", "add_plan_parser"]


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second or inf, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _add_deployment(p, plan: bool) -> None:
    p.add_argument("--model", metavar="NAME|PATH", required=True,
                   help="a preset (vcluster model list) or a Hugging Face config.json")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="override the model's layer count (a proxy run)")
    p.add_argument("--hardware", default="h100-dgx",
                   help="a preset (vcluster hardware list) or a YAML file (default h100-dgx)")
    if not plan:
        for name, what in (("tp", "tensor-parallel degree of each replica"),
                           ("pp", "pipeline-parallel stages of each replica"),
                           ("replicas", "engine replicas behind the router (the decode pool "
                                        "when --prefill-replicas is given)")):
            p.add_argument(f"--{name}", type=positive_int, default=1,
                           help=f"{what} (default 1)")
        p.add_argument("--ep", type=positive_int, default=1,
                       help="MoE: 1 (default: every expert split over tp) or --tp (experts "
                            "whole, spread over the tp ranks: vLLM's --enable-expert-parallel)")
        p.add_argument("--prefill-replicas", type=int, default=0,
                       help="prefill-only replicas: a disaggregated deployment, the KV cache "
                            "moved to the decode replicas over the network (default 0: none)")
    p.add_argument("--engine", choices=Engine.values(), default="vllm-v1",
                   help="the engine whose scheduler is imitated (default vllm-v1: continuous "
                        "batching with chunked prefill; static: static batching)")
    p.add_argument("--router", choices=Router.values(), default="round_robin",
                   help="how requests are spread over replicas (default round_robin)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_rate, default=None,
                      help="requests per second (Poisson; gamma with --burstiness; inf: all "
                           "at once; the default without --concurrency or --trace)")
    if not plan:
        load.add_argument("--concurrency", type=positive_int, default=None,
                          help="closed loop: this many requests outstanding, a new one sent "
                               "when one finishes (vllm bench --max-concurrency)")
        load.add_argument("--trace", metavar="CSV", default=None,
                          help="requests from a CSV with columns arrival_s,input_len,"
                               "output_len (optional: prefix_len, prefix_id: a shared "
                               "prompt prefix)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the inter-arrival times (1: Poisson; default 1)")
    p.add_argument("--input-len", type=positive_int, default=1024,
                   help="prompt tokens per request (default 1024)")
    p.add_argument("--output-len", type=positive_int, default=128,
                   help="output tokens per request (default 128)")
    p.add_argument("--prefix-len", "--random-prefix-len", dest="prefix_len",
                   type=int_at_least(0, "shared prefix tokens"), default=0,
                   help="tokens every prompt starts with, the same in all (a shared system "
                        "prompt: prompts are prefix + --input-len tokens; the prefix cache "
                        "shares their KV; vllm bench --random-prefix-len; default 0)")
    p.add_argument("--requests", type=positive_int, default=1000,
                   help="requests to send (vllm bench --num-prompts; default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="the engine's token budget per step (default: vllm-v1 8192, "
                        "static none)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="most sequences running at once (default 256)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per KV-cache block (default 16)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="share of each GPU's memory the engine may use (default 0.9)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest sequence the engine accepts (default: the workload's)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="vllm-v1: admit a prompt only when it fits one step's budget whole")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="vllm-v1: a model mixing sliding-window and full layers keeps one "
                        "block table over every layer (vLLM's flag; by default the sliding "
                        "layers get their own tables, which drop blocks that left the "
                        "window)")
    p.add_argument("--no-enable-prefix-caching", action="store_true",
                   help="vllm-v1: no prefix cache (vLLM's flag; by default a preempted "
                        "request takes back the KV blocks nobody overwrote)")
    p.add_argument("--weight-dtype", choices=("bf16", "fp8", "mxfp4"), default="bf16",
                   help="bytes per weight: bf16 (default), fp8, or mxfp4 (an MoE's routed "
                        "experts in MXFP4, 4.25 bits, the rest bf16: GPT-OSS's checkpoint)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="KV-cache bytes per element: auto (the weights' 16-bit) or fp8")


def add_simulate_parser(kinds) -> None:
    p = kinds.add_parser("serve", help="a model served under a load (vLLM v1 or static "
                         "batching): TTFT, TPOT, ITL, throughput",
                         description=__doc__.split("\n\n")[1])
    _add_deployment(p, plan=False)
    p.add_argument("--allow-oom", action="store_true",
                   help="exit 0 even when the weights and one request's KV do not fit")
    p.add_argument("--json", metavar="PATH", nargs="?", const="-", default=None,
                   help="print the metrics as JSON under vLLM's result keys (or write them "
                        "to PATH)")
    p.set_defaults(run=_simulate)


def add_plan_parser(kinds) -> None:
    p = kinds.add_parser("serve", help="the serving layout with the most goodput per GPU "
                         "under TTFT/TPOT SLOs", description=__doc__.split("\n\n")[3])
    _add_deployment(p, plan=True)
    p.add_argument("--gpus", type=positive_int, required=True,
                   help="most GPUs to use")
    p.add_argument("--slo-ttft", type=_positive_float, required=True, metavar="MS",
                   help="time-to-first-token SLO in milliseconds")
    p.add_argument("--slo-tpot", type=_positive_float, required=True, metavar="MS",
                   help="time-per-output-token SLO in milliseconds")
    p.add_argument("--slo-percentile", type=_positive_float, default=90.0,
                   help="the percentile of TTFT and TPOT held to the SLOs (default 90)")
    p.add_argument("--max-tp", type=positive_int, default=None,
                   help="largest tensor-parallel degree (default: GPUs per node)")
    p.add_argument("--disaggregated", action="store_true",
                   help="also search prefill:decode pools")
    p.add_argument("--top", type=positive_int, default=10, help="rows to show (default 10)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="processes searching layouts side by side (default: the cores this "
                        "process may use)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr")
    p.add_argument("--json", metavar="PATH", nargs="?", const="-", default=None,
                   help="print the candidates as JSON (or write them to PATH)")
    p.set_defaults(run=_plan)


def _spec_and_hardware(args):
    # lazy: keeps vcluster --help fast
    from modeling.errors import ConfigError
    from modeling.presets import load_model
    from vcluster.localhost import load_hardware
    spec = load_model(args.model)
    if args.layers is not None:
        spec = spec.with_layers(args.layers)
    if args.weight_dtype == "mxfp4" and not spec.is_moe:
        raise ConfigError("weight_dtype", "mxfp4", "bf16 or fp8 for a dense model",
                          f"{spec.name} has no routed experts to store in MXFP4 (GPT-OSS's "
                          "checkpoint format: the experts MXFP4, the rest bf16)")
    return spec, load_hardware(args.hardware)


def _plan_of(args, **layout):
    from serving import ServingPlan
    from serving.plan import MXFP4_BYTES_PER_PARAM
    return ServingPlan(
        engine=args.engine, router=args.router,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        hybrid_kv_cache=not args.disable_hybrid_kv_cache_manager,
        weight_bytes=1 if args.weight_dtype == "fp8" else 2,
        expert_weight_bytes=MXFP4_BYTES_PER_PARAM if args.weight_dtype == "mxfp4" else None,
        kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2, **layout)


def _workload(args, plan_only: bool = False):
    # lazy: keeps vcluster --help fast (the timing layer loads numpy and simpy)
    from vcluster.timing.serving.workload import TraceWorkload, Workload
    if not plan_only and args.trace is not None:
        return TraceWorkload(args.trace)
    rate = math.inf if args.rate is None else args.rate
    return Workload(num_requests=args.requests, input_len=args.input_len,
                    output_len=args.output_len, rate=rate, burstiness=args.burstiness,
                    concurrency=None if plan_only else args.concurrency, seed=args.seed,
                    prefix_len=args.prefix_len)


def _emit_json(target: str, payload: dict) -> None:
    text = json.dumps(payload, indent=2, sort_keys=False)
    if target == "-":
        print(text)
        return
    # lazy: keeps vcluster --help fast; written atomically, never half a file
    from vcluster.runtime.files import write_text_atomic
    write_text_atomic(target, text + "\n")


def _simulate(args) -> int:
    # lazy: keeps vcluster --help fast (the simulator loads simpy and the hardware model)
    from vcluster.timing.serving.deployment import simulate_serve
    spec, hardware = _spec_and_hardware(args)
    plan = _plan_of(args, tp=args.tp, pp=args.pp, ep=args.ep, replicas=args.replicas,
                    prefill_replicas=args.prefill_replicas)
    report = simulate_serve(spec, hardware, plan, _workload(args), allow_oom=args.allow_oom)
    if args.json == "-":
        _emit_json("-", report.as_json())
    else:
        print(report.describe())
        if args.json:
            _emit_json(args.json, report.as_json())
    if not report.fits:
        print(f"simulate serve: {report.oom_reason}", file=sys.stderr)
        return 0 if args.allow_oom else 1
    return 0


def _plan(args) -> int:
    # lazy: keeps vcluster --help fast (the planner loads the simulator)
    from vcluster.planner.serving import plan_serve
    spec, hardware = _spec_and_hardware(args)
    base = _plan_of(args)
    result = plan_serve(spec, hardware, base, _workload(args, plan_only=True),
                        gpus=args.gpus, slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot,
                        slo_percentile=args.slo_percentile, max_tp=args.max_tp,
                        disaggregated=args.disaggregated, workers=args.workers,
                        progress=None if args.quiet else sys.stderr)
    if args.json == "-":
        _emit_json("-", result.as_json())
    else:
        print(result.describe(args.top))
        if args.json:
            _emit_json(args.json, result.as_json())
    return 0 if result.best is not None else 1

