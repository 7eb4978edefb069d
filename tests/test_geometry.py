"""Model presets, the Hugging Face config parser, page sizes and engine-style pointer math."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvverify.geometry import PRESETS, ConfigError, KVLayout, ModelGeometry, from_hf_config, preset

# Page bytes at 16 tokens per page, worked out by hand:
# tokens * kv heads * head_dim * 2 bytes (bf16); MLA: tokens * (512 + 64) * 2.
PAGE_BYTES_16 = {
    "llama-3.1-8b": 16 * 8 * 128 * 2,  # 32768
    "llama-3.1-70b": 16 * 8 * 128 * 2,  # 32768
    "qwen2.5-7b": 16 * 4 * 128 * 2,  # 16384
    "mistral-7b": 16 * 8 * 128 * 2,  # 32768
    "gemma-2-9b": 16 * 8 * 256 * 2,  # 65536
    "deepseek-v3": 16 * 576 * 2,  # 18432
}
NUM_TENSORS = {
    "llama-3.1-8b": 64,
    "llama-3.1-70b": 160,
    "qwen2.5-7b": 56,
    "mistral-7b": 64,
    "gemma-2-9b": 84,
    "deepseek-v3": 61,  # one latent tensor per layer
}


@pytest.mark.parametrize("name", sorted(PAGE_BYTES_16))
def test_preset_page_and_block_bytes(name):
    layout = KVLayout(PRESETS[name], block_size=16)
    assert layout.page_bytes == PAGE_BYTES_16[name]
    assert layout.num_tensors == NUM_TENSORS[name]
    assert layout.block_bytes == PAGE_BYTES_16[name] * NUM_TENSORS[name]
    assert layout.cpu_block_bytes == layout.block_bytes


def test_presets_are_the_issue_list():
    assert set(PRESETS) == set(PAGE_BYTES_16)
    assert preset("Llama-3.1-8B") is PRESETS["llama-3.1-8b"]
    with pytest.raises(ValueError, match="known: llama-3.1-8b"):
        preset("gpt-5")


def test_llama_8b_block_is_two_mib():
    # 32 layers * (K + V) * 32 KiB: the number engines print for 8B at block_size 16.
    assert KVLayout(PRESETS["llama-3.1-8b"]).block_bytes == 2 * 1024 * 1024


def test_block_size_scales_the_page():
    assert KVLayout(PRESETS["qwen2.5-7b"], block_size=32).page_bytes == 32 * 4 * 128 * 2


@pytest.mark.parametrize(
    ("tp", "heads_per_rank"),
    [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1)],  # 16 > 8 heads: each rank keeps one, replicated
)
def test_llama_70b_tensor_parallel(tp, heads_per_rank):
    layout = KVLayout(PRESETS["llama-3.1-70b"], tp=tp)
    assert layout.kv_heads_per_rank == heads_per_rank
    assert layout.page_bytes == 16 * heads_per_rank * 128 * 2
    assert layout.num_tensors == 160  # layers are not split by tp


@pytest.mark.parametrize("tp", [3, 6, 12])
def test_tp_that_does_not_divide_kv_heads_is_rejected(tp):
    with pytest.raises(ValueError, match="tp="):
        KVLayout(PRESETS["llama-3.1-70b"], tp=tp)


def test_mla_latent_is_replicated_across_tp():
    one, eight = KVLayout(PRESETS["deepseek-v3"]), KVLayout(PRESETS["deepseek-v3"], tp=8)
    assert one.page_bytes == eight.page_bytes == 18432
    assert eight.kv_heads_per_rank == 1


def test_unsplit_kv_puts_k_and_v_in_one_page():
    g = dataclasses.replace(PRESETS["llama-3.1-8b"], kv_split=False)
    layout = KVLayout(g)
    assert layout.num_tensors == 32
    assert layout.page_bytes == 2 * 32768
    assert layout.block_bytes == KVLayout(PRESETS["llama-3.1-8b"]).block_bytes


@pytest.mark.parametrize(
    "kwargs", [{"block_size": 0}, {"tp": -1}, {"block_size_factor": 0}, {"block_size": 2.0}]
)
def test_layout_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError):
        KVLayout(PRESETS["llama-3.1-8b"], **kwargs)


def test_page_must_be_whole_words():
    g = ModelGeometry("tiny", 1, 1, 3, 1)  # 1 token * 3 bytes
    with pytest.raises(ValueError, match="multiple of 8"):
        KVLayout(g, block_size=1)


def test_geometry_rejects_bad_fields():
    with pytest.raises(ValueError, match="num_layers"):
        ModelGeometry("x", 0, 8, 128, 2)
    with pytest.raises(ValueError, match="dtype_bytes"):
        ModelGeometry("x", 1, 8, 128, 3)
    with pytest.raises(ValueError, match="MLA"):
        ModelGeometry("x", 1, 8, 576, 2, mla_latent_dim=576, kv_split=False)


# -- pointers ----------------------------------------------------------------------------


def test_gpu_page_pointers_are_base_plus_block_times_page():
    layout = KVLayout(PRESETS["qwen2.5-7b"])  # 56 tensors, 16 KiB pages
    bases = [0x7F00_0000_0000 + t * 0x1_0000_0000 for t in range(56)]
    ptrs = layout.page_ptrs(bases, np.array([0, 5, 3], dtype=np.int64))
    assert ptrs.shape == (56, 3) and ptrs.dtype == np.int64
    assert ptrs[0].tolist() == [bases[0], bases[0] + 5 * 16384, bases[0] + 3 * 16384]
    assert ptrs[55, 1] == bases[55] + 5 * 16384


def test_pointer_inputs_are_checked():
    layout = KVLayout(PRESETS["deepseek-v3"])
    with pytest.raises(ValueError, match="61 tensor base pointers"):
        layout.page_ptrs([0] * 60, np.array([1]))
    with pytest.raises(ValueError, match="non-negative"):
        layout.page_ptrs([0] * 61, np.array([-1]))
    with pytest.raises(ValueError, match="integer"):
        layout.page_ptrs([0] * 61, np.array([1.5]))
    with pytest.raises(ValueError, match="1-D"):
        layout.page_ptrs([0] * 61, np.zeros((2, 2), dtype=np.int64))


def test_cpu_slots_expand_like_the_engine():
    layout = KVLayout(PRESETS["llama-3.1-8b"], block_size_factor=4)
    # vLLM's expand_block_ids docstring example: [0, 1, 3] with factor 4.
    assert layout.cpu_slot_ids(np.array([0, 1, 3])).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        12,
        13,
        14,
        15,
    ]
    assert layout.cpu_slot_ids(np.array([2, 0]), skip=3).tolist() == [11, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="skip"):
        layout.cpu_slot_ids(np.array([0]), skip=4)
    assert layout.cpu_page_bytes == 4 * 32768
    assert layout.cpu_tensor_bytes(10) == 10 * 4 * 32768
    assert layout.gpu_tensor_bytes(10) == 10 * 32768


def _bases(layout, start):
    return [start + t * (1 << 32) for t in range(layout.num_tensors)]


def test_store_maps_gpu_block_j_to_cpu_block_j_div_f_at_sub_offset():
    f, page = 4, 32768
    layout = KVLayout(PRESETS["llama-3.1-8b"], block_size_factor=f)
    gpu_bases, cpu_bases = _bases(layout, 1 << 40), _bases(layout, 1 << 44)
    gpu_ids = np.array([9, 2, 7, 4, 30, 31, 0, 1], dtype=np.int64)
    cpu_ids = np.array([5, 1], dtype=np.int64)
    src, dst, sizes = layout.transfer_triples("store", gpu_bases, cpu_bases, gpu_ids, cpu_ids)
    assert src.shape == dst.shape == sizes.shape == (64 * 8,)
    assert set(sizes.tolist()) == {page}
    for t in (0, 1, 63):  # tensor-major order
        for j, g in enumerate(gpu_ids):
            k = t * len(gpu_ids) + j
            assert src[k] == gpu_bases[t] + g * page
            cpu_block = cpu_ids[j // f]
            assert dst[k] == cpu_bases[t] + cpu_block * f * page + (j % f) * page


def test_load_swaps_sides_and_may_start_inside_the_first_cpu_block():
    f, page = 4, 32768
    layout = KVLayout(PRESETS["llama-3.1-8b"], block_size_factor=f)
    gpu_bases, cpu_bases = _bases(layout, 1 << 40), _bases(layout, 1 << 44)
    gpu_ids = np.array([10, 11, 12, 13, 14, 15], dtype=np.int64)  # 6 pages from 2 CPU blocks
    src, dst, _ = layout.transfer_triples("load", gpu_bases, cpu_bases, gpu_ids, np.array([3, 8]))
    # the first two slots of CPU block 3 are skipped, as the engine does
    expected_slots = [14, 15, 32, 33, 34, 35]
    assert src[:6].tolist() == [cpu_bases[0] + s * page for s in expected_slots]
    assert dst[:6].tolist() == [gpu_bases[0] + g * page for g in gpu_ids]


def test_transfer_rejects_mismatched_counts():
    layout = KVLayout(PRESETS["llama-3.1-8b"], block_size_factor=4)
    b = _bases(layout, 0)
    with pytest.raises(ValueError, match="whole CPU blocks|do not match"):
        layout.transfer_triples("store", b, b, np.arange(3), np.array([0]))
    with pytest.raises(ValueError, match="do not match"):
        layout.transfer_triples("load", b, b, np.arange(4), np.array([0, 1]))  # a whole block idle
    with pytest.raises(ValueError, match="do not match"):
        layout.transfer_triples("load", b, b, np.arange(5), np.array([0]))
    with pytest.raises(ValueError, match="direction"):
        layout.transfer_triples("evict", b, b, np.arange(4), np.array([0]))


@given(
    f=st.integers(1, 8),
    n_cpu=st.integers(1, 6),
    data=st.data(),
)
def test_transfer_pages_are_disjoint_and_inside_their_tensors(f, n_cpu, data):
    g = ModelGeometry(
        "small", 2, 2, 8, 2
    )  # 2 layers * K/V = 4 tensors, 16 * 2 * 8 * 2 = 512 B pages
    layout = KVLayout(g, block_size=16, block_size_factor=f)
    num_gpu_blocks, num_cpu_blocks = 64, 8
    skip = data.draw(st.integers(0, f - 1))
    n_gpu = n_cpu * f - skip
    gpu_ids = np.array(data.draw(st.permutations(range(num_gpu_blocks)))[:n_gpu])
    cpu_ids = np.array(data.draw(st.permutations(range(num_cpu_blocks)))[:n_cpu])
    gpu_bases = [t * layout.gpu_tensor_bytes(num_gpu_blocks) for t in range(4)]
    cpu_base0 = 1 << 30
    cpu_bases = [cpu_base0 + t * layout.cpu_tensor_bytes(num_cpu_blocks) for t in range(4)]
    src, dst, sizes = layout.transfer_triples("load", gpu_bases, cpu_bases, gpu_ids, cpu_ids)
    # no two copies overlap on either side, and every copy stays within its tensor
    for ptrs, bases, tensor_bytes in (
        (dst, gpu_bases, layout.gpu_tensor_bytes(num_gpu_blocks)),
        (src, cpu_bases, layout.cpu_tensor_bytes(num_cpu_blocks)),
    ):
        order = np.sort(ptrs)
        assert np.all(np.diff(order) >= layout.page_bytes)
        t = np.searchsorted(bases, ptrs, side="right") - 1
        assert np.all(ptrs + sizes <= np.asarray(bases)[t] + tensor_bytes)


def test_describe_is_json_ready():
    d = KVLayout(PRESETS["gemma-2-9b"], tp=2).describe()
    json.dumps(d)
    assert d["page_bytes"] == 16 * 4 * 256 * 2 and d["model"] == "gemma-2-9b"


# -- Hugging Face config.json --------------------------------------------------------------

# Excerpts of the published config.json files (the fields the parser reads, plus a few
# it must ignore).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
    "torch_dtype": "bfloat16",
}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "head_dim": 256,
    "hidden_size": 3584,  # 3584 / 16 = 224: head_dim is not hidden_size / heads
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
QWEN_25_7B = {
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "torch_dtype": "bfloat16",
}


def _write(tmp_path, config, name="model"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d / "config.json"


@pytest.mark.parametrize(
    ("config", "preset_name"),
    [
        (LLAMA_31_8B, "llama-3.1-8b"),
        (GEMMA_2_9B, "gemma-2-9b"),
        (DEEPSEEK_V3, "deepseek-v3"),
        (QWEN_25_7B, "qwen2.5-7b"),
    ],
)
def test_config_files_match_the_presets(tmp_path, config, preset_name):
    g = from_hf_config(_write(tmp_path, config, preset_name))
    assert dataclasses.replace(g, name=preset_name) == PRESETS[preset_name]
    assert g.name == preset_name  # named after the checkpoint directory


def test_directory_text_config_and_name(tmp_path):
    path = _write(tmp_path, {"model_type": "llava", "text_config": LLAMA_31_8B})
    g = from_hf_config(path.parent, name="mm")
    assert (g.name, g.num_layers, g.num_kv_heads, g.head_dim) == ("mm", 32, 8, 128)


def test_text_config_inherits_the_top_level_dtype():
    text = _without(LLAMA_31_8B, "torch_dtype")
    assert from_hf_config({"torch_dtype": "float32", "text_config": text}).dtype_bytes == 4
    assert from_hf_config({"torch_dtype": "float32", "text_config": LLAMA_31_8B}).dtype_bytes == 2


def test_missing_kv_heads_means_multi_head_attention():
    config = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert from_hf_config(config).num_kv_heads == 32
    assert from_hf_config({**config, "num_key_value_heads": None}).num_kv_heads == 32


def test_dtype_spellings_and_override():
    base = {k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}
    assert from_hf_config({**base, "dtype": "float32"}).dtype_bytes == 4
    assert from_hf_config({**base, "torch_dtype": "torch.float16"}).dtype_bytes == 2
    assert from_hf_config({**base, "torch_dtype": "float16", "dtype": "float16"}).dtype_bytes == 2
    assert from_hf_config(base, kv_cache_dtype="fp8").dtype_bytes == 1
    assert from_hf_config(LLAMA_31_8B, kv_cache_dtype="float8_e4m3fn").dtype_bytes == 1


def _without(config, field):
    return {k: v for k, v in config.items() if k != field}


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        (_without(LLAMA_31_8B, "num_hidden_layers"), "num_hidden_layers", "missing"),
        ({**LLAMA_31_8B, "num_hidden_layers": 0}, "num_hidden_layers", "positive"),
        ({**LLAMA_31_8B, "num_hidden_layers": 32.0}, "num_hidden_layers", "integer"),
        ({**LLAMA_31_8B, "num_hidden_layers": "32"}, "num_hidden_layers", "integer"),
        ({**LLAMA_31_8B, "num_key_value_heads": True}, "num_key_value_heads", "integer"),
        ({**LLAMA_31_8B, "num_key_value_heads": -8}, "num_key_value_heads", "positive"),
        ({**LLAMA_31_8B, "num_key_value_heads": 64}, "num_key_value_heads", "more than"),
        ({**LLAMA_31_8B, "num_key_value_heads": 6}, "num_key_value_heads", "does not divide"),
        (_without(LLAMA_31_8B, "num_attention_heads"), "num_attention_heads", "missing"),
        (_without(LLAMA_31_8B, "hidden_size"), "hidden_size", "missing"),
        ({**LLAMA_31_8B, "hidden_size": 4100}, "hidden_size", "not divisible"),
        ({**GEMMA_2_9B, "head_dim": 0}, "head_dim", "positive"),
        (_without(LLAMA_31_8B, "torch_dtype"), "torch_dtype", "missing"),
        ({**LLAMA_31_8B, "torch_dtype": "int4"}, "torch_dtype", "unknown"),
        ({**LLAMA_31_8B, "torch_dtype": ["bfloat16"]}, "torch_dtype", "unknown"),
        ({**LLAMA_31_8B, "dtype": "float32"}, "dtype", "contradicts"),
        (_without(DEEPSEEK_V3, "qk_rope_head_dim"), "qk_rope_head_dim", "missing"),
        ({**DEEPSEEK_V3, "kv_lora_rank": 0}, "kv_lora_rank", "positive"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, config, field, message):
    with pytest.raises(ConfigError, match=message) as info:
        from_hf_config(_write(tmp_path, config))
    assert info.value.field == field
    assert str(info.value).startswith(field)
    assert isinstance(info.value, ValueError)


def test_kv_cache_dtype_override_is_checked():
    with pytest.raises(ConfigError) as info:
        from_hf_config(LLAMA_31_8B, kv_cache_dtype="int3")
    assert info.value.field == "kv_cache_dtype"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_unreadable_config(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        from_hf_config(path)
    assert info.value.field == "config.json"


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        from_hf_config(tmp_path / "nope.json")
