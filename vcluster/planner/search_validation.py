"""The planner against Megatron-LM's published configurations (SC'21 Table 1, A100).

For each row of ``megatron_sc21_table1.csv`` (model, GPUs, global batch, and the TP / PP
the paper used), :func:`plan_against_published` runs :func:`plan_gpt` on the same GPUs
and batch and compares:

* ``best_vs_published`` = planner's best step time / the published configuration's − 1,
  the published configuration simulated exactly as ``vcluster validate-model`` does
  (:func:`~vcluster.planner.validation.micro_batch_for`, 1F1B, full recomputation);
  the acceptance asks for <= 0;
* where the published split ranks: ``split_rank``, the rank of its (TP, PP) among all
  the (TP, PP) splits, each represented by its best candidate (the table fixes only TP
  and PP), and ``split_vs_best`` = that candidate's step time / the best's − 1, with
  ``candidate_rank``, the rank of that candidate among all candidates. The acceptance
  asks for rank <= 5 or within 5% of the best.

The search is the paper's: TP, PP, DP, micro-batch, schedule and recomputation, with
data parallelism unsharded (``zero_stages=(0,)``; SC'21 predates Megatron's distributed
optimizer) and every tensor-parallel collective blocking (``tp_overlap="none"``, as the
published configuration is simulated; SC'21 predates Megatron's asynchronous
input-gradient reductions). Pass ``zero_stages`` to widen it: with ZeRO the model finds pure data
parallelism faster than the published splits for the larger rows (18B on 256 A100s:
tp 1, pp 1, dp 256 with sharded state, 44% below the published configuration's simulated step) — a prediction
of the model, not a published measurement.
"""

from __future__ import annotations

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.timing import read_data_csv

from .search import plan_gpt
from .simulation import simulate_gpt
from .validation import micro_batch_for

__all__ = ["plan_against_published", "published_rows"]


def published_rows(models=None) -> list[dict]:
    """Rows of megatron_sc21_table1.csv (all, or those whose ``model`` is in ``models``)."""
    rows = read_data_csv("megatron_sc21_table1.csv")[1]
    return [r for r in rows if models is None or r["model"] in models]


def plan_against_published(row: dict, hardware: str = "a100-80gb-dgx", **plan_kwargs) -> dict:
    """The comparison of the module docstring for one table row."""
    tp, pp, gpus, B = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["global_batch"])
    dp = gpus // (tp * pp)
    plan_kwargs.setdefault("zero_stages", (0,))     # the paper's search space
    plan_kwargs.setdefault("tp_overlap", "none")    # the paper's software (validation.py)
    model = {k: int(row[k]) for k in ("hidden", "layers", "heads", "seq", "vocab")}
    df = plan_gpt(**model, gpus=gpus, global_batch=B, hardware=hardware, **plan_kwargs)
    published = simulate_gpt(GPTConfig(**model), ParallelConfig(
        global_batch=B, micro_batch=micro_batch_for(B, dp, pp), dp=dp, pp=pp, tp=tp,
        recompute="full", tp_overlap=plan_kwargs["tp_overlap"]), hardware)
    splits = df.drop_duplicates(["tp", "pp"]).reset_index(drop=True)
    mine = splits[(splits.tp == tp) & (splits.pp == pp)]
    best = df.iloc[0]
    out = {"model": row["model"], "gpus": gpus, "tp": tp, "pp": pp,
           "planning_time_s": df.attrs["planning_time_s"], "candidates": len(df),
           "replayed": df.attrs["replayed"], "published_step_s": published.step_time_s,
           "best_step_s": float(best.step_time_s),
           "best": {k: (v.item() if hasattr(v, "item") else v) for k, v in best[
               ["tp", "pp", "dp", "micro_batch", "schedule", "virtual_stages",
                "sequence_parallel", "recompute"]].items()},
           "best_vs_published": float(best.step_time_s) / published.step_time_s - 1}
    if len(mine):
        cand = df[(df.tp == tp) & (df.pp == pp)]
        out.update(split_rank=int(mine.index[0]) + 1, candidate_rank=int(cand.index[0]) + 1,
                   split_step_s=float(mine.iloc[0].step_time_s),
                   split_vs_best=float(mine.iloc[0].step_time_s) / float(best.step_time_s) - 1,
                   split_replayed=bool(mine.iloc[0].replayed))
    else:
        out.update(split_rank=None, candidate_rank=None, split_step_s=None, split_vs_best=None,
                   split_replayed=None)
    return out
