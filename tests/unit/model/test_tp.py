"""Tensor parallelism's start-up rules (model/tp.py, config/sources.py, model/loader.py): which models and
options can run sharded, how many ranks `max` means, how the cores are shared out."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from lmi_serve.config.sources import ConfigError, load_model_config
from lmi_serve.model.loader import choose_placement
from lmi_serve.model.source import ModelLoadError
from lmi_serve.model.tp import TensorParallelError, check_tp_plan, resolve_degree, threads_per_rank

SMOLLM2_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def test_a_model_without_a_tp_plan_is_refused_with_the_option_to_use_instead():
    with pytest.raises(TensorParallelError) as caught:
        check_tp_plan(GPT2Config(), 2)
    message = str(caught.value)
    assert "tensor_parallel_degree=2" in message and "gpt2" in message and "option.device_map=auto" in message


def test_heads_the_ranks_cannot_split_evenly_are_refused_naming_the_counts():
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_degree=2: .* 9 attention heads"):
        check_tp_plan(LlamaConfig(**SMOLLM2_HEADS), 2)
    check_tp_plan(LlamaConfig(**SMOLLM2_HEADS), 3)  # 3 heads and 1 key/value head per rank
    check_tp_plan(LlamaConfig(num_attention_heads=12, num_key_value_heads=4, hidden_size=768), 2)
    check_tp_plan(GPT2Config(), 1)  # one rank needs no plan


def test_max_is_every_gpu_and_one_rank_on_a_cpu():
    assert resolve_degree("max", 0) == 1 and resolve_degree("max", 4) == 4 and resolve_degree(2, 0) == 2


@pytest.mark.parametrize(("world", "cores", "threads"), [(2, 2, 1), (3, 2, 1), (2, 16, 8), (4, 6, 1)])
def test_each_rank_gets_its_share_of_the_cores(world, cores, threads):
    assert threads_per_rank(world, cores) == threads


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU placement")
def test_cpu_ranks_compute_on_the_cpu_and_device_map_is_the_other_way():
    placement = choose_placement("auto", None, 2)
    assert placement.device == torch.device("cpu") and placement.device_map is None
    assert placement.dtype == torch.float32
    with pytest.raises(ModelLoadError, match="use one of them"):
        choose_placement("auto", "auto", 2)


@pytest.mark.parametrize("option", ["OPTION_ENABLE_LORA=true", "OPTION_ENABLE_PREFIX_CACHING=true",
                                    "OPTION_QUANTIZE=fp16", "OPTION_LINEAR_KERNEL=onednn",
                                    "OPTION_ROLLING_BATCH=disable", "OPTION_DEVICE_MAP=auto"])
def test_options_the_followers_cannot_replay_are_refused_with_tensor_parallelism(option):
    key, value = option.split("=")
    env = {"HF_MODEL_ID": "org/tiny", "OPTION_TENSOR_PARALLEL_DEGREE": "2", key: value}
    with pytest.raises(ConfigError, match=r"^OPTION_TENSOR_PARALLEL_DEGREE: tensor_parallel_degree=2 cannot be "
                                          r"combined with option\."):
        load_model_config(None, env)
    env["OPTION_TENSOR_PARALLEL_DEGREE"] = "1"
    assert load_model_config(None, env).tensor_parallel_degree == 1
