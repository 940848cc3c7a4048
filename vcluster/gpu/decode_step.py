"""A transformer layer's serving steps timed with PyTorch (``vcluster bench gpu-decode``):
what :mod:`vcluster.timing.serving.measured_steps` fits and the serving cost model prices a
layer from.

The layer is one layer of a :class:`~modeling.ModelSpec` at its real shapes, as one GPU of
a tensor-parallel group of ``tp`` holds it (heads/tp query heads, max(1, kv_heads/tp) KV
heads, ffn/tp of the MLP; the two all-reduces that close it are not run — the cost model
prices them apart), written in plain PyTorch (bf16 on a GPU; fp32 on the CPU, whose bf16
GEMMs are emulated and slow), no autograd::

    x (B, S, h) -> norm -> QKV projection (QK-norm where the model has it)
                -> K, V written into a contiguous cache (B, kv_local, C, d)
                -> scaled_dot_product_attention (grouped-query: enable_gqa) -> O projection
                -> + x -> norm -> MLP (gelu; swiglu / geglu: act(gate) * up) -> + residual

with the model's norm (RMSNorm or LayerNorm) and biases. No rotary embedding (one
elementwise kernel in vLLM, under 1% of a layer's step). The cache is one contiguous
tensor per sequence batch, not vLLM's paged blocks, and attention is PyTorch's SDPA
(FlashAttention or memory-efficient kernels on a GPU), not vLLM's paged or FlashInfer
kernels; the MLP and norms run as PyTorch's eager kernels, not fused ones.

* decode step: B sequences of one new token each, attending to a cache of C tokens (the
  new one written at position C − 1: the step's context is C), B × C over
  :data:`DECODE_BATCHES` × :data:`DECODE_CONTEXTS`;
* prefill step: one sequence of T new tokens, causal, its K and V written into a cache of
  T, T over :data:`PREFILL_TOKENS`.

A point whose cache and activations would not fit the device's free memory (a share
:data:`MEMORY_SHARE` of it) is skipped and named, as is one that runs out of memory.

Timing: :class:`~vcluster.gpu.kernel_sweep.StreamTimer` — each point's step run twice to
warm up, then ``repeats`` streams of back-to-back steps (sized to about
:data:`TARGET_S`), on a GPU timed with CUDA events and queued ahead of the device (a
``torch.cuda._sleep`` holds it while the host issues the stream: the device's time, as a
CUDA graph or a host running ahead gives it); the figure is the median of the streams'
seconds per step. On the CPU: ``perf_counter``, torch on one thread
(:data:`CPU_THREADS`), at the tiny sizes — a test of the code path, not a GPU's figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from modeling.choices import MLPKind, NormKind
from modeling.errors import ConfigError
from modeling.spec import ModelSpec
from serving.memory import check_layout, kv_heads_per_rank
from vcluster.timing import PRESET_NAMES, load_hardware
from vcluster.timing.kernel_profile import LAYER_STEP_KINDS, KernelTiming, LayerShape
from vcluster.timing.serving.measured_steps import layer_shape

from .calibration import check_name, default_name
from .kernel_sweep import StreamTimer, cuda_missing, torch_missing

__all__ = ["LayerStepSweep", "TorchLayer", "measure_layer_steps", "layer_steps_hardware",
           "DECODE_BATCHES", "DECODE_CONTEXTS",
           "PREFILL_TOKENS", "TINY_DECODE_BATCHES", "TINY_DECODE_CONTEXTS",
           "TINY_PREFILL_TOKENS", "MEMORY_SHARE"]

# The sweep (issue 53's brief): decode batches and contexts, prefill prompt lengths.
DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (512, 2048, 8192)
PREFILL_TOKENS = (128, 512, 2048, 8192)
# On the CPU (--device cpu): sizes a 2-core machine runs in seconds for a small layer.
# Two batches x two contexts tell the decode form's three coefficients apart; four
# prompt lengths the prefill form's, one more than it has.
TINY_DECODE_BATCHES = (1, 8)
TINY_DECODE_CONTEXTS = (64, 512)
TINY_PREFILL_TOKENS = (16, 64, 128, 256)
#: a point is skipped when its cache and activations need more than this share of the
#: free memory (the rest: the allocator's fragmentation, cuBLAS and attention workspaces)
MEMORY_SHARE = 0.8
#: each stream of steps lasts about this long (kernel_sweep's _TARGET_S)
TARGET_S = MappingProxyType({"cuda": 0.02, "cpu": 0.01})
# steps in one stream, at most: a layer step is ~20 kernels, and 32 of them (~640
# kernels) stay inside CUDA's launch queue (1024 entries) while the device is held
_MAX_STEPS = 32
#: torch's threads on the CPU: one, as kernel_sweep's CPU sweep runs (a loaded 2-core
#: machine made every tiny call wait for the second thread's time slice: its docstring)
CPU_THREADS = 1
_INIT_STD = 0.02                      # weights ~ N(0, 0.02²), GPT-2's initialiser


@dataclass(frozen=True)
class LayerStepSweep:
    """What :func:`measure_layer_steps` measured for ``model``'s layer ``layer`` on one
    device: ``decode`` rows (batch, context, seconds), ``prefill`` rows (tokens, seconds),
    seconds per layer per step; ``skipped`` the points not run and why; ``notes`` how
    this torch ran the layer where it differs from the module docstring."""

    model: str
    layer: LayerShape
    device_name: str
    torch_version: str
    device: str                  # "cuda" or "cpu"
    dtype: str                   # "bf16" (cuda) or "fp32" (cpu)
    decode: tuple
    prefill: tuple
    skipped: tuple = ()
    repeats: int = 1
    notes: tuple = ()

    def rows(self) -> tuple:
        """The rows a hardware file carries (``device.kernels``): ``decode_layer`` BxC and
        ``prefill_layer`` T of this layer."""
        layer = str(self.layer)
        return tuple(KernelTiming("decode_layer", s, dtype=self.dtype, dims=f"{b}x{c}",
                                  layer=layer) for b, c, s in self.decode) + \
            tuple(KernelTiming("prefill_layer", s, dtype=self.dtype, dims=str(t), layer=layer)
                  for t, s in self.prefill)

    def __repr__(self) -> str:
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return (f"LayerStepSweep({self.model!r} [{self.layer}], {self.device_name!r}, torch "
                f"{self.torch_version}, {self.dtype}, {len(self.decode)} decode and "
                f"{len(self.prefill)} prefill steps{skipped}, median of {self.repeats})")


def _sizes(name: str, values) -> tuple:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                         for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {values!r}")
    return tuple(sorted(set(values)))


def measure_layer_steps(spec: ModelSpec, tp: int = 1, device: str = "cuda",
                        batches=None, contexts=None, prefill_tokens=None,
                        repeats: int = 5, seed: int = 0) -> LayerStepSweep:
    """Time ``spec``'s layer on one GPU of ``tp`` (module docstring) on ``device``
    ("cuda": the current GPU; "cpu"), decode over ``batches`` × ``contexts`` and prefill
    over ``prefill_tokens`` (defaults: the GPU sweep on "cuda", the tiny one on "cpu"),
    each point the median of ``repeats`` timed streams. ConfigError for a layer it cannot
    build (MoE, latent or sliding-window attention, sinks) or a tp the model refuses."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a modeling.ModelSpec, got {spec!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1 (timed streams per point), "
                         f"got {repeats!r}")
    check_layout(spec, tp, 1, 1)
    tiny = device == "cpu"
    batches = _sizes("batches", TINY_DECODE_BATCHES if tiny else DECODE_BATCHES) \
        if batches is None else _sizes("batches", batches)
    contexts = _sizes("contexts", TINY_DECODE_CONTEXTS if tiny else DECODE_CONTEXTS) \
        if contexts is None else _sizes("contexts", contexts)
    prefill_tokens = _sizes("prefill_tokens", TINY_PREFILL_TOKENS if tiny else PREFILL_TOKENS) \
        if prefill_tokens is None else _sizes("prefill_tokens", prefill_tokens)
    layers = {}
    for layer in spec.layers:
        shape = layer_shape(layer, spec.hidden, tp)
        if shape is None:
            raise ConfigError(
                "model", spec.name, "a model whose layers are a dense MLP behind softmax "
                "attention with no sliding window or sinks",
                f"its layer {layer} is not measured yet (MoE, latent and sliding-window "
                f"attention are priced analytically)")
        layers.setdefault(shape, layer)
    if len(layers) > 1:
        raise ConfigError("model", spec.name, "a model whose layers share one shape",
                          f"its layers have {len(layers)} shapes "
                          f"({'; '.join(map(str, layers))})")
    if why := (cuda_missing() if device == "cuda" else torch_missing()):
        raise RuntimeError(why)
    import torch
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(CPU_THREADS)
    try:
        with torch.inference_mode():
            (shape, layer), = layers.items()
            return _sweep(torch, spec, shape, layer, tp, device, batches, contexts,
                          prefill_tokens, repeats, seed)
    finally:
        torch.set_num_threads(threads)


class TorchLayer:
    """One layer of ``spec`` as one GPU of ``tp`` holds it: its local weights on
    ``device`` in ``dtype`` (drawn from ``gen``) and its forward (module docstring);
    ``params`` counts the weights."""

    def __init__(self, torch, spec: ModelSpec, layer, tp: int, device: str, dtype, gen):
        att, mlp = layer.attention, layer.mlp
        self.torch, self.F = torch, torch.nn.functional
        h, d = spec.hidden, att.head_dim
        self.hq, self.hkv, self.d = att.heads // tp, kv_heads_per_rank(att, tp), d
        self.f, self.kind = mlp.width // tp, MLPKind(mlp.kind)
        self.eps, self.rms = spec.norm_eps, spec.norm is NormKind.RMSNORM
        self.params = 0

        def weight(*size, std=_INIT_STD, when=True):
            if not when:
                return None
            self.params += torch.Size(size).numel()
            return (torch.randn(*size, device=device, dtype=dtype, generator=gen) * std)

        def ones(n, when=True):
            if not when:
                return None
            self.params += n
            return torch.ones(n, device=device, dtype=dtype)

        qkv = (self.hq + 2 * self.hkv) * d
        self.w_qkv, self.b_qkv = weight(qkv, h), weight(qkv, when=att.qkv_bias)
        self.w_o, self.b_o = weight(h, self.hq * d), weight(h, when=att.out_bias)
        up = (self.kind.matrices - 1) * self.f
        self.w_up, self.b_up = weight(up, h), weight(up, when=mlp.bias)
        self.w_down, self.b_down = weight(h, self.f), weight(h, when=mlp.bias)
        self.n1, self.n2 = ones(h), ones(h)
        self.n1_b, self.n2_b = weight(h, when=not self.rms), weight(h, when=not self.rms)
        self.q_norm, self.k_norm = ones(d, when=att.qk_norm), ones(d, when=att.qk_norm)
        self.gqa = self.hq != self.hkv
        # torch < 2.5 has no enable_gqa, < 2.4 no fused rms_norm (pyproject allows 2.3)
        self.notes = []
        self.sdpa_gqa = True
        if self.gqa:
            one = torch.zeros(1, 2, 1, 8, device=device, dtype=dtype)
            try:
                self.F.scaled_dot_product_attention(one, one[:, :1], one[:, :1],
                                                    enable_gqa=True)
            except TypeError:
                self.sdpa_gqa = False
                self.notes.append(f"torch {torch.__version__}'s SDPA has no enable_gqa: K "
                                  f"and V repeated to the query heads before attention")
        self.fused_rms = hasattr(self.F, "rms_norm")
        if self.rms and not self.fused_rms:
            self.notes.append(f"torch {torch.__version__} has no F.rms_norm: RMSNorm as "
                              f"its elementwise ops")

    def _rms(self, x, w):
        if self.fused_rms:
            return self.F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _norm(self, x, w, b):
        if self.rms:
            return self._rms(x, w)
        return self.F.layer_norm(x, (x.shape[-1],), w, b, self.eps)

    def _attention(self, q, k, v, causal: bool):
        if self.sdpa_gqa:
            return self.F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                       enable_gqa=self.gqa)
        groups = self.hq // self.hkv
        return self.F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
            is_causal=causal)

    def forward(self, x, k_cache, v_cache, causal: bool):
        """x (B, S, h); caches (B, kv_local, C, d): S = 1 writes position C − 1 and
        attends to all C (decode); S = C writes all and attends causally (prefill)."""
        F, b, s = self.F, x.shape[0], x.shape[1]
        hq, hkv, d = self.hq, self.hkv, self.d
        qkv = F.linear(self._norm(x, self.n1, self.n1_b), self.w_qkv, self.b_qkv)
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        q = q.view(b, s, hq, d).transpose(1, 2)                  # (B, hq, S, d)
        k = k.view(b, s, hkv, d).transpose(1, 2)                 # (B, hkv, S, d)
        v = v.view(b, s, hkv, d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self._rms(q, self.q_norm), self._rms(k, self.k_norm)
        c = k_cache.shape[2]
        k_cache[:, :, c - s:].copy_(k)                           # the KV-cache write
        v_cache[:, :, c - s:].copy_(v)
        a = self._attention(q, k_cache, v_cache, causal)         # (B, hq, S, d)
        x = x + F.linear(a.transpose(1, 2).reshape(b, s, hq * d), self.w_o, self.b_o)
        y = F.linear(self._norm(x, self.n2, self.n2_b), self.w_up, self.b_up)
        if self.kind is MLPKind.GELU:
            y = F.gelu(y, approximate="tanh")
        else:
            gate, up = y.chunk(2, dim=-1)
            act = F.silu(gate) if self.kind is MLPKind.SWIGLU else \
                F.gelu(gate, approximate="tanh")
            y = act * up
        return x + F.linear(y, self.w_down, self.b_down)

    def point_bytes(self, batch: int, tokens: int, context: int, element_bytes: int) -> int:
        """Bytes a step of ``batch`` × ``tokens`` new tokens over ``context`` allocates
        beyond the weights: the K and V caches, and twice the largest live activations
        (x, residual, QKV, attention output, the MLP's up projection and activation)."""
        cache = 2 * batch * self.hkv * context * self.d
        rows = batch * tokens
        h = self.w_o.shape[0]
        live = rows * (3 * h + (self.hq + 2 * self.hkv) * self.d + self.hq * self.d
                       + 2 * (self.kind.matrices - 1) * self.f)
        return (cache + 2 * live) * element_bytes


def _free_bytes(torch, device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _median_step_s(timer: StreamTimer, fn, repeats: int) -> float:
    """Two warm-up steps, then the median over ``repeats`` streams of seconds per step
    (module docstring)."""
    fn()
    fn()
    timer.sync()
    device_s, host_s = timer.stream(fn, 2)
    steps = int(min(_MAX_STEPS, max(3, TARGET_S[timer.device] / max(device_s, 1e-7))))
    ahead_s = 2.0 * host_s * steps + 1e-3 if timer.device == "cuda" else 0.0
    return statistics.median(timer.stream(fn, steps, ahead_s)[0] for _ in range(repeats))


def _sweep(torch, spec, shape, layer, tp, device, batches, contexts, prefill_tokens,
           repeats, seed) -> LayerStepSweep:
    dtype, dname, nbytes = (torch.bfloat16, "bf16", 2) if device == "cuda" \
        else (torch.float32, "fp32", 4)
    gen = torch.Generator(device=device).manual_seed(seed)
    model = TorchLayer(torch, spec, layer, tp, device, dtype, gen)
    timer = StreamTimer(torch, device)
    oom = torch.cuda.OutOfMemoryError if device == "cuda" else MemoryError
    h = spec.hidden
    decode, prefill, skipped = [], [], []

    def point(label, batch, tokens, context, causal):
        need = model.point_bytes(batch, tokens, context, nbytes)
        free = _free_bytes(torch, device)
        if need > MEMORY_SHARE * free:
            skipped.append(f"{label}: needs {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free")
            return None
        try:
            x = torch.randn(batch, tokens, h, device=device, dtype=dtype, generator=gen)
            k_cache = torch.randn(batch, model.hkv, context, model.d, device=device,
                                  dtype=dtype, generator=gen)
            v_cache = torch.randn_like(k_cache)
            return _median_step_s(timer, lambda: model.forward(x, k_cache, v_cache, causal),
                                  repeats)
        except oom:
            skipped.append(f"{label}: out of memory")
            return None
        finally:
            x = k_cache = v_cache = None
            if device == "cuda":
                torch.cuda.empty_cache()

    for c in contexts:
        for b in batches:
            seconds = point(f"decode {b}x{c}", b, 1, c, causal=False)
            if seconds is not None:
                decode.append((b, c, seconds))
    for t in prefill_tokens:
        seconds = point(f"prefill {t}", 1, t, t, causal=True)
        if seconds is not None:
            prefill.append((t, seconds))
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        import platform
        name = f"CPU ({platform.processor() or platform.machine()})"
    return LayerStepSweep(spec.name, shape, name, torch.__version__, device, dname,
                          tuple(decode), tuple(prefill), tuple(skipped), repeats,
                          tuple(model.notes))


def layer_steps_hardware(sweep: LayerStepSweep, base, name: str | None = None,
                         date: datetime.date | None = None) -> dict:
    """A hardware description (what ``load_hardware`` accepts, as a dict or as YAML) whose
    device carries ``sweep``'s rows (:meth:`LayerStepSweep.rows`) in ``device.kernels``,
    as ``vcluster hardware calibrate --gpu`` writes its sweep's: on ``base``, a preset's
    name (``{"base": base, "name": ..., "source": ..., "device": {...}}``, the preset's
    device constants kept) or a hardware document (a mapping with ``base``, e.g. a
    ``calibrate --gpu`` file read back: its constants and rows kept, rows of this layer
    and dtype replaced). ``name``: the file's name (default: the document's own, else
    ``<device>-calibrated-<date>``, date default today)."""
    date = datetime.date.today() if date is None else date
    what = (f"{len(sweep.decode)} decode and {len(sweep.prefill)} prefill steps of one "
            f"{sweep.model} layer [{sweep.layer}] measured by vcluster bench gpu-decode on "
            f"{sweep.device_name} (torch {sweep.torch_version}, {sweep.dtype}, "
            f"{date.isoformat()})")
    rows = [{f: v for f, v in dataclasses.asdict(r).items()
             if f in ("kind", "seconds") or v not in (0, "")} for r in sweep.rows()]
    if isinstance(base, str):
        if base not in PRESET_NAMES:
            raise ValueError(f"base = {base!r}: expected a preset ({', '.join(PRESET_NAMES)}) "
                             f"or a hardware document with a base")
        device = load_hardware(base).device
        document = {"base": base, "name": None, "source": f"{what}; everything else the "
                    f"preset {base}'s ({load_hardware(base).source})",
                    "device": {"source": f"{device.source}; {what}", "kernels": rows}}
    elif isinstance(base, Mapping) and isinstance(base.get("base"), str):
        document = {k: v for k, v in base.items()}
        device = dict(document.get("device") or {})
        layer = str(sweep.layer)
        kept = [r for r in device.get("kernels", ())
                if not (isinstance(r, Mapping) and r.get("kind") in LAYER_STEP_KINDS
                        and r.get("layer") == layer and r.get("dtype") == sweep.dtype)]
        device["kernels"] = kept + rows
        device["source"] = "; ".join(x for x in (device.get("source"), what) if x)
        document["device"] = device
        document["source"] = "; ".join(x for x in (document.get("source"), what) if x)
    else:
        raise ValueError(f"base: expected a preset's name or a hardware document with a "
                         f"'base' key, got {base!r}")
    document["name"] = check_name(name if name is not None else document.get("name") or
                                  default_name(sweep.device_name, date))
    load_hardware(document)                               # the file loads as written
    return {"base": document.pop("base"), "name": document.pop("name"), **document}
