"""Serving as data: requests, the paged KV cache's blocks, and the schedulers of the
engines a run imitates — pure (no processes, no clocks), shared by the emulated serving
program (:mod:`pipeline_parallel.decoder`) and the serving simulator
(:mod:`vcluster.timing.serving`), so both see the same engine steps.

>>> s = VllmV1Scheduler(num_blocks=9, max_num_batched_tokens=8)
>>> s.add(Request(0, prompt_len=12, output_len=2))
>>> s.schedule()
EngineStep(index=0, prefill_tokens=8, decode_seqs=0, requests=[0])
"""

from modeling.choices import Engine, Router

from .blocks import BlockPool, blocks_for
from .plan import ServingPlan
from .request import Request
from .scheduler import (EngineStep, ScheduledRequest, StaticScheduler, StepOutcome,
                        VllmV1Scheduler, make_scheduler, steps_by_arrival)

__all__ = ["Request", "BlockPool", "blocks_for", "ScheduledRequest", "EngineStep",
           "StepOutcome", "VllmV1Scheduler", "StaticScheduler", "make_scheduler",
           "steps_by_arrival", "Engine",
           "Router", "ServingPlan"]
