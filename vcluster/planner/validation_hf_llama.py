"""The timing model against NVIDIA's published one-GPU Llama-3.2-1B training iterations.

:data:`HF_LLAMA_TABLE` (``hf_llama_1b_steps.csv``; its header names the source exactly:
github.com/NVIDIA/cudnn-frontend at 7606332, ``benchmark/Llama-3.2-1B-Training/``) holds
the mean iteration time of Hugging Face transformers' ``LlamaForCausalLM`` with
Llama-3.2-1B's configuration, trained on one B200 and on one H200 at six (batch, sequence)
pairs from (24, 768) to (1, 16384), with PyTorch's SDPA pinned to one of three backends.
Every row is ``held_out``: the table was added after every constant was set and nothing
was chosen on it.

Each row is simulated as a user would run it (:func:`row_config`): the ``llama-3.2-1b``
model preset (:data:`MODEL_PRESETS`: hidden 2048, 16 layers, 32 heads of 64, 8 K/V heads,
SwiGLU 8192, vocabulary 128,256, tied embeddings), one GPU, ``global_batch`` and
``micro_batch`` the row's batch, no recomputation, on the GPU's preset
(:data:`GPU_PRESETS`), the backend's fused kernel (:data:`SDPA_KERNELS`:
``CUDNN_ATTENTION`` as ``cudnn``, ``FLASH_ATTENTION`` as ``flash2``, PyTorch's vendored
FlashAttention-2) and eager PyTorch's unfused kernels of the Llama layer
(``simulate_gpt(..., eager_kernels=True)``, :mod:`.eager_kernels`), as
:func:`~.validation_long_context.validate_gpu_sweep` runs its eager rows. The
``EFFICIENT_ATTENTION`` rows (PyTorch's memory-efficient kernel) are ``refused`` by name:
no curve of that kernel is published in ``attention_benchmarks.csv``, and pricing it as
another kernel would be a guess; they stay listed with their measured figure.

What the simulated step does not share with the measured loop (each in the errors):

* the optimizer: the loop runs ``torch.optim.SGD`` without momentum over bf16 parameters
  (reads p and g, writes p); ``simulate_gpt`` has no optimizer argument and prices an
  Adam step (:data:`~.simulation.ADAM`: p, g, m, v read, p, m, v written; 3.2 ms of the
  simulated B200 step, 5.4 ms of the H200's, 1-3% of a row), where SGD moves 3 of Adam's
  7 tensors' bytes; its memory (``fits``) is Megatron's count (fp32 master weights and
  Adam state), not the loop's pure-bf16 4 bytes per parameter: step time is what is
  compared;
* the model's code: eager PyTorch's unfused kernels are counted for torchtitan's Llama
  (complex-number rotary embedding); Hugging Face's rotates with ``rotate_half`` (slices,
  a negation, a concatenation, two products and a sum per tensor), and whether it repeats
  K/V before SDPA or passes ``enable_gqa`` depends on the transformers version, which the
  source does not pin (its README states 4.35.0, which predates Llama 3.2); the model
  prices the repeat. The loop feeds ``inputs_embeds`` (no embedding lookup); the
  simulated step looks the tokens up and scatters their gradient (T·h elements);
* the clocks: the runs locked the B200 at 1665 MHz and the H200 at 1500 MHz, the parts'
  base clocks (the source's README); the presets' GEMM efficiency and attention curves
  were measured at the parts' default, boosting clocks, and the model applies no clock;
* the attention curves' head dimension and software: the rows' heads are 64 wide; the
  published ``cudnn`` curves of both GPUs and the ``flash2`` curve of the H200 have head
  dimension 128 only, read as the nearest (:meth:`~vcluster.timing.attention_kernels.
  AttentionKernelPrices.curve`); the B200's ``flash2`` has 64. Those curves were
  measured with other cuDNN releases (9.4, 9.13.1, 9.19.1) than the loop's 9.9.0;
* the host: eager PyTorch issues every kernel from Python; the model prices a fixed
  launch cost per kernel, not a host that may fall behind.

The metric is tokens/s per GPU (batch · seq over the step), with the measured and
predicted step in milliseconds beside it; :func:`summary_by` gives the mean |error| and
mean signed error per GPU and per backend.
"""

from __future__ import annotations

import statistics
from types import MappingProxyType

from pipeline_parallel.gpt import GPTConfig, ParallelConfig
from vcluster.timing import read_data_csv
from vcluster.timing.attention_kernels import NAMED_KERNELS

from .simulation import simulate_gpt

__all__ = ["HF_LLAMA_TABLE", "GPU_PRESETS", "MODEL_PRESETS", "SDPA_BACKENDS", "SDPA_KERNELS",
           "SUMMARY_KEYS", "row_config", "validate_hf_llama_steps", "summary_by"]

#: the published iteration times (module docstring)
HF_LLAMA_TABLE = "hf_llama_1b_steps.csv"
#: a row's ``gpu`` -> the hardware preset it is simulated on (one GPU of it)
GPU_PRESETS = MappingProxyType({"b200": "b200-dgx", "h200": "h200-dgx"})
#: a row's ``model`` (the Hugging Face configuration the loop builds) -> the model preset
#: (modeling/presets/llama-3.2-1b.json: meta-llama/Llama-3.2-1B's config.json)
MODEL_PRESETS = MappingProxyType({"Llama-3.2-1B": "llama-3.2-1b"})
#: PyTorch's SDPA backends the source pins (torch.nn.attention.SDPBackend names, as its
#: training_perf.py writes them)
SDPA_BACKENDS = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION")
#: a backend -> the named kernel (vcluster.timing.attention_kernels.NAMED_KERNELS) whose
#: published curves price it; a backend missing here has none and its rows are refused
SDPA_KERNELS = MappingProxyType({"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash2"})
#: the fields :func:`summary_by` groups by
SUMMARY_KEYS = ("gpu", "backend")


def _choice(r: dict, key: str, allowed) -> str:
    if r[key] not in allowed:
        raise ValueError(f"{HF_LLAMA_TABLE}: {key}={r[key]!r} (source_row "
                         f"{r.get('source_row', '?')!r}); allowed: {', '.join(allowed)}")
    return r[key]


def row_config(r: dict) -> tuple:
    """(config, parallel, hardware preset, refusal) of a table row: the model preset at
    the row's sequence, one GPU with the row's batch, the backend's kernel; ``parallel``
    None and ``refusal`` the reason where the backend has no published curve. ValueError
    naming the key and value on a GPU, model or backend this module does not know."""
    gpu = _choice(r, "gpu", tuple(GPU_PRESETS))
    model = _choice(r, "model", tuple(MODEL_PRESETS))
    backend = _choice(r, "backend", SDPA_BACKENDS)
    batch, seq = int(r["batch"]), int(r["seq"])
    cfg = GPTConfig.of_model(MODEL_PRESETS[model], seq, timing_only=True)
    if backend not in SDPA_KERNELS:
        return cfg, None, GPU_PRESETS[gpu], (
            f"backend={backend}: PyTorch's memory-efficient SDPA kernel has no published "
            f"curve in attention_benchmarks.csv (kernels with curves: "
            f"{', '.join(NAMED_KERNELS)})")
    par = ParallelConfig(global_batch=batch, micro_batch=batch,
                         attention=SDPA_KERNELS[backend])
    return cfg, par, GPU_PRESETS[gpu], ""


def validate_hf_llama_steps(on_row=None) -> list[dict]:
    """Every row of :data:`HF_LLAMA_TABLE`, in the rows' form of
    :func:`~.validation_long_context.validate_gpu_sweep`: ``metric``
    tokens_per_s_per_gpu (batch · seq over the step), ``published`` (from the measured
    step), ``step_ms`` measured; where ``status`` is ``predicted``: ``predicted``,
    ``predicted_step_ms``, ``rel_error`` = predicted / published - 1 (tokens/s), ``fits``
    (Megatron's memory count: module docstring); where ``refused``: ``reason``. ``role``
    held_out for every row. ``on_row``: called after each."""
    rows = []
    for i, r in enumerate(read_data_csv(HF_LLAMA_TABLE)[1]):
        cfg, par, hardware, refusal = row_config(r)
        batch, seq, step_s = int(r["batch"]), int(r["seq"]), float(r["step_s"])
        tokens = batch * seq
        out = {"table": HF_LLAMA_TABLE, "row": i + 1, "source_row": r["source_row"],
               "gpu": r["gpu"], "backend": r["backend"], "batch": batch, "seq": seq,
               "case": f"{r['model']} {r['gpu']} {r['backend']} b={batch} s={seq}",
               "metric": "tokens_per_s_per_gpu", "published": tokens / step_s,
               "step_ms": step_s * 1e3, "role": "held_out", "hardware": hardware}
        if par is None:
            rows.append(out | {"status": "refused", "reason": refusal})
        else:
            sim = simulate_gpt(cfg, par, hardware, eager_kernels=True)
            predicted = tokens / sim.step_time_s
            rows.append(out | {"status": "predicted", "attention": str(par.attention.value),
                               "predicted": predicted,
                               "predicted_step_ms": sim.step_time_s * 1e3,
                               "rel_error": predicted / out["published"] - 1,
                               "fits": sim.fits})
        if on_row is not None:
            on_row()
    return rows


def summary_by(rows: list[dict], key: str) -> dict:
    """Per value of ``key`` (one of :data:`SUMMARY_KEYS`), in the rows' order: rows,
    predicted, refused, and the predicted rows' mean |error| and mean signed error (None
    where none is predicted)."""
    if key not in SUMMARY_KEYS:
        raise ValueError(f"summary_by: key={key!r}; allowed: {', '.join(SUMMARY_KEYS)}")
    out: dict = {}
    for value in dict.fromkeys(r[key] for r in rows):
        mine = [r for r in rows if r[key] == value]
        errs = [r["rel_error"] for r in mine if r["status"] == "predicted"]
        out[value] = {"rows": len(mine), "predicted": len(errs),
                      "refused": sum(r["status"] == "refused" for r in mine),
                      "mean_abs": statistics.fmean(abs(e) for e in errs) if errs else None,
                      "mean_signed": statistics.fmean(errs) if errs else None}
    return out
