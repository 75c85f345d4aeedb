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


# --- NCCL: fail fast like gloo (model/tp.py's docstring) -----------------------------------------------

import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from lmi_serve.model import tp  # noqa: E402
from lmi_serve.model.tp import TPGroup, join_group, nccl_environment, watch_parent  # noqa: E402


def test_nccl_ranks_start_with_error_handling_that_fails_fast_and_keeps_rank_0():
    assert nccl_environment(0) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}
    assert nccl_environment(1)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.fixture
def fake_init(monkeypatch):
    """torch.distributed.init_process_group recorded (with the environment it would read), not run."""
    calls = []

    def init(backend, **kwargs):
        calls.append((backend, kwargs, {k: os.environ.get(k) for k in nccl_environment(0)}))

    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    monkeypatch.setattr(tp, "_SET_HERE", set())
    for key in (*nccl_environment(0), "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    return calls


def test_a_gpu_rank_joins_with_nccl_on_its_gpu_and_the_error_handling_set_before(monkeypatch, fake_init):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")  # the user's choice is kept
    assert join_group(1, 2, 12345, 1) == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    (backend, kwargs, env), = fake_init
    assert backend == "nccl" and kwargs["timeout"] == tp.GROUP_TIMEOUT
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_BLOCKING_WAIT": "1"}


def test_a_cpu_rank_joins_with_gloo_and_no_nccl_settings(monkeypatch, fake_init):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()
    try:
        assert join_group(0, 2, 12345, threads) == torch.device("cpu")
    finally:
        torch.set_num_threads(threads)
    (backend, _, env), = fake_init
    assert backend == "gloo" and set(env.values()) == {None}


class FakeProcess:
    """A follower's Popen: `die(code)` ends it; `kill()` is recorded."""

    def __init__(self, pid: int):
        self.pid, self.code, self.killed = pid, None, False

    def die(self, code: int) -> None:
        self.code = code

    def poll(self):
        return self.code

    def kill(self) -> None:
        self.killed, self.code = True, -9

    def wait(self, timeout=None):
        return self.code


def test_a_dead_nccl_follower_fails_the_model_at_once_even_while_the_abort_hangs(monkeypatch):
    monkeypatch.setattr(tp, "WATCH_SECONDS", 0.02)
    aborting, never = threading.Event(), threading.Event()

    def abort():  # ncclCommAbort with a dead peer may itself hang: nothing may wait for it
        aborting.set()
        never.wait(30)

    dead, alive = FakeProcess(11), FakeProcess(12)
    group = TPGroup(world=3, port=1, followers=[dead, alive], abort=abort)
    failed = []
    group.on_failure(failed.append)  # the handler's engine.fail: /ping Failed, requests end
    group.watch()
    dead.die(-9)
    deadline = time.monotonic() + 5
    while not (failed and aborting.is_set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failed == ["tensor-parallel rank 1 (pid 11) exited with status -9"]
    assert aborting.is_set() and alive.killed  # the communicators aborted, the other follower ended
    never.set()


def test_on_gloo_a_failure_aborts_nothing_and_leaves_the_followers_to_exit(monkeypatch):
    follower = FakeProcess(21)
    group = TPGroup(world=2, port=1, followers=[follower])
    failed = []
    group.on_failure(failed.append)
    group.fail("broadcast failed on rank 0")
    assert failed == ["broadcast failed on rank 0"] and not follower.killed


def test_start_group_aborts_on_failure_only_with_nccl(monkeypatch):
    monkeypatch.setattr(tp, "start_followers", lambda *a: TPGroup(world=2, port=1))
    monkeypatch.setattr(TPGroup, "watch", lambda self: None)
    for device, abort in ((torch.device("cuda", 0), tp.abort_group), (torch.device("cpu"), None)):
        monkeypatch.setattr(tp, "join_group", lambda *a, device=device: device)
        group, joined = tp.start_group("{}", "/tmp", 2)
        assert joined == device and group.abort is abort


def test_abort_group_uses_torchs_abort_where_it_has_one(monkeypatch):
    from torch.distributed import distributed_c10d

    calls = []
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda: calls.append("abort"), raising=False)
    monkeypatch.setattr(distributed_c10d, "destroy_process_group", lambda: calls.append("destroy"))
    tp.abort_group()
    monkeypatch.delattr(distributed_c10d, "_abort_process_group")
    tp.abort_group()
    assert calls == ["abort", "destroy"]


def test_a_follower_leaves_once_rank_0_is_gone():
    parents, left = [100, 100, 1], []
    stop = threading.Event()
    thread = watch_parent(100, leave=left.append, getppid=lambda: parents.pop(0) if len(parents) > 1 else 1,
                          every=0.01, stop=stop)
    thread.join(5)
    stop.set()
    assert left == [1]


def test_followers_set_their_own_nccl_handling_not_rank_0s(monkeypatch, fake_init):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # the user's, passed on
    join_group(0, 2, 12345, 1)  # a first model's group: rank 0 sets "2" for itself
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    started = []

    class Popen:
        def __init__(self, argv, **kwargs):
            started.append(kwargs["env"])
            self.pid, self.stdin = 5, type("In", (), {"write": lambda *a: None, "close": lambda *a: None})()

    monkeypatch.setattr(tp.subprocess, "Popen", Popen)
    tp.start_followers("{}", "/tmp", 2, 1)  # a second model's followers
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in started[0] and started[0]["TORCH_NCCL_BLOCKING_WAIT"] == "0"
