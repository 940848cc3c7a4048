"""serving.memory: vLLM v1's KV-cache capacity — worked by hand for Llama-3.1-8B on one
H100, against modeling's independent counts (KV bytes per token, rank_params), vLLM's
layer split, and the refusals."""

import math

import pytest

from modeling import kv_bytes_per_token, load_model, parameter_count
from modeling.counts import rank_params
from modeling.errors import ConfigError
from serving.memory import (PROFILE_SAMPLER_FP32_COPIES, VLLM_NON_TORCH_BYTES,
                            activation_peak_bytes, kv_capacity, kv_page_bytes,
                            stage_weights, vllm_stage_layers)

GIB = 2**30
#: what torch reports as an 80 GB GPU's total (vLLM logs "total_gpu_memory (79.15GiB)" to
#: "(79.33GiB)" on 80 GB parts); the datasheet's 80e9 is not what vLLM multiplies
H100_TORCH_BYTES = int(79.11 * GIB)
H200_TORCH_BYTES = int(139.8 * GIB)
LLAMA8 = load_model("llama-3.1-8b")
LLAMA70 = load_model("llama-3.1-70b")


def test_llama_8b_on_one_h100_by_hand():
    """Every term of the docstring's closed form, written out for Llama-3.1-8B
    (h 4096, 32 layers, 8 KV heads of 128, f 14336 gated, V 128256) at vLLM's defaults."""
    cap = kv_capacity(LLAMA8, gpu_memory_bytes=H100_TORCH_BYTES)
    requested = math.ceil(H100_TORCH_BYTES * 0.9)
    weights = 8_030_261_248 * 2                        # the published 8.03 B, bf16
    t, r = 8192, 256                                   # max_num_batched_tokens, max_num_seqs
    forward = t * 2 * (2 * 4096 + max(4096 + 2 * 1024 + 4096 + 4096,  # qkv, attn, o_proj
                                      3 * 14336 + 4096))              # gate_up + act, down
    sampler = t * 4096 * 2 + r * 128256 * (2 + 4 * PROFILE_SAMPLER_FP32_COPIES)
    assert (forward, sampler) == (905_969_664, 920_780_800)
    page = 2 * 16 * 8 * 128 * 2                        # K and V, 16 tokens, one layer
    budget = requested - weights - sampler - VLLM_NON_TORCH_BYTES
    assert cap.weights_bytes == weights
    assert cap.activation_peak_bytes == sampler
    assert cap.requested_bytes == requested
    assert cap.budget_bytes == budget
    assert cap.bytes_per_block == page * 32 == 2 * 2**20
    assert cap.num_blocks == budget // (page * 32) == 28292
    assert cap.max_tokens == 28292 * 16
    assert cap.kv_cache_bytes <= budget < cap.kv_cache_bytes + cap.bytes_per_block
    assert cap.max_concurrency(8192) == pytest.approx(28292 / 512)
    # 128 KiB of KV per token: the reference's Llama-3-8B figure (Vidur, llm-analysis)
    assert cap.bytes_per_block // 16 == kv_bytes_per_token(LLAMA8) == 128 * 1024


@pytest.mark.parametrize("name, checkpoint_gib", [("gpt-oss-120b", 60.8),
                                                  ("gpt-oss-20b", 12.8)])
def test_mxfp4_experts_weigh_the_published_checkpoint(name, checkpoint_gib):
    """GPT-OSS's checkpoint: routed experts in MXFP4 (4.25 bits per parameter), attention,
    routers, embedding and head in bf16. The model card (arXiv 2508.10925, table 1) gives
    60.8 GiB and 12.8 GiB; kv_capacity's weights are within 0.5% of them, and replacing
    the experts' 4.25 bits by bf16's 16 adds exactly the experts' 11.75 bits each."""
    spec = load_model(name)
    mx = kv_capacity(spec, gpu_memory_bytes=H200_TORCH_BYTES,
                     expert_weight_bytes_per_param=4.25 / 8, allow_oom=True)
    assert mx.weights_bytes / GIB == pytest.approx(checkpoint_gib, rel=5e-3)
    bf16 = kv_capacity(spec, gpu_memory_bytes=H200_TORCH_BYTES, allow_oom=True)
    experts = stage_weights(spec)[0].experts
    assert bf16.weights_bytes - mx.weights_bytes == pytest.approx(experts * 11.75 / 8, abs=2)
    assert mx.num_blocks > bf16.num_blocks


def test_gpt_oss_hybrid_groups_hold_half_the_layers_per_block():
    """GPT-OSS-120B: 18 sliding (window 128) and 18 full layers of 8 KV heads of 64 —
    vLLM's hybrid manager forms two groups of 18, so a block holds 18 layers' pages
    (2·16·8·64·2 B each) where one group over all 36 would hold 36: twice the blocks for
    the same budget. The cache reports ⌊blocks / 2⌋ × 16 tokens, and a 32K request holds
    2,048 blocks in the full group and ⌈(127 + 8192)/16⌉ + 1 = 521 in the sliding one."""
    from serving.kv_groups import kv_cache_groups
    spec = load_model("gpt-oss-120b")
    groups = kv_cache_groups(spec)
    assert groups.windows == (128, None) and groups.group_size == 18
    assert groups.layers == (tuple(range(0, 36, 2)), tuple(range(1, 36, 2)))
    page = 2 * 16 * 8 * 64 * 2
    hybrid = kv_capacity(spec, gpu_memory_bytes=H100_TORCH_BYTES,
                         expert_weight_bytes_per_param=4.25 / 8)
    one = kv_capacity(spec, gpu_memory_bytes=H100_TORCH_BYTES,
                      expert_weight_bytes_per_param=4.25 / 8, hybrid_kv_cache=False)
    assert hybrid.bytes_per_block == page * 18 and one.bytes_per_block == page * 36
    assert hybrid.budget_bytes == one.budget_bytes
    assert hybrid.num_blocks == hybrid.budget_bytes // (page * 18)
    assert one.num_blocks == one.budget_bytes // (page * 36)
    assert hybrid.max_tokens == hybrid.num_blocks // 2 * 16
    assert hybrid.blocks_for_request(32768) == 2048 + 521
    assert hybrid.max_concurrency(32768) == pytest.approx(hybrid.num_blocks / 2569)
    assert one.max_concurrency(32768) == pytest.approx(one.num_blocks / 2048)
    assert kv_cache_groups(spec, hybrid=False).windows == (None,)
    assert kv_cache_groups(LLAMA8).windows == (None,)
    # the scheduler gets the groups' windows; a disaggregated plan (a KV connector, under
    # which vLLM turns the hybrid manager off) and --disable-hybrid-kv-cache-manager not
    from serving import ServingPlan
    assert ServingPlan().scheduler_settings(spec)["kv_group_windows"] == (128, None)
    assert "kv_group_windows" not in ServingPlan(prefill_replicas=1).scheduler_settings(spec)
    assert "kv_group_windows" not in ServingPlan(hybrid_kv_cache=False).scheduler_settings(
        spec)


def test_activation_peak_is_the_forward_term_when_the_logits_are_small():
    """With few sequences the sampler's R × V logits shrink and the forward's MLP
    transient (gate_up, act, down over T tokens) binds."""
    t = 4096
    assert activation_peak_bytes(LLAMA8, range(32), max_num_batched_tokens=t,
                                 max_num_seqs=8) == t * 2 * (2 * 4096 + 3 * 14336 + 4096)
    # a non-last pipeline stage runs no sampler
    assert activation_peak_bytes(LLAMA8, range(16), max_num_seqs=256, last_stage=False) \
        == 905_969_664


def test_blocks_grow_with_tp_until_one_kv_head_per_gpu():
    """Llama-3.1-70B (8 KV heads) on H200s: a block's bytes halve with each doubling of tp
    until tp = 8 leaves one KV head per GPU; at tp 16 that head is replicated (same block
    bytes); the blocks per GPU grow all along (weights shrink too)."""
    caps = {tp: kv_capacity(LLAMA70, tp=tp, gpu_memory_bytes=H200_TORCH_BYTES)
            for tp in (2, 4, 8, 16)}
    for tp in (2, 4, 8):
        assert caps[tp].bytes_per_block == 80 * kv_page_bytes(LLAMA70.layers[0], tp=tp)
        assert caps[tp].bytes_per_block == 80 * 2 * 16 * (8 // tp) * 128 * 2
    assert caps[16].bytes_per_block == caps[8].bytes_per_block
    blocks = [caps[tp].num_blocks for tp in (2, 4, 8, 16)]
    assert blocks == sorted(blocks) and len(set(blocks)) == 4
    assert caps[4].num_blocks > 2 * caps[2].num_blocks        # half the KV and the weights
    # the KV a GPU holds, summed over its tp peers, grows while heads split; per GPU it
    # only grows by the weights' share once the head is replicated
    assert caps[16].num_blocks - caps[8].num_blocks < caps[8].num_blocks - caps[4].num_blocks


def test_weights_match_rank_params_and_the_replicated_kv_heads():
    """Per GPU: rank_params' count while tp <= kv_heads; beyond it each GPU holds one whole
    KV head (vLLM replicates), 2·h·d·(1 − kv/tp) more per layer."""
    for tp in (1, 2, 4, 8):
        assert stage_weights(LLAMA70, tp=tp)[0].total == pytest.approx(
            rank_params(LLAMA70, tp=tp)[0], rel=1e-12)
    extra = 80 * 2 * 8192 * 128 * (1 - 8 / 16)
    assert stage_weights(LLAMA70, tp=16)[0].total == pytest.approx(
        rank_params(LLAMA70, tp=16)[0] + extra, rel=1e-12)
    assert stage_weights(LLAMA8)[0].total == parameter_count(LLAMA8).total


def test_experts_split_or_whole_weigh_the_same():
    """Qwen3-30B-A3B at tp 4: experts tensor-parallel (ep 1) or whole, E/ep per GPU
    (ep = tp) — the same bytes (128 experts divide evenly)."""
    q = load_model("qwen3-30b-a3b")
    a, b = stage_weights(q, tp=4, ep=1)[0], stage_weights(q, tp=4, ep=4)[0]
    assert a == b
    moe = q.layers[0].mlp
    assert a.experts == pytest.approx(48 * 128 / 4 * 3 * 2048 * moe.expert.width)


@pytest.mark.parametrize("layers, pp, sizes", [
    (32, 1, [32]), (32, 2, [16, 16]), (32, 3, [11, 11, 10]), (5, 3, [2, 2, 1]),
    (61, 4, [15, 15, 16, 15]), (80, 6, [13, 13, 13, 14, 14, 13])])
def test_stages_split_as_vllm_get_pp_indices(layers, pp, sizes):
    """vLLM's rule: ⌊L/pp⌋ each, the remainder one each on partitions[-2], [-3], ..."""
    split = vllm_stage_layers(layers, pp)
    assert [len(r) for r in split] == sizes
    assert [i for r in split for i in r] == list(range(layers))


def test_pipeline_stages_bind_on_the_least_room():
    """pp = 2: each GPU holds half the layers, so a block is half as big; the engine keeps
    the smaller count of its two stages — the last (head, sampler) here."""
    one = kv_capacity(LLAMA8, gpu_memory_bytes=H100_TORCH_BYTES)
    two = kv_capacity(LLAMA8, pp=2, gpu_memory_bytes=H100_TORCH_BYTES)
    assert two.bytes_per_block == one.bytes_per_block // 2
    assert two.stage == 1
    first, last = stage_weights(LLAMA8, pp=2)
    assert first.embedding > 0 and first.head == 0 and last.head > 0 and last.embedding == 0
    requested = math.ceil(H100_TORCH_BYTES * 0.9)
    per_stage = []
    for k, st in enumerate((first, last)):
        act = activation_peak_bytes(LLAMA8, st.layers, last_stage=k == 1)
        per_stage.append((requested - math.ceil(st.total * 2) - act - VLLM_NON_TORCH_BYTES)
                         // two.bytes_per_block)
    assert two.num_blocks == min(per_stage) == per_stage[1]
    assert two.num_blocks > 2 * one.num_blocks


def test_latent_attention_caches_one_latent_on_every_gpu():
    """DeepSeek-V3 (MLA) on 8 H200s in FP8: a block is 16 tokens of the 576-wide latent
    (kv_lora_rank 512 + rope 64) per layer, whatever tp — modeling's KV bytes per token
    (SimAI's 576·L·b)."""
    ds = load_model("deepseek-v3")
    cap = kv_capacity(ds, tp=8, gpu_memory_bytes=H200_TORCH_BYTES, weight_bytes_per_param=1)
    assert cap.bytes_per_block == 16 * 576 * 2 * 61 == 16 * kv_bytes_per_token(ds)
    assert kv_page_bytes(ds.layers[0], tp=1) == kv_page_bytes(ds.layers[0], tp=8)
    assert 0 < cap.num_blocks == cap.budget_bytes // cap.bytes_per_block
    assert cap.weights_bytes == pytest.approx(671.03e9 / 8, rel=0.02)


def test_refuses_a_plan_that_leaves_no_block():
    """Llama-3.1-70B in bf16 on one H100: 141 GB of weights on an 80 GB GPU."""
    with pytest.raises(ConfigError) as info:
        kv_capacity(LLAMA70, gpu_memory_bytes=H100_TORCH_BYTES)
    assert info.value.field == "gpu_memory_utilization"
    assert "141.11 GB weights" in str(info.value) and "allow_oom" in str(info.value)
    cap = kv_capacity(LLAMA70, gpu_memory_bytes=H100_TORCH_BYTES, allow_oom=True)
    assert cap.num_blocks == 0 and cap.budget_bytes < 0 and not cap.fits


def test_refuses_a_cache_smaller_than_one_request():
    """vLLM's check_enough_kv_cache_memory: one request of max_model_len must fit."""
    tight = dict(gpu_memory_bytes=H100_TORCH_BYTES, gpu_memory_utilization=0.22)
    cap = kv_capacity(LLAMA8, **tight)
    assert 0 < cap.max_tokens < 131072
    with pytest.raises(ConfigError) as info:
        kv_capacity(LLAMA8, max_model_len=131072, **tight)
    assert info.value.field == "max_model_len"
    assert kv_capacity(LLAMA8, max_model_len=cap.max_tokens, **tight) == cap


@pytest.mark.parametrize("kwargs, field", [
    (dict(tp=3), "tp"), (dict(ep=2), "ep"), (dict(gpu_memory_utilization=1.5),
                                              "gpu_memory_utilization"),
    (dict(block_size=0), "block_size"), (dict(weight_bytes_per_param=0),
                                         "weight_bytes_per_param"),
    (dict(gpu_memory_bytes=-1), "gpu_memory_bytes"), (dict(pp=33), "pp")])
def test_bad_input_names_the_argument(kwargs, field):
    args = dict(gpu_memory_bytes=H100_TORCH_BYTES) | kwargs
    with pytest.raises(ConfigError) as info:
        kv_capacity(LLAMA8, **args)
    assert info.value.field == field
