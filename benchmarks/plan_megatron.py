"""The planner against every row of Megatron-LM SC'21 Table 1 (A100-80GB DGX).

For each model: plan it on its GPU count and global batch, and compare with the
published configuration (see :mod:`vcluster.planner.search_validation`). Acceptance:
the best plan is no slower than the published configuration, and the published TP/PP
split ranks in the top 5 or within 5% of the best. Run from the repository root:

    python benchmarks/plan_megatron.py [MODEL ...] [--json PATH]
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="rows to run (default: all)")
    parser.add_argument("--json", help="write the records as JSON")
    args = parser.parse_args(argv)
    from vcluster.planner.search_validation import plan_against_published, published_rows
    records, ok = [], True
    print(f"{'model':<6}{'GPUs':>6}{'TPxPP':>7}{'plan s':>8}{'cands':>7}  {'best vs pub':>11}"
          f"{'split rank':>11}{'cand rank':>10}{'split vs best':>14}")
    for row in published_rows(args.models or None):
        r = plan_against_published(row, progress=False)
        records.append(r)
        passed = r["best_vs_published"] <= 0 and r["split_rank"] is not None and (
            r["split_rank"] <= 5 or r["split_vs_best"] <= 0.05)
        ok &= passed
        print(f"{r['model']:<6}{r['gpus']:>6}{r['tp']:>4}x{r['pp']:<2}{r['planning_time_s']:>8.1f}"
              f"{r['candidates']:>7}  {100 * r['best_vs_published']:>+10.1f}%{r['split_rank']:>11}"
              f"{r['candidate_rank']:>10}{100 * r['split_vs_best']:>+13.1f}%"
              f"  {'ok' if passed else 'FAIL'}", flush=True)
    if args.json:
        from vcluster.runtime.files import write_json
        write_json(args.json, records)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
