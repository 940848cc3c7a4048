"""A model served on modelled hardware: the KV capacity vLLM would find, the step prices,
and the simulated run under a workload — the one call ``vcluster simulate serve``, the
serving planner and the ``inference`` scenario share.

    report = simulate_serve(load_model("llama-3.1-8b"), preset("h100-dgx"),
                            ServingPlan(tp=1), Workload(1000, 1024, 128, rate=4.0))
    report.metrics.as_json()["p90_ttft_ms"]

Memory: vLLM sizes its KV cache from the GPU's total memory *as torch reports it*
(``torch.cuda.mem_get_info()[1]``), which is less than the datasheet's capacity
(:func:`reported_memory_bytes`). A deployment *fits* when every replica's KV cache holds at
least one request of the longest length it will see (``max_model_len`` when set, else the
workload's longest prompt + output) — vLLM refuses to start otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from modeling.spec import ModelSpec
from serving import ServingPlan
from serving.memory import KVCapacity, kv_capacity

from ..hardware import HardwareSpec
from .kv_transfer import NetworkKVTransfer
from .simulator import ReplicaPool, ServingResult, simulate_disaggregated, simulate_serving
from .step_cost import ServingCostModel

__all__ = ["ServeReport", "simulate_serve", "reported_memory_bytes", "serving_pricer",
           "serving_capacity", "REPORTED_MEMORY_GIB"]

_GIB = 2**30

#: the total memory torch reports per GPU (``torch.cuda.mem_get_info()[1]``, what vLLM's
#: gpu_memory_utilization multiplies), GiB, by device name. vLLM start-up logs on 80 GB
#: parts print "total_gpu_memory (79.11GiB)" to "(79.33GiB)" (public logs quoted in vLLM
#: issues and READMEs; 79.11 GiB with Llama-3-8B under V1's 8192-token default, the H100
#: case taken here; 79.15 GiB for the A100 80 GB); one 8-GPU DeepSeek-R1 log prints
#: "total_gpu_memory (139.81GiB)" (141 GB, the H200). The A100 40 GB's 39.39 GiB is
#: derived, not seen: 40 GiB less the ~0.6 GiB the 80 GB parts lose. A device not here:
#: its datasheet bytes less 1% (the measured parts lose 0.8-1.1%).
REPORTED_MEMORY_GIB = MappingProxyType({
    "H100-SXM5-80GB": 79.11, "H200-SXM-141GB": 139.81, "A100-SXM4-80GB": 79.15,
    "A100-SXM4-40GB": 39.39})
_UNLISTED_SHARE = 0.99


def reported_memory_bytes(hardware: HardwareSpec) -> int:
    """The GPU memory vLLM multiplies by gpu_memory_utilization (:data:`REPORTED_MEMORY_GIB`)."""
    device = hardware.device
    gib = REPORTED_MEMORY_GIB.get(device.name)
    if gib is None:
        return int(device.hbm_bytes * _UNLISTED_SHARE)
    return int(gib * _GIB)


def serving_pricer(spec: ModelSpec, hardware: HardwareSpec, plan: ServingPlan,
                   **options) -> ServingCostModel:
    """The step prices of one replica of ``plan``; ``options``: the cost model's other
    settings (``step_overhead_s``, ``tp_allreduce``, ...)."""
    return ServingCostModel(spec, hardware, tp=plan.tp, pp=plan.pp, ep=plan.ep,
                            dtype="fp8" if plan.weight_bytes == 1 else "bf16",
                            weight_bytes_per_param=plan.weight_bytes,
                            expert_weight_bytes_per_param=plan.expert_weight_bytes,
                            kv_bytes_per_element=plan.kv_bytes, **options)


def serving_capacity(spec: ModelSpec, hardware: HardwareSpec, plan: ServingPlan,
                     max_model_len: int | None = None) -> KVCapacity:
    """vLLM's KV cache of one replica's most loaded GPU (never raises: ``num_blocks`` 0
    when nothing fits)."""
    return kv_capacity(spec, tp=plan.tp, pp=plan.pp, ep=plan.ep,
                       gpu_memory_bytes=reported_memory_bytes(hardware),
                       gpu_memory_utilization=plan.gpu_memory_utilization,
                       block_size=plan.block_size, weight_bytes_per_param=plan.weight_bytes,
                       expert_weight_bytes_per_param=plan.expert_weight_bytes,
                       hybrid_kv_cache=plan.uses_hybrid_kv_cache,
                       kv_bytes_per_element=plan.kv_bytes,
                       max_num_batched_tokens=plan.token_budget or 8192,
                       max_num_seqs=plan.max_num_seqs, max_model_len=max_model_len,
                       allow_oom=True)


@dataclass(frozen=True)
class ServeReport:
    """What ``simulate serve`` found: the model and hardware names, the ``plan``, one
    replica's ``capacity``, the longest request (``longest_tokens``), whether it ``fits``
    (and why not), and the simulated ``result`` (None when it does not fit and the run
    was not forced)."""

    model: str
    hardware: str
    plan: ServingPlan
    capacity: KVCapacity
    longest_tokens: int
    result: ServingResult | None = field(repr=False)

    @property
    def fits(self) -> bool:
        return self.capacity.holds_request(self.longest_tokens)

    @property
    def oom_reason(self) -> str:
        c = self.capacity
        return (f"{self.model} on {self.hardware} (tp {self.plan.tp}, pp {self.plan.pp}): "
                f"the KV cache holds {c.max_tokens} tokens per replica, the "
                f"longest request needs {self.longest_tokens} (weights "
                f"{c.weights_bytes / 1e9:.1f} GB + activations "
                f"{c.activation_peak_bytes / 1e9:.1f} GB of "
                f"{c.requested_bytes / 1e9:.1f} GB usable per GPU)")

    @property
    def metrics(self):
        return None if self.result is None else self.result.metrics

    def as_json(self) -> dict:
        """vLLM bench serve's result keys, then the deployment and the physics."""
        out = {} if self.result is None else dict(self.result.metrics.as_json())
        c = self.capacity
        out.update({
            "model": self.model, "hardware": self.hardware, "tp": self.plan.tp,
            "pp": self.plan.pp, "ep": self.plan.ep, "replicas": self.plan.replicas,
            "prefill_replicas": self.plan.prefill_replicas, "engine": str(self.plan.engine),
            "enable_prefix_caching": self.plan.enable_prefix_caching,
            "num_gpus": self.plan.gpus, "fits": self.fits,
            "kv_blocks_per_replica": c.num_blocks, "kv_block_size": c.block_size,
            "kv_tokens_per_replica": c.num_blocks * c.block_size,
            "weights_gb_per_gpu": c.weights_bytes / 1e9})
        if self.result is not None:
            f = self.result.floors
            out.update({"preemptions": self.result.preemptions,
                        "prefix_cache_hit_rate": self.result.prefix_cache_hit_rate,
                        "busy_s": f.busy_s, "floor_s": f.floor_s,
                        "decode_step_ms": _ms(f.per_token_decode_s),
                        "decode_step_floor_ms": _ms(f.per_token_decode_floor_s)})
        return out

    def describe(self) -> str:
        """The vLLM-bench-style block, then the floors, the KV cache and preemptions."""
        lines = [f"{self.model} on {self.hardware}: {self.plan.replicas} replica(s)"
                 + (f" + {self.plan.prefill_replicas} prefill" if self.plan.disaggregated else "")
                 + f" of tp {self.plan.tp} x pp {self.plan.pp}"
                 + (f" (ep {self.plan.ep})" if self.plan.ep > 1 else "")
                 + f" = {self.plan.gpus} GPU(s), engine {self.plan.engine}"]
        c = self.capacity
        groups = "" if c.groups is None or not c.groups.hybrid else \
            f" in {len(c.groups.windows)} KV-cache groups of {c.groups.group_size} layers"
        lines.append(f"KV cache per replica: {c.num_blocks} blocks of {c.block_size} tokens"
                     f"{groups} ({c.max_tokens:,} tokens); weights "
                     f"{c.weights_bytes / 1e9:.1f} GB per GPU")
        if self.result is None:
            lines.append(f"not simulated: {self.oom_reason}")
            return "\n".join(lines)
        m, f = self.result.metrics, self.result.floors
        j = m.as_json()
        rule = "=" * 50
        lines += [f"{' Serving Benchmark Result (simulated) ':=^50}",
                  f"{'Successful requests:':<40}{m.completed:<10}",
                  f"{'Benchmark duration (s):':<40}{m.duration_s:<10.2f}",
                  f"{'Total input tokens:':<40}{m.total_input_tokens:<10}",
                  f"{'Total generated tokens:':<40}{m.total_output_tokens:<10}",
                  f"{'Request throughput (req/s):':<40}{m.request_throughput:<10.2f}",
                  f"{'Output token throughput (tok/s):':<40}{m.output_throughput:<10.2f}",
                  f"{'Output token throughput per GPU (tok/s):':<40}"
                  f"{m.output_throughput_per_gpu:<10.2f}",
                  f"{'Total Token throughput (tok/s):':<40}{m.total_token_throughput:<10.2f}"]
        for name, title in (("ttft", "Time to First Token"),
                            ("tpot", "Time per Output Token (excl. 1st token)"),
                            ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
            lines.append(f"{' ' + title + ' ':-^50}")
            for key, value in j.items():
                if key.endswith(f"_{name}_ms") and not key.startswith("std"):
                    label = key.split("_")[0].capitalize().replace("P", "P", 1)
                    lines.append(f"{label + ' ' + name.upper() + ' (ms):':<40}{value:<10.2f}")
        lines.append(rule)
        if f.floor_s is not None:
            lines.append(f"physics: engine busy {f.busy_s:.2f} s against a floor of "
                         f"{f.floor_s:.2f} s (weights and KV over HBM bandwidth, FLOPs over "
                         "peak)")
        if f.per_token_decode_s is not None:
            floor = f.per_token_decode_floor_s
            lines.append(f"decode step: {f.per_token_decode_s * 1e3:.2f} ms mean"
                         + ("" if floor is None else f", floor {floor * 1e3:.2f} ms"))
        hits = self.result.prefix_cache_hit_rate
        lines.append(f"KV cache: peak {self.result.peak_kv_usage:.0%} of the blocks, mean "
                     f"{m.mean_kv_cache_usage:.0%}; preemptions {self.result.preemptions}"
                     + ("" if hits is None else f"; prefix cache hit rate {hits:.1%}"))
        return "\n".join(lines)


def _ms(value):
    return None if value is None else value * 1e3


def _longest(plan: ServingPlan, requests) -> int:
    longest = max(r.prompt_len + r.output_len for r in requests)
    return min(longest, plan.max_model_len) if plan.max_model_len else longest


def simulate_serve(spec: ModelSpec, hardware: HardwareSpec, plan: ServingPlan, workload, *,
                   allow_oom: bool = False, seed: int | None = None,
                   pricer=None) -> ServeReport:
    """Serve ``workload`` (a Workload, TraceWorkload or requests) with ``plan``: the KV
    capacity, the step prices (``pricer``: default :func:`serving_pricer`) and the SimPy
    run. A deployment that does not fit is not simulated unless ``allow_oom`` (then a
    replica gets the blocks of one longest request)."""
    plan.check(spec)
    requests = workload.requests(seed) if hasattr(workload, "requests") else tuple(workload)
    longest = _longest(plan, requests)
    capacity = serving_capacity(spec, hardware, plan, plan.max_model_len)
    report = ServeReport(spec.name, hardware.name, plan, capacity, longest, None)
    if not report.fits and not allow_oom:
        return report
    blocks = capacity.num_blocks if report.fits else \
        capacity.blocks_for_request(longest) + 1
    pricer = pricer or serving_pricer(spec, hardware, plan)
    settings = plan.scheduler_settings(spec)
    concurrency = getattr(workload, "concurrency", None)
    source = workload if hasattr(workload, "requests") else requests
    if plan.disaggregated:
        prefill = ReplicaPool(pricer, blocks, plan.prefill_replicas, plan.gpus_per_replica,
                              str(plan.engine), settings)
        decode = ReplicaPool(pricer, blocks, plan.replicas, plan.gpus_per_replica,
                             str(plan.engine), settings)
        transfer = NetworkKVTransfer(spec, hardware, prefill_replicas=plan.prefill_replicas,
                                     prefill_gpus=plan.gpus_per_replica,
                                     decode_gpus=plan.gpus_per_replica,
                                     kv_bytes_per_element=plan.kv_bytes)
        result = simulate_disaggregated(source, prefill=prefill, decode=decode,
                                        kv_transfer=transfer, router=plan.router, seed=seed,
                                        concurrency=concurrency)
    else:
        result = simulate_serving(source, pricer=pricer, num_blocks=blocks,
                                  engine=plan.engine, replicas=plan.replicas,
                                  router=plan.router, gpus_per_replica=plan.gpus_per_replica,
                                  seed=seed, concurrency=concurrency, **settings)
    return ServeReport(spec.name, hardware.name, plan, capacity, longest, result)
