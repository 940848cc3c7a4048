"""``vcluster model list`` and ``vcluster model show NAME|PATH [--json]``: the models the
tool knows by name, and what any Hugging Face ``config.json`` describes.

    vcluster model list
    vcluster model show llama-3.1-70b
    vcluster model show path/to/config.json --json

``show`` prints the architecture (layers grouped into runs of equal blocks), the
parameter counts (total and, for a mixture of experts, active per token), FLOPs per token
at ``--seq`` (forward and training, under the causal and Megatron conventions) and the KV
cache per token — each answered by :mod:`modeling.counts`.
"""

from __future__ import annotations

import json

from modeling import (FlopConvention, flops_per_token, kv_bytes_per_token, load_model,
                      parameter_count, preset_info, preset_names)

from .args import positive_int

__all__ = ["add_parser", "model_summary"]


def add_parser(commands) -> None:
    model = commands.add_parser("model", help="the models vcluster knows (presets, "
                                "Hugging Face config.json)")
    verbs = model.add_subparsers(dest="verb", required=True, metavar="VERB")
    listing = verbs.add_parser("list", help="every preset with its size")
    listing.set_defaults(run=_list)
    show = verbs.add_parser("show", help="one model: architecture, parameters, FLOPs, KV",
                            description=__doc__.split("\n\n")[0])
    show.add_argument("model", metavar="NAME|PATH",
                      help="a preset (vcluster model list) or a config.json (or its folder)")
    show.add_argument("--seq", type=positive_int, default=4096,
                      help="the sequence length of the FLOPs per token (default 4096)")
    show.add_argument("--json", action="store_true", help="print the figures as JSON")
    show.set_defaults(run=_show)


def _b(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _list(args) -> int:
    print(f"{'name':18s} {'params':>10s} {'active':>10s}  architecture")
    for name in preset_names():
        spec = load_model(name)
        count = parameter_count(spec)
        active = _b(count.active) if spec.is_moe else ""
        runs = spec.runs()
        print(f"{name:18s} {_b(count.total):>10s} {active:>10s}  {spec.num_layers} layers, "
              f"h {spec.hidden}, {runs[-1][1]}")
    return 0


def model_summary(spec, seq: int) -> dict:
    """The figures ``show`` prints, as plain data."""
    count = parameter_count(spec)
    flops = {str(c): flops_per_token(spec, seq, c).forward for c in FlopConvention}
    return {
        "name": spec.name, "source": spec.source, "hidden": spec.hidden, "vocab": spec.vocab,
        "layers": spec.num_layers, "norm": str(spec.norm), "positions": str(spec.positions),
        "tie_embeddings": spec.tie_embeddings, "mtp_layers": spec.mtp_layers,
        "blocks": [{"count": n, "attention": str(layer.attention), "mlp": str(layer.mlp)}
                   for n, layer in spec.runs()],
        "params": {"total": count.total, "active": count.active,
                   "active_without_embedding": count.active_without_embedding,
                   "embedding": count.embedding, "head": count.head,
                   "attention": count.attention, "mlp": count.mlp, "norms": count.norms,
                   "mtp": count.mtp},
        "seq": seq,
        "forward_flops_per_token": flops,
        "training_flops_per_token": {c: 3 * f for c, f in flops.items()},
        "kv_cache_bytes_per_token_bf16": kv_bytes_per_token(spec, 2),
    }


def _show(args) -> int:
    spec = load_model(args.model)
    s = model_summary(spec, args.seq)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    p = s["params"]
    print(f"{spec.name}: {s['layers']} layers, hidden {spec.hidden}, vocab {spec.vocab}, "
          f"{spec.norm}, {spec.positions} positions"
          + (", tied embeddings" if spec.tie_embeddings else ""))
    print(f"  source               {spec.source}")
    for block in s["blocks"]:
        print(f"  {block['count']:3d} x layer          {block['attention']} | {block['mlp']}")
    print(f"  parameters           {_b(p['total'])}"
          + (f", {_b(p['active'])} active per token ({_b(p['active_without_embedding'])} "
             f"without the input embedding)" if spec.is_moe else ""))
    print(f"                       embedding {_b(p['embedding'])}, head {_b(p['head'])}, "
          f"attention {_b(p['attention'])}, MLP {_b(p['mlp'])}"
          + (f"; multi-token prediction {_b(p['mtp'])} besides" if p["mtp"] else ""))
    f = s["forward_flops_per_token"]
    print(f"  FLOPs per token      at seq {args.seq}: forward {f['causal'] / 1e9:.2f} G "
          f"(causal), {f['megatron'] / 1e9:.2f} G (Megatron, full s²); training 3x")
    print(f"  KV cache             {s['kv_cache_bytes_per_token_bf16'] / 1024:.1f} KiB per "
          "token (bf16)")
    if args.model in preset_names():
        info = preset_info(args.model)
        active = f" / {info.published_active / 1e9:g} B active" \
            if info.published_active else ""
        print(f"  published            {info.published_total / 1e9:g} B{active} "
              f"({info.published_source})")
    return 0
