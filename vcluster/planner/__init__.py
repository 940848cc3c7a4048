"""Planning: search the parallel configurations of a model on N GPUs, and the layouts of
one op, ranked by simulated time under the memory limit.

* :func:`plan_gpt` (:mod:`.search`): TP x PP x DP x schedule x micro-batch x recompute for
  a GPT on N GPUs: candidates (:mod:`.candidates`) screened in closed form
  (:mod:`.screen`, :mod:`.memory` in the bytes of a :mod:`.precision` policy,
  per-layer costs traced once: :mod:`.layer_cost`), the best replayed on the timing
  model (:func:`simulate_gpt`, :mod:`.simulation`, which stitches one traced stage into a
  whole step: :mod:`.stitch`);
* :func:`auto_layout` (:mod:`.auto_layout`): the layouts of one MatMul or FeedForward;
* checks against published tables (:mod:`.validation`, :mod:`.search_validation`) and
  goodput under failures (:mod:`.goodput`).

Layer: above the algorithms (tensor_parallel, pipeline_parallel) and the engines; below the
front door (vcluster.cli, vcluster.scenario).
"""

from .auto_layout import auto_ffn, auto_layout, auto_matmul, rank_ffn_layouts, rank_matmul_layouts
from .memory import MemoryBreakdown, gpt_memory
from .precision import PRECISIONS, PrecisionPolicy
from .search import plan_gpt
from .simulation import GPTSimulation, simulate_gpt

__all__ = ["plan_gpt", "simulate_gpt", "GPTSimulation", "gpt_memory", "MemoryBreakdown",
           "PrecisionPolicy", "PRECISIONS",
           "auto_layout", "auto_matmul", "auto_ffn", "rank_matmul_layouts", "rank_ffn_layouts"]
