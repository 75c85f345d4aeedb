"""The CPU budget (lmi_serve/cpu_budget.py) against fake cgroup trees: v2 and v1 quotas, unlimited ones,
fractional ones, nested cgroups, a missing controller; the user's option.cpu_threads and OMP_NUM_THREADS;
and torch's threads in a worker following it, in every thread that runs the model."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from cgroup_trees import tree, v1, v2
from lmi_serve.__main__ import DEFAULT_STORE
from lmi_serve.config.sources import build_server_config
from lmi_serve.cpu_budget import cpu_budget
from lmi_serve.server.app import configure_threads, create_app
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelService

HOST_CPUS = 64  # the affinity mask the tests pretend: a large host under a quota


def budget(root, cpu_threads=None, **env):
    return cpu_budget(cpu_threads, env, root, affinity=HOST_CPUS)


@pytest.mark.parametrize(("cpu_max", "threads"), [
    ("400000 100000", 4),  # Docker --cpus 4
    ("250000 100000", 2),  # 2.5 CPUs: rounded down (a third thread would throttle all of them)
    ("50000 100000", 1),  # half a CPU: one thread, never none
    ("150000 50000", 3),  # another period
])
def test_a_v2_quota_bounds_the_threads(tmp_path, cpu_max, threads):
    found = budget(v2(tmp_path, {"cpu.max": f"{cpu_max}\n"}))
    assert (found.threads, found.source) == (threads, "cgroup v2 cpu.max")
    assert cpu_max in found.decided_by.detail and "cpu.max" in found.decided_by.detail


def test_a_v1_quota_bounds_the_threads(tmp_path):
    found = budget(v1(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "350000\n",
                                 "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}))
    assert (found.threads, found.source, found.decided_by.cpus) == (3, "cgroup v1 cpu.cfs_quota_us", 3.5)


@pytest.mark.parametrize("make", [
    lambda root: v2(root, {"cpu.max": "max 100000\n"}),  # v2's "no quota"
    lambda root: v1(root, {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}),
    lambda root: v2(root, {}),  # the cpu controller not enabled here: no cpu.max
    lambda root: tree(root, {}),  # no cgroup file system mounted at all
])
def test_no_quota_leaves_the_affinity_mask(tmp_path, make):
    found = budget(make(tmp_path))
    assert (found.threads, found.source) == (HOST_CPUS, "affinity")
    assert [limit.source for limit in found.limits] == ["affinity"]


def test_a_quota_above_the_processs_own_cgroup_counts(tmp_path):
    # A Kubernetes pod's limit sits on the pod's cgroup, the container's below it: the smallest holds.
    files = {"kubepods/pod1/cpu.max": "200000 100000\n", "kubepods/pod1/app/cpu.max": "max 100000\n",
             "kubepods/cpu.max": "800000 100000\n"}
    found = budget(v2(tmp_path, files, own="/kubepods/pod1/app"))
    assert (found.threads, found.source) == (2, "cgroup v2 cpu.max")
    assert "kubepods/pod1/cpu.max" in found.decided_by.detail
    assert [limit.cpus for limit in found.limits] == [2.0, 8.0, HOST_CPUS]  # innermost first, then the mask
    # and a tighter one on the container's own cgroup wins over its parent's
    files["kubepods/pod1/app/cpu.max"] = "100000 100000\n"
    assert budget(v2(tmp_path / "tighter", files, own="/kubepods/pod1/app")).threads == 1


def test_a_cgroup_named_outside_the_mount_is_the_mount_itself(tmp_path):
    # Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names /docker/<id>, the container
    # sees only its own cgroup, mounted at the top.
    root = v1(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
              own="/docker/0123abcd")
    assert (budget(root).threads, budget(root).source) == (2, "cgroup v1 cpu.cfs_quota_us")
    escaping = v2(tmp_path / "up", {"cpu.max": "300000 100000\n"}, own="/../../elsewhere")
    assert budget(escaping).threads == 3


def test_a_hybrid_host_reads_v1s_cpu_controller(tmp_path):
    # v2 mounted at sys/fs/cgroup/unified without the cpu controller, v1's cpu controller beside it
    root = v1(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                         "unified/cgroup.controllers": "\n"})
    assert (budget(root).threads, budget(root).source) == (4, "cgroup v1 cpu.cfs_quota_us")


def test_the_users_setting_counts_where_it_is_the_smallest(tmp_path):
    root = v2(tmp_path, {"cpu.max": "400000 100000\n"})
    assert (budget(root, 3).threads, budget(root, 3).source) == (3, "option.cpu_threads")
    assert (budget(root, 8).threads, budget(root, 8).source) == (4, "cgroup v2 cpu.max")  # never above the quota
    assert budget(root, 4).source == "option.cpu_threads"  # a tie names the user's setting
    omp = budget(root, OMP_NUM_THREADS="2")
    assert (omp.threads, omp.source) == (2, "OMP_NUM_THREADS")
    assert budget(root, OMP_NUM_THREADS="3,1").threads == 3  # OpenMP's nested list: the outer level
    assert budget(root, 1, OMP_NUM_THREADS="2").source == "option.cpu_threads"  # the option beats the variable
    assert budget(root, 3, OMP_NUM_THREADS="1").threads == 3  # the variable is not read when the option is set
    ignored = budget(root, OMP_NUM_THREADS="all")
    assert ignored.threads == 4 and "OMP_NUM_THREADS='all'" in ignored.describe(1)


def test_the_workers_share_the_budget_and_the_log_line_says_where_it_came_from(tmp_path):
    found = budget(v2(tmp_path, {"cpu.max": "800000 100000\n"}))
    assert [found.per_worker(workers) for workers in (1, 3, 8, 16)] == [8, 2, 1, 1]
    line = found.describe(2)
    assert line.startswith("CPU budget: 8 thread(s), from cgroup v2 cpu.max 8 (")
    assert "also affinity 64" in line and "2 worker(s): 4 torch thread(s) each" in line
    shown = found.as_json(2)
    assert (shown["threads"], shown["source"], shown["threadsPerWorker"]) == (8, "cgroup v2 cpu.max", 4)


def test_the_budget_is_this_processs_affinity_without_a_quota_or_setting():
    found = cpu_budget(None, {})
    assert 1 <= found.threads <= len(os.sched_getaffinity(0))


def test_torch_and_numba_take_the_workers_share_in_every_thread_started_after(tmp_path):
    import numba
    import torch

    from lmi_serve.kernels import host
    from lmi_serve.kernels.cpu.numba_bits import match_torch_threads

    host.probe()  # as every kernel's compile does first: numba's OpenMP layer, set before its pool starts
    before = torch.get_num_threads()
    try:
        assert configure_threads(budget(v2(tmp_path, {"cpu.max": "100000 100000\n"})), workers=1) == 1
        seen = []

        def engine_thread():  # the loading and engine threads start later
            seen.append(torch.get_num_threads())  # what tensor parallelism shares out (model/tp.py)
            match_torch_threads()  # what a numba kernel does before it runs
            seen.append(numba.get_num_threads())

        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join()
        assert seen == [1, 1]
    finally:
        torch.set_num_threads(before)


def test_get_models_shows_the_budget_and_its_source():
    config = build_server_config({"HOME": "/tmp", "OPTION_CPU_THREADS": "1"}, default_store=DEFAULT_STORE)
    simple = next(model for model in config.models if model.name == "simple")
    config = config.model_copy(update={"models": (simple,)})
    service = ModelService(simple, config.cache_dir)
    service.load()  # model.py only: no weights
    client = create_app(config, ModelRegistry([service])).test_client()
    (shown,) = client.get("/models/simple").get_json()[0]["models"]
    assert shown["cpuThreads"]["threads"] == 1 and shown["cpuThreads"]["source"] == "option.cpu_threads"
    assert shown["cpuThreads"]["threadsPerWorker"] == 1


def test_the_launcher_logs_the_budget_once_before_torch_is_imported():
    # in a child: main() configures logging and the runtime environment of the process it runs in
    code = ("import sys; from lmi_serve import __main__ as m; m.count_gpus = lambda env: 0; "
            "m.run_gunicorn = lambda *a: print('torch' in sys.modules); sys.exit(m.main([]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "HF_MODEL_ID": "org/tiny", "OPTION_CPU_THREADS": "1"})
    assert done.stdout.strip() == "False"
    lines = [line for line in done.stderr.splitlines() if "CPU budget:" in line]
    assert len(lines) == 1 and "CPU budget: 1 thread(s), from option.cpu_threads 1" in lines[0], done.stderr
