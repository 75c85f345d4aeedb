"""Where and in which dtype the weights go (model/loader.py `choose_placement`), on a faked `torch.cuda`:
option.dtype=auto follows the checkpoint on a GPU, bf16 only where the GPU computes it natively
(compute capability >= 8.0, not the emulation `is_bf16_supported()` counts), fp32 on the CPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lmi_serve.model import loader
from lmi_serve.model.loader import checkpoint_dtype, choose_dtype, choose_placement
from lmi_serve.model.source import ModelLoadError

T4, V100, A100, H100 = (7, 5), (7, 0), (8, 0), (9, 0)


@pytest.fixture
def fake_gpus(monkeypatch):
    """`fake_gpus(A100, A100)`: torch sees these GPUs (their compute capabilities); nothing touches CUDA."""

    def install(*capabilities):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capabilities))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capabilities[device or 0])
        # what torch answers by default on every one of them: emulation counts
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        monkeypatch.setattr(torch.version, "hip", None)

    return install


@pytest.mark.parametrize(("gpu", "declared", "expected"), [
    (A100, "bf16", torch.bfloat16), (H100, "bf16", torch.bfloat16),
    (T4, "bf16", torch.float16), (V100, "bf16", torch.float16),  # bf16 is only emulated below 8.0
    (T4, "fp16", torch.float16), (A100, "fp16", torch.float16),
    (A100, "fp32", torch.float32), (T4, "fp32", torch.float32),
    (A100, None, torch.float16), (T4, None, torch.float16),  # no declared dtype: fp16, as DJL LMI
])
def test_auto_on_a_gpu_follows_the_checkpoint_and_bf16_only_where_native(fake_gpus, gpu, declared, expected):
    fake_gpus(gpu)
    placement = choose_placement("auto", None, 1, declared_dtype=declared)
    assert placement.dtype == expected
    assert placement.device == torch.device("cuda:0") and placement.device_map == {"": 0}


def test_one_gpu_below_8_0_among_several_means_fp16(fake_gpus):
    fake_gpus(A100, T4)
    assert choose_dtype("auto", 2, "bf16")[0] == torch.float16
    fake_gpus(A100, H100)
    assert choose_dtype("auto", 2, "bf16")[0] == torch.bfloat16


@pytest.mark.parametrize("declared", ["bf16", "fp16", "fp32", None])
def test_auto_on_the_cpu_stays_fp32(fake_gpus, declared):
    fake_gpus()
    placement = choose_placement("auto", None, 1, declared_dtype=declared)
    assert placement.dtype == torch.float32 and placement.device == torch.device("cpu")


@pytest.mark.parametrize(("asked", "expected"), [("fp32", torch.float32), ("fp16", torch.float16),
                                                  ("bf16", torch.bfloat16)])
def test_an_explicit_dtype_is_taken_as_asked(fake_gpus, asked, expected):
    fake_gpus(T4)
    assert choose_placement(asked, None, 1, declared_dtype="bf16").dtype == expected
    fake_gpus()
    assert choose_placement(asked, None, 1, declared_dtype="bf16").dtype == expected


def test_the_choice_is_logged_with_its_reason_by_rank_0_only(fake_gpus, caplog):
    fake_gpus(T4)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        choose_placement("auto", None, 1, declared_dtype="bf16")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Weights in")]
    assert lines == ["Weights in float16: option.dtype=auto: the checkpoint is bf16, but this GPU (compute "
                     "capability 7.5) only emulates bf16 (native from 8.0): fp16"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        choose_placement("bf16", None, 1)
        fake_gpus(T4, T4)
        choose_placement("auto", None, 2, rank=1, declared_dtype="bf16")  # a follower: rank 0 said it
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Weights in")]
    assert lines == ["Weights in bfloat16: option.dtype=bf16, though this GPU (compute capability 7.5) only "
                     "emulates bf16 (slower than fp16)"]


@pytest.mark.parametrize(("config", "expected"), [
    (SimpleNamespace(dtype=torch.bfloat16), "bf16"), (SimpleNamespace(torch_dtype="float16"), "fp16"),
    (SimpleNamespace(dtype="float32"), "fp32"), (SimpleNamespace(dtype=None, torch_dtype="bfloat16"), "bf16"),
    (SimpleNamespace(), None), (SimpleNamespace(dtype="float8_e4m3fn"), None),
])
def test_the_checkpoint_dtype_is_read_from_either_name(config, expected):
    assert checkpoint_dtype(config) == expected


def test_a_real_config_json_declares_its_dtype(tmp_path):
    from transformers import AutoConfig, LlamaConfig

    LlamaConfig(dtype="bfloat16", num_hidden_layers=1).save_pretrained(tmp_path)
    assert checkpoint_dtype(AutoConfig.from_pretrained(tmp_path)) == "bf16"


def test_tensor_parallel_ranks_take_the_workers_gpus_in_order(fake_gpus):
    fake_gpus(A100, A100)
    assert [choose_placement("auto", None, 2, rank=r).device for r in (0, 1)] == [torch.device("cuda", 0),
                                                                                  torch.device("cuda", 1)]
    with pytest.raises(ModelLoadError, match="tensor_parallel_degree=4 but only 2 GPU"):
        choose_placement("auto", None, 4)
    assert choose_placement("auto", "auto", 1).device_map == "auto"


def test_bf16_on_a_cpu_is_the_opt_in_and_says_whether_the_cpu_computes_it(fake_gpus, caplog):
    from lmi_serve.kernels.host import bf16_native

    fake_gpus()
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert choose_placement("bf16", None, 1).dtype == torch.bfloat16
        assert choose_placement("auto", None, 1, declared_dtype="bf16").dtype == torch.float32  # auto stays exact
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Weights in")]
    assert lines[0].startswith("Weights in bfloat16: option.dtype=bf16 on a CPU, ") and "not exact" in lines[0]
    assert ("in hardware" in lines[0]) == bf16_native() and ("only emulates" in lines[0]) != bf16_native()
    assert lines[1] == "Weights in float32: option.dtype=auto on a CPU: fp32, exact (option.dtype=bf16 is the faster opt-in)"
