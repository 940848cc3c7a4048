"""serving.kv_groups: the KV-cache groups of vLLM's hybrid manager
(``_get_kv_cache_groups_uniform_page_size``), by hand."""

import pytest

from modeling import MLP, Attention, Layer, ModelSpec
from serving.kv_groups import kv_cache_groups, layer_groups, request_blocks


def test_a_five_to_one_pattern_makes_six_groups_of_the_full_layers_count():
    """Gemma 3's 5 sliding : 1 full over 36 layers (30 + 6): groups of 6 layers, five
    sliding ones (bucket layers i, i + 5, ...) and one full; types in order of first
    appearance."""
    windows = [None if i % 6 == 5 else 1024 for i in range(36)]
    g = layer_groups(windows)
    assert g.windows == (1024,) * 5 + (None,) and g.group_size == 6
    sliding = [i for i in range(36) if windows[i]]
    assert g.layers[0] == tuple(sliding[0::5]) and g.layers[4] == tuple(sliding[4::5])
    assert g.layers[5] == tuple(range(5, 36, 6))
    assert g.stage_group_size(range(18)) == 3            # pp 2: 3 of each group per stage


def test_near_equal_buckets_pad_to_the_larger_one():
    """12 sliding + 13 full (gpt-oss-20b with a drafter's extra layer): 13 < 1.5 × 12, so
    one group of each, the sliding one padded — not 12 + 2 × 12."""
    g = layer_groups([128] * 12 + [None] * 13)
    assert g.windows == (128, None) and g.group_size == 13


def test_one_type_is_one_group_and_the_manager_off_counts_sliding_as_full():
    assert layer_groups([None] * 4).windows == (None,)
    assert layer_groups([4096] * 4).windows == (4096,)          # Mistral-7B-v0.1: sliding
    assert layer_groups([128, None] * 2, hybrid=False).windows == (None,)


def test_pages_of_different_sizes_stay_one_group():
    """vLLM rescales block sizes when pages differ; not modelled: one group."""
    spec = ModelSpec("mixed-pages", hidden=64, vocab=32, layers=(
        Layer(Attention(4, 2, 16, window=8), MLP("swiglu", 64)),
        Layer(Attention(4, 4, 16), MLP("swiglu", 64))))
    assert kv_cache_groups(spec).windows == (None,)


@pytest.mark.parametrize("tokens, expected", [(10, 3 + 3), (100, 25 + 6), (4, 1 + 1)])
def test_request_blocks(tokens, expected):
    """Full: ⌈T/4⌉; sliding 5 with a budget of 16: at most ⌈(4 + 16)/4⌉ + 1 = 6."""
    assert request_blocks((5, None), tokens, 4, 16) == expected
