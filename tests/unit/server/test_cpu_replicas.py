"""Engine replicas (server/cpu_replicas.py): option.engine_replicas read and validated; `auto`'s count from the
CPU budget; the affinity mask cut into contiguous, disjoint core sets; the launcher's checks; a worker pinning
itself; GET /models/<m> showing the layout. Budgets and masks are fake (cgroup_trees), the pinning is real."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cgroup_trees import v2
from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.models import ConfigError
from lmi_serve.config.sources import build_server_config
from lmi_serve.cpu_budget import cpu_budget
from lmi_serve.server import cpu_replicas
from lmi_serve.server.app import create_app
from lmi_serve.server.cpu_replicas import (
    LAYOUT_ENV, ReplicaLayout, auto_replicas, cpu_list, enter_core_set, plan_replicas, split_cores, worker_layout,
)
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService


def config(**env):
    return build_server_config({"HF_MODEL_ID": "org/m", **env})


def budget(tmp_path, cpus: int, quota: float | None = None):
    files = {"cpu.max": f"{int(quota * 100000)} 100000\n"} if quota else {}
    return cpu_budget(None, {}, v2(tmp_path, files), affinity=cpus)


@pytest.mark.parametrize(("value", "parsed"), [("auto", "auto"), (" AUTO ", "auto"), ("4", 4)])
def test_the_option_is_auto_or_a_number(value, parsed):
    assert config(OPTION_ENGINE_REPLICAS=value).engine_replicas == parsed
    assert config().engine_replicas is None  # unset: the workers as set, unpinned
    assert build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "LMI_SERVE_ENGINE_REPLICAS": "2"}).engine_replicas == 2


@pytest.mark.parametrize("value", ["0", "many", "2.5", "-1"])
def test_a_bad_value_fails_at_start_naming_its_key(value):
    with pytest.raises(ConfigError, match=rf"^option.engine_replicas: '{value}' is neither `auto` nor a number"):
        config(OPTION_ENGINE_REPLICAS=value)


def test_auto_is_one_replica_per_eight_threads():
    assert [auto_replicas(t) for t in (1, 2, 4, 7, 8, 15, 16, 24, 64, 96)] == [1, 1, 1, 1, 1, 1, 2, 3, 8, 12]


def test_core_sets_are_contiguous_disjoint_slices_of_the_mask():
    assert split_cores(range(16), 4) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert split_cores([9, 8, 3, 2, 10, 11], 2) == ((2, 3, 8), (9, 10, 11))  # a cpuset with a gap, unsorted
    assert split_cores(range(6), 4) == ((0, 1), (2, 3), (4,), (5,))  # the first slices take the remainder
    assert split_cores([5], 1) == ((5,),)
    with pytest.raises(ValueError, match="3 CPU"):
        split_cores(range(3), 4)
    assert cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"


def test_auto_on_sixteen_cores_is_two_by_eight(tmp_path):
    layout = plan_replicas(config(OPTION_ENGINE_REPLICAS="auto"), budget(tmp_path, 16), range(16))
    assert (layout.replicas, layout.threads, layout.core_sets) == (2, 8, (tuple(range(8)), tuple(range(8, 16))))
    assert "replica 1: CPUs 8-15" in layout.describe() and "8 torch thread(s) each" in layout.describe()


def test_auto_on_a_two_core_box_is_one_pinned_replica(tmp_path):
    layout = plan_replicas(config(OPTION_ENGINE_REPLICAS="auto"), budget(tmp_path, 2), [0, 1])
    assert (layout.replicas, layout.threads, layout.core_sets) == (1, 2, ((0, 1),))


def test_a_quota_sizes_the_threads_and_the_mask_the_slices(tmp_path):
    # 16 CPUs of quota on a 64-CPU host: two replicas of 8 threads, each free to run on half the host
    layout = plan_replicas(config(OPTION_ENGINE_REPLICAS="auto"), budget(tmp_path, 64, quota=16), range(64))
    assert (layout.replicas, layout.threads) == (2, 8)
    assert [len(cores) for cores in layout.core_sets] == [32, 32]


def test_a_number_is_taken_as_it_is_within_the_budget(tmp_path):
    layout = plan_replicas(config(OPTION_ENGINE_REPLICAS="4"), budget(tmp_path, 16), range(16))
    assert (layout.replicas, layout.threads, layout.core_sets[3]) == (4, 4, (12, 13, 14, 15))
    with pytest.raises(ConfigError, match=r"option.engine_replicas: 3 replicas need a CPU thread each, and the CPU "
                                          r"budget is 2 \(from affinity 2"):
        plan_replicas(config(OPTION_ENGINE_REPLICAS="3"), budget(tmp_path, 2), [0, 1])


def test_unset_leaves_the_workers_unpinned(tmp_path):
    layout = plan_replicas(config(SAGEMAKER_NUM_MODEL_WORKERS="3"), budget(tmp_path, 16), range(16))
    assert (layout.replicas, layout.threads, layout.pinned) == (3, 5, False)


def test_replicas_and_workers_set_together_must_agree(tmp_path):
    both = config(OPTION_ENGINE_REPLICAS="2", SAGEMAKER_NUM_MODEL_WORKERS="2")
    assert plan_replicas(both, budget(tmp_path, 16), range(16), workers_key="SAGEMAKER_NUM_MODEL_WORKERS").pinned
    with pytest.raises(ConfigError, match="option.engine_replicas: auto and --workers=3 both set the workers"):
        plan_replicas(config(OPTION_ENGINE_REPLICAS="auto", SAGEMAKER_NUM_MODEL_WORKERS="3"), budget(tmp_path, 16),
                      range(16), workers_key="--workers")


def test_one_worker_where_one_is_required(tmp_path):
    mme = build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "OPTION_ENGINE_REPLICAS": "auto"})
    layout = plan_replicas(mme, budget(tmp_path, 64), range(64))
    assert (layout.replicas, layout.pinned) == (1, False) and "multi-model" in layout.why
    with pytest.raises(ConfigError, match="option.engine_replicas: 2 replicas, but a multi-model endpoint"):
        plan_replicas(mme.model_copy(update={"engine_replicas": 2}), budget(tmp_path, 64), range(64))
    gpus = plan_replicas(config(OPTION_ENGINE_REPLICAS="auto"), budget(tmp_path, 64), range(64), gpus=8)
    assert (gpus.replicas, gpus.pinned) == (1, False)


def test_a_worker_pins_itself_and_leaves_the_layout_for_its_app():
    mine = sorted(os.sched_getaffinity(0))
    layout = ReplicaLayout(2, 1, ((mine[0],), tuple(mine[1:]) or (mine[0],)), "option.engine_replicas=2")
    # in a child: pinning is for the whole process
    code = ("import os, sys; from types import SimpleNamespace as N; from lmi_serve.server import cpu_replicas as c; "
            f"layout = c.ReplicaLayout.from_env({layout.to_env()!r}); env = {{}}; "
            "cores = c.enter_core_set(N(pid=os.getpid(), lmi_slot=0), layout, env); "
            "print(sorted(os.sched_getaffinity(0)) == list(cores), c.worker_layout(env) == layout, "
            "env[c.REPLICAS_ENV])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True", "2"], done.stderr
    env: dict[str, str] = {}
    assert enter_core_set(SimpleNamespace(pid=1, lmi_slot=0), ReplicaLayout(1, 2), env) == () and env == {}
    assert worker_layout({}) is None


def test_get_models_shows_the_replicas_cores(monkeypatch):
    layout = ReplicaLayout(4, 4, split_cores(range(16), 4), "option.engine_replicas=4")
    monkeypatch.setenv(LAYOUT_ENV, layout.to_env())
    monkeypatch.setenv("LMI_SERVE_WORKER_SLOT", "2")
    built = build_server_config({"HOME": "/tmp", "OPTION_CPU_THREADS": "16"}, default_store=DEFAULT_STORE)
    simple = next(model for model in built.models if model.name == "simple")
    built = built.model_copy(update={"models": (simple,), "workers": 4})
    service = ModelService(simple, built.cache_dir)
    service.load()  # model.py only: no weights
    (shown,) = create_app(built, ModelRegistry([service])).test_client().get("/models/simple").get_json()[0]["models"]
    # the budget over the layout's 16 CPUs (not the worker's own 4), a quarter of it here
    cpu = shown["cpuThreads"]
    assert (cpu["threads"], cpu["threadsPerWorker"], cpu["replicas"], cpu["coreSet"]) == (16, 4, 4, [8, 9, 10, 11])


def test_the_launcher_sets_the_workers_from_the_option_and_logs_the_layout():
    code = ("import sys; from lmi_serve import __main__ as m; m.count_gpus = lambda env: 0; "
            "m.run_gunicorn = lambda config, args, plan, layout: print(config.workers, layout.replicas); "
            "sys.exit(m.main([]))")
    env = {**os.environ, "HF_MODEL_ID": "org/tiny", "OPTION_CPU_THREADS": "1", "OPTION_ENGINE_REPLICAS": "auto"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.split() == ["1", "1"] and "Engine replicas: 1 (auto: 1 thread(s) of budget" in done.stderr
    env["OPTION_ENGINE_REPLICAS"] = "2"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "option.engine_replicas: 2 replicas need a CPU thread each" in done.stderr
    assert cpu_replicas.KEY == "option.engine_replicas"


def test_the_row_kernels_auto_counts_every_replicas_copies(monkeypatch):
    from lmi_serve.kernels.cpu import row_kernel

    assert row_kernel.REPLICAS_ENV == cpu_replicas.REPLICAS_ENV
    monkeypatch.setattr(row_kernel.psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * 2**30))
    monkeypatch.delenv(row_kernel.REPLICAS_ENV, raising=False)
    assert row_kernel.available_share() == 8 * 2**30
    monkeypatch.setenv(row_kernel.REPLICAS_ENV, "4")
    assert row_kernel.available_share() == 2 * 2**30  # four replicas' copies must fit a quarter of the 8 GiB
