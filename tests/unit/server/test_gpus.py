"""Each gunicorn worker's own GPUs (server/gpus.py) on faked device counts: one GPU or one group of
tensor_parallel_degree GPUs per worker, disjoint; a restarted worker takes the dead one's; too many
workers is a start-up error naming the options; the launcher counts without initialising CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lmi_serve.config.sources import ConfigError, ServerConfig, build_server_config
from lmi_serve.server import gpus
from lmi_serve.server.gpus import GpuPlan, assign_slot, count_gpus, enter_slot, pick_slot, plan_gpus
from lmi_serve.server.gunicorn_app import gunicorn_settings


def server(workers: int = 1, **options: str) -> ServerConfig:
    env = {"HF_MODEL_ID": "org/tiny", **{f"OPTION_{k.upper()}": v for k, v in options.items()}}
    if workers > 1:
        env["SAGEMAKER_NUM_MODEL_WORKERS"] = str(workers)
    return build_server_config(env)


def all_devices(plan: GpuPlan) -> list[tuple[str, ...]]:
    return [plan.devices(slot) for slot in range(plan.workers)]


@pytest.mark.parametrize(("workers", "degree", "gpus", "expected"), [
    (1, "1", 1, [("0",)]),
    (4, "1", 4, [("0",), ("1",), ("2",), ("3",)]),
    (2, "2", 4, [("0", "1"), ("2", "3")]),  # worker i, rank r: GPU i*2 + r
    (2, "4", 8, [("0", "1", "2", "3"), ("4", "5", "6", "7")]),
    (3, "2", 8, [("0", "1"), ("2", "3"), ("4", "5")]),  # GPUs left over stay unused
    (1, "max", 4, [("0", "1", "2", "3")]),
])
def test_each_worker_takes_its_own_gpu_or_group_and_the_groups_are_disjoint(workers, degree, gpus, expected):
    plan = plan_gpus(server(workers, tensor_parallel_degree=degree), gpus, {})
    assert all_devices(plan) == expected
    taken = [gpu for group in expected for gpu in group]
    assert len(taken) == len(set(taken))
    assert [plan.worker_env(slot)["CUDA_VISIBLE_DEVICES"] for slot in range(workers)] == [",".join(g) for g in expected]


def test_the_users_cuda_visible_devices_is_shared_out_not_renumbered():
    plan = plan_gpus(server(2, tensor_parallel_degree="2"), 4, {"CUDA_VISIBLE_DEVICES": "4,5,GPU-abc,7"})
    assert all_devices(plan) == [("4", "5"), ("GPU-abc", "7")]


def test_device_map_models_spread_over_an_equal_share():
    assert all_devices(plan_gpus(server(2, device_map="auto"), 8, {})) == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
    assert all_devices(plan_gpus(server(1, device_map="auto"), 3, {})) == [("0", "1", "2")]


def test_the_largest_degree_among_the_models_sizes_every_workers_group(tmp_path):
    for name, degree in (("a", "2"), ("b", "1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "serving.properties").write_text(f"option.tensor_parallel_degree={degree}\n")
    config = build_server_config({"SAGEMAKER_NUM_MODEL_WORKERS": "2"}, model_store=tmp_path)
    assert all_devices(plan_gpus(config, 4, {})) == [("0", "1"), ("2", "3")]


@pytest.mark.parametrize(("workers", "degree", "gpus", "says"), [
    (3, "1", 2, "SAGEMAKER_NUM_MODEL_WORKERS: 3 workers need 3 GPUs, one per worker, and 2 are visible"),
    (2, "2", 3, "SAGEMAKER_NUM_MODEL_WORKERS: 2 workers × option.tensor_parallel_degree=2 (model tiny) need 4 GPUs, "
                "a group of 2 per worker, and 3 are visible"),
    (2, "max", 4, "SAGEMAKER_NUM_MODEL_WORKERS: option.tensor_parallel_degree=max (model tiny) gives every GPU to "
                  "one worker, and 4 are visible"),
    (1, "4", 2, "option.tensor_parallel_degree: option.tensor_parallel_degree=4 (model tiny) needs 4 GPUs, and 2 "
                "are visible"),
    (2, "1", 1, "SAGEMAKER_NUM_MODEL_WORKERS: 2 workers need 2 GPUs, one per worker, and 1 is visible"),
])
def test_more_workers_than_the_gpus_allow_is_refused_naming_the_options(workers, degree, gpus, says):
    with pytest.raises(ConfigError) as caught:
        plan_gpus(server(workers, tensor_parallel_degree=degree), gpus, {},
                  "SAGEMAKER_NUM_MODEL_WORKERS" if workers > 1 else "workers")
    message = str(caught.value)
    assert message.startswith(says)
    for option in ("SAGEMAKER_NUM_MODEL_WORKERS", "SERVING_MAX_WORKERS", "--workers", "option.tensor_parallel_degree",
                   "CUDA_VISIBLE_DEVICES"):
        assert option in message


def test_without_gpus_any_number_of_workers_and_ranks_run_on_the_cpu():
    for gpus_seen in (0, None):
        plan = plan_gpus(server(4, tensor_parallel_degree="2"), gpus_seen, {})
        assert plan.per_worker == 0 and plan.worker_env(3) == {"LMI_SERVE_WORKER_SLOT": "3"}


def test_a_new_worker_takes_the_lowest_free_slot_and_a_restarted_one_the_dead_ones():
    assert pick_slot(3, []) == 0
    assert pick_slot(3, [(0, 1)]) == 1
    assert pick_slot(3, [(0, 1), (2, 3)]) == 1  # slot 1's worker died: its replacement takes slot 1
    assert pick_slot(3, [(1, 2), (2, 3)]) == 0
    # a reload starts new workers before it ends the old, oldest first: each takes the oldest's slot
    assert pick_slot(2, [(0, 5), (1, 4)]) == 1
    assert pick_slot(2, [(0, 5), (1, 4), (1, 6)]) == 0


class FakeArbiter:
    """gunicorn's arbiter as the hooks see it: WORKERS by pid; spawn runs pre_fork, then the child's
    post_fork (here into a dict, not this process's environment)."""

    def __init__(self, settings):
        self.settings, self.WORKERS, self.age, self.pid = settings, {}, 0, 100

    def spawn(self) -> tuple[SimpleNamespace, dict[str, str]]:
        self.age, self.pid = self.age + 1, self.pid + 1
        worker = SimpleNamespace(age=self.age, pid=self.pid)
        self.settings["pre_fork"](self, worker)
        self.WORKERS[worker.pid] = worker
        child_env: dict[str, str] = {}
        gpus.enter_slot(worker, self.plan, child_env)
        return worker, child_env


def test_gunicorn_hooks_give_a_restarted_worker_the_dead_ones_gpus(tmp_path):
    config = server(2, tensor_parallel_degree="2")
    plan = plan_gpus(config, 4, {})
    settings = gunicorn_settings(config, SimpleNamespace(timeout=30, log_level="info", log_format="text"),
                                 str(tmp_path), plan)
    arbiter = FakeArbiter(settings)
    arbiter.plan = plan
    (first, first_env), (second, second_env) = arbiter.spawn(), arbiter.spawn()
    assert (first_env["CUDA_VISIBLE_DEVICES"], second_env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert (first_env["LMI_SERVE_WORKER_SLOT"], second_env["LMI_SERVE_WORKER_SLOT"]) == ("0", "1")
    del arbiter.WORKERS[first.pid]  # worker 0 died (gunicorn pops it before it spawns a replacement)
    third, third_env = arbiter.spawn()
    assert third.lmi_slot == 0 and third_env["CUDA_VISIBLE_DEVICES"] == "0,1"
    # gunicorn checks each hook's arity when it is set
    from gunicorn.config import Config

    cfg = Config()
    for key in ("pre_fork", "post_fork"):
        cfg.set(key, settings[key])


def test_enter_slot_sets_this_processs_environment(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LMI_SERVE_WORKER_SLOT", raising=False)
    enter_slot(SimpleNamespace(lmi_slot=1, pid=7), GpuPlan(2, 1, ("0", "1")))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and os.environ["LMI_SERVE_WORKER_SLOT"] == "1"


def test_gpus_are_counted_in_a_child_and_only_where_a_driver_exists(tmp_path):
    calls = []

    def run(argv, **kwargs):
        calls.append((argv, kwargs["env"]))
        return subprocess.CompletedProcess(argv, 0, stdout="some warning\n4\n", stderr="")

    assert count_gpus({}, nodes=[str(tmp_path / "nvidiactl")], run=run) == 0 and not calls
    (tmp_path / "nvidiactl").touch()
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "1,2,3,4"}, nodes=[str(tmp_path / "nvidiactl")], run=run) == 4
    (argv, env), = calls
    assert argv[0] == sys.executable and "torch.cuda.device_count()" in argv[-1]
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2,3,4"

    def broken(argv, **kwargs):
        raise subprocess.CalledProcessError(1, argv, "", "ImportError: no torch")

    assert count_gpus({}, nodes=[str(tmp_path / "nvidiactl")], run=broken) is None


def test_the_launcher_counts_without_importing_torch():
    code = ("import sys; from lmi_serve.server import gpus; gpus.count_gpus({}, nodes=[]); "
            "from lmi_serve import __main__; print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_launcher_refuses_too_many_workers_before_gunicorn_starts():
    # in a child: main() configures logging and the runtime environment of the process it runs in
    code = ("import sys; from lmi_serve import __main__ as m; m.count_gpus = lambda env: 2; "
            "m.run_gunicorn = lambda *a: sys.exit('gunicorn started'); sys.exit(m.main(['--workers', '2']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "HF_MODEL_ID": "org/tiny", "OPTION_TENSOR_PARALLEL_DEGREE": "2"})
    assert done.returncode == 2
    assert done.stderr.startswith("lmi-serve: invalid configuration: --workers: 2 workers × "
                                  "option.tensor_parallel_degree=2 (model tiny) need 4 GPUs")
