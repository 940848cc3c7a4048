"""A reference PyTorch GPT (or Llama) training step, timed on one device (``vcluster bench
gpu-step``): what the simulator's one-GPU prediction is checked against.

The model is the GPT of :mod:`pipeline_parallel.gpt` written as plain PyTorch: token and
position embeddings, ``layers`` pre-LayerNorm blocks (fused QKV projection, causal
``scaled_dot_product_attention`` — flash attention where the GPU has it — output
projection, 4h GELU MLP), a final LayerNorm and an output projection to the vocabulary,
untied or (``tie_embeddings``) the token embedding's weight, as nanoGPT ties it;
cross-entropy loss. Training as users run it: fp32 parameters, bf16 autocast
(on a GPU; the CPU runs fp32), AdamW (``fused=True`` on a GPU), optionally
``torch.compile``. A step is forward, backward and optimizer step, timed from a
synchronised start to a synchronised end; the figure is the median of ``steps`` steps
after ``warmup`` steps, and the peak memory is ``torch.cuda.max_memory_allocated`` over
the timed steps (what the simulator's ``peak_memory_gb``, which excludes the allocator's
reserve, is comparable to).

``arch="llama"`` times :func:`.llama_model.llama_model` instead (torchtitan's Llama 3:
RMSNorm, RoPE, grouped-query attention, SwiGLU) with its activation checkpointing
``recompute`` (``none``, ``op``, ``full``); compiled as torchtitan compiles it, each block
on its own (``torch.compile(block)``: the blocks share one compiled graph).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass

from modeling import BLOCKS, LLAMA_BLOCK, block_named

from .llama_model import LLAMA_RECOMPUTE, llama_model

__all__ = ["StepMeasurement", "measure_gpt_step"]


@dataclass(frozen=True)
class StepMeasurement:
    """What :func:`measure_gpt_step` measured."""

    step_time_s: float               # median over the timed steps
    step_times_s: tuple
    peak_memory_bytes: int | None    # None on the CPU
    losses: tuple                    # every step's loss, warm-up included
    device_name: str
    torch_version: str
    compiled: bool
    parameters: int
    arch: str = "gpt"
    recompute: str = "none"
    attention_backend: str = ""      # the SDPA backend the step was pinned to ("": PyTorch's)

    def __repr__(self) -> str:
        peak = "" if self.peak_memory_bytes is None else \
            f", peak {self.peak_memory_bytes / 1e9:.2f} GB"
        ac = "" if self.recompute == "none" else f", AC {self.recompute}"
        return (f"StepMeasurement({self.arch}, {self.step_time_s * 1e3:.2f} ms/step{peak}, "
                f"{self.device_name}, {'compiled' if self.compiled else 'eager'}{ac})")


def _model(torch, hidden: int, layers: int, heads: int, seq: int, vocab: int,
           tie_embeddings: bool = False):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.lnf, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)
            if tie_embeddings:
                self.head.weight = self.wte.weight              # one (V, h) parameter

        def forward(self, tokens, targets):
            x = self.wte(tokens) + self.wpe.weight[:tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.lnf(x))
            return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))

    return GPT()


def measure_gpt_step(hidden: int, layers: int, heads: int, seq: int, vocab: int,
                     micro_batch: int, steps: int = 8, warmup: int = 3, compile: bool = False,
                     device: str = "cuda", seed: int = 0,
                     tie_embeddings: bool = False, arch: str = "gpt",
                     kv_heads: int | None = None, ffn_hidden: int | None = None,
                     recompute: str = "none", flash: bool = False) -> StepMeasurement:
    """Time ``steps`` training steps (after ``warmup``) of the reference GPT on ``device``
    (``tie_embeddings``: its head is the token embedding's weight). ``arch="llama"``: the
    reference Llama (module docstring) with ``kv_heads`` (default ``heads``), SwiGLU width
    ``ffn_hidden`` (required) and activation checkpointing ``recompute``. ``flash``: pin
    SDPA to its FlashAttention-2 backend (a CUDA GPU only), so the kernel priced is known."""
    for name, v in (("hidden", hidden), ("layers", layers), ("heads", heads), ("seq", seq),
                    ("vocab", vocab), ("micro_batch", micro_batch), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    if tie_embeddings not in (False, True):
        raise ValueError(f"tie_embeddings must be True or False, got {tie_embeddings!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    _check_arch(arch, heads, kv_heads, ffn_hidden, recompute, tie_embeddings)
    if flash not in (False, True) or (flash and device != "cuda"):
        raise ValueError(f"flash must be False, or True on device 'cuda', got {flash!r} "
                         f"on {device!r}")
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("measure_gpt_step(device='cuda') needs a CUDA device "
                           "(torch.cuda.is_available() is False)")
    torch.manual_seed(seed)
    llama = block_named(arch) is LLAMA_BLOCK
    with torch.device(device):      # built where it runs: no host copy of the weights
        if llama:
            model = llama_model(torch, hidden, layers, heads, kv_heads or heads, ffn_hidden,
                                seq, vocab, recompute)
        else:
            model = _model(torch, hidden, layers, heads, seq, vocab, tie_embeddings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    if compile and llama:                   # per block, as torchtitan compiles
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
        step_model = model
    else:
        step_model = torch.compile(model) if compile else model
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro_batch, seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (micro_batch, seq), generator=gen).to(device)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")
    backend = contextlib.nullcontext          # a fresh context manager for each step
    if flash:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        with backend():          # the backward too: "full" re-runs the attention in it
            with autocast:
                loss = step_model(tokens, targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    peak = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return StepMeasurement(statistics.median(times), tuple(times), peak, tuple(losses), name,
                           torch.__version__, compile, sum(p.numel() for p in model.parameters()),
                           arch, recompute, "flash" if flash else "")


def _check_arch(arch, heads, kv_heads, ffn_hidden, recompute, tie_embeddings) -> None:
    """The Llama-only arguments: refused with the GPT, checked with the Llama."""
    if arch not in BLOCKS:
        raise ValueError(f"arch must be one of {tuple(BLOCKS)}, got {arch!r}")
    if block_named(arch) is not LLAMA_BLOCK:
        for name, v, default in (("kv_heads", kv_heads, None), ("ffn_hidden", ffn_hidden, None),
                                 ("recompute", recompute, "none")):
            if v != default:
                raise ValueError(f"{name}={v!r} is the Llama's (arch='llama'); the reference "
                                 f"GPT has none")
        return
    if tie_embeddings:
        raise ValueError("tie_embeddings=True: the reference Llama's output projection is "
                         "untied (arch='llama')")
    if isinstance(ffn_hidden, bool) or not isinstance(ffn_hidden, int) or ffn_hidden < 1:
        raise ValueError(f"ffn_hidden must be an int >= 1 with arch='llama', got {ffn_hidden!r}")
    kv = heads if kv_heads is None else kv_heads
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ValueError(f"kv_heads must be an int >= 1 dividing heads={heads}, got {kv_heads!r}")
    if recompute not in LLAMA_RECOMPUTE:
        raise ValueError(f"recompute must be one of {LLAMA_RECOMPUTE}, got {recompute!r}")
