"""The accounting behind a multi-model endpoint's 507: sizes, the container's memory, estimates, and
the budget's holds."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from lmi_serve.config.sizes import parse_bytes
from lmi_serve.serving import memory_budget as mb

from cgroup_trees import tree, v1, v2


@pytest.mark.parametrize(("text", "size"), [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                            ("2g", 2 * 10**9), ("1073741824", 2**30), (" 64 KiB ", 64 * 1024)])
def test_sizes_take_binary_and_decimal_units(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "lots", "4 GiBs", "-1GiB", "0", "1e9"])
def test_a_bad_size_names_the_text(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_the_containers_memory_is_its_cgroups_limit_else_the_machines(tmp_path):
    total = 8 * 2**30
    assert mb.container_memory(v2(tmp_path / "a", {"memory.max": f"{2**30}\n"})) == 2**30
    assert mb.container_memory(v1(tmp_path / "b", {"memory/memory.limit_in_bytes": f"{3 * 2**30}\n"})) == 3 * 2**30
    assert mb.container_memory(v2(tmp_path / "c", {"memory.max": "max\n"})) == total  # no limit: the machine's
    # v1's "no limit" is a huge number
    assert mb.container_memory(v1(tmp_path / "d", {"memory/memory.limit_in_bytes": "9223372036854771712\n"})) == total
    assert mb.container_memory(tree(tmp_path / "e", {})) == total  # no cgroup mounted


def test_a_limit_above_the_processs_own_cgroup_counts(tmp_path):
    # A Kubernetes pod's limit is on the pod's cgroup, its container's below it: the smaller holds.
    files = {"kubepods/pod1/memory.max": f"{2**30}\n", "kubepods/pod1/app/memory.max": "max\n"}
    assert mb.container_memory(v2(tmp_path, files, own="/kubepods/pod1/app")) == 2**30


def test_weights_count_at_the_load_dtype_from_the_headers(tmp_path):
    save_file({"a": torch.zeros(10, 20, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    elements = 10 * 20 + 5
    assert mb.weights_bytes([tmp_path], "fp32") == 4 * elements  # bf16 on disk, fp32 in memory
    assert mb.weights_bytes([tmp_path], "bf16") == 2 * elements
    assert mb.weights_bytes([tmp_path], "auto") == 4 * elements


def test_a_gguf_counts_its_dequantized_elements_not_its_file_size(tmp_path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    blocks = gguf.quants.quantize(np.zeros((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert mb.weights_bytes([tmp_path], "fp32") == 4 * 4 * 64


def test_kv_allowance_from_the_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "hidden_size": 64}))
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head_dim 64/4, fp32
    assert mb.kv_bytes(config, rows=3, dtype="fp32") == per_token * mb.KV_TOKENS_PER_ROW * 3
    assert mb.kv_bytes(tmp_path / "none.json", rows=3, dtype="fp32") == 0


def test_the_budget_refuses_what_does_not_fit_and_release_makes_room():
    budget = mb.MemoryBudget(limit=100)
    assert budget.reserve("a", 60) is None and budget.in_use == 60
    refusal = budget.reserve("b", 50)
    assert (refusal.estimate, refusal.in_use, refusal.limit) == (50, 60, 100)
    assert "unload a model" in refusal.message("b") and budget.in_use == 60  # nothing held for b
    budget.release("a")
    assert budget.reserve("b", 50) is None and budget.in_use == 50
    budget.hold("startup", 80)  # a model already in memory counts whatever the limit
    assert budget.in_use == 130 and budget.reserve("c", 1) is not None


def test_safetensors_header_is_read_without_the_data(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"}, "w": {"dtype": "F16", "shape": [1000, 1000],
                                                                 "data_offsets": [0, 2_000_000]}}).encode()
    (tmp_path / "big.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)  # no data at all
    assert mb.weights_bytes([tmp_path], "fp16") == 2 * 10**6
