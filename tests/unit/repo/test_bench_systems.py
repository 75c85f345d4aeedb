"""benchmarks/benchmark: the parts of the benchmark that decide what runs and what it reports (no server,
no model): skip reasons, system options, prompt windows, the chat workload, SSE parsing, ratio lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.benchmark import llama, vllm_cpu
from benchmarks.benchmark.chat import ttft_ratio
from benchmarks.benchmark.clients import openai_sender, sse_one, timed_loop
from benchmarks.benchmark.common import ModelSource
from benchmarks.benchmark.report import llama_ratios, skipped_lines, target_checks, tpot_ratios, vllm_ratios
from benchmarks.benchmark.servers import ServerSettings, Servers, failure_reason, ignored_options, our_options
from benchmarks.benchmark.workload import SYSTEM_PROMPT, Workload, build_chat_workload, chat_messages

UNKNOWN_WARNING = ("2026-11-24 01:00:00 WARNING lmi_serve: Model m: options enable_prefix_caching are not "
                   "lmi-serve options; they are passed to the handler only")


def test_a_system_that_needs_an_unknown_option_is_recognised_from_the_log():
    options = our_options("rolling-no-prefix", ServerSettings())
    assert options["enable_prefix_caching"] == "false" and options["kv_cache"] == "slots"
    assert ignored_options("starting\n" + UNKNOWN_WARNING, options) == ["enable_prefix_caching"]
    assert ignored_options("starting\nall good", options) == []
    # rolling itself asks for nothing new, so the same warning (about another option) does not skip it
    assert ignored_options(UNKNOWN_WARNING, our_options("rolling", ServerSettings())) == []


def test_failure_reason_prefers_the_line_that_says_why():
    text = "loading\nlmi-serve: invalid configuration: option.quantize: unknown value 'q4'\nexiting\n"
    assert "option.quantize" in failure_reason(text)
    assert failure_reason("one\nlast words\n") == "last words"
    assert failure_reason("") == "no output"


def test_rolling_options_carry_the_prefill_budget_and_the_quantization():
    fp16 = our_options("rolling-fp16", ServerSettings(prefill_budget=256, max_rolling=16))
    assert fp16["quantize"] == "fp16" and fp16["max_rolling_batch_prefill_tokens"] == 256
    assert fp16["max_rolling_batch_size"] == 16
    assert our_options("rolling-q4", ServerSettings())["quantize"] == "q4"
    assert our_options("rolling-bf16", ServerSettings())["dtype"] == "bf16"
    assert {k: our_options("rolling-q4-bf16", ServerSettings())[k] for k in ("quantize", "dtype")} == \
        {"quantize": "q4", "dtype": "bf16"}
    assert "max_rolling_batch_prefill_tokens" not in our_options("rolling-dynamic", ServerSettings())
    assert our_options("dynamic", ServerSettings())["rolling_batch"] == "disable"
    # the system's own row count wins over the workload's (the largest concurrency it drives)
    assert our_options("rolling-24-rows", ServerSettings(max_rolling=32))["max_rolling_batch_size"] == 24


def test_llama_server_without_a_build_is_unavailable_with_the_build_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_HOME", str(tmp_path))
    with pytest.raises(llama.Unavailable, match="benchmarks/build_llama_server"):
        llama.binary("llama-server")
    assert skipped_lines({"llama-server": "not built"}) == ["", "- llama-server: skipped: not built"]


def test_vllm_cpu_without_its_venv_is_skipped_with_the_build_hint_before_any_model_work(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(llama.Unavailable, match="scripts/build_vllm_cpu"):
        vllm_cpu.python()
    # a model source that cannot resolve: the missing venv is found first, so nothing is converted or started
    servers = Servers(tmp_path, ["vllm-cpu"], ServerSettings(), ModelSource("/nonexistent/model", None))
    assert servers.servers == {}
    assert "scripts/build_vllm_cpu" in servers.skipped["vllm-cpu"] and str(tmp_path / "no-venv") in servers.skipped["vllm-cpu"]


def test_vllm_cpu_command_line_serves_the_folder_in_fp32_on_loopback(tmp_path):
    args = vllm_cpu.command(tmp_path / "bin" / "python", "/models/smol", 8123, 32, 512)
    assert args[:3] == [str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(args[3::2], args[4::2]))
    assert flags == {"--model": "/models/smol", "--host": "127.0.0.1", "--port": "8123", "--dtype": "float32",
                     "--max-num-seqs": "32", "--max-model-len": "512"}


def test_vllm_cpu_environment_binds_its_threads_and_sizes_the_kv_cache():
    env = vllm_cpu.environment(2, 3, base={"PATH": "/bin", "VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # all the bench's cores, not auto's "one kept back"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1"
    assert vllm_cpu.environment(4, 2, base={})["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def fake_venv(tmp_path: Path, body: str) -> Path:
    """A venv whose bin/python is a shell script (it ignores the arguments vLLM would get)."""
    script = tmp_path / "venv" / "bin" / "python"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script.parent.parent


def test_vllm_server_reports_an_early_exit_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_VENV", str(fake_venv(tmp_path, 'echo "ValueError: no CPU backend"; exit 3')))
    server = vllm_cpu.VllmServer(ModelSource(str(tmp_path), None), 4, 256, 2, 1)
    try:
        with pytest.raises(RuntimeError, match="(?s)exited with 3.*no CPU backend"):
            server.wait_for_ping(timeout=30)
        assert "--dtype float32" in server.command and server.command.startswith("VLLM_CPU_OMP_THREADS_BIND=0-1 ")
    finally:
        server.stop()


def test_vllm_server_stop_ends_its_whole_process_group(tmp_path, monkeypatch):
    # the API server and its engine core: a child that outlives its parent unless the group is signalled
    pid_file = tmp_path / "child.pid"
    body = f"sleep 300 & echo $! > {pid_file}; wait"
    monkeypatch.setenv("VLLM_CPU_VENV", str(fake_venv(tmp_path, body)))
    server = vllm_cpu.VllmServer(ModelSource(str(tmp_path), None), 4, 256, 2, 1)
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    server.stop()
    assert server.proc.poll() is not None
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_windows_give_each_point_its_own_prompts():
    work = Workload([f"p{i}" for i in range(10)], list(range(10)), [16 + i for i in range(10)])
    first, second = work.window(0, 4), work.window(4, 4)
    assert [first.request(k)[1] for k in range(4)] == ["p0", "p1", "p2", "p3"]
    assert [second.request(k)[1:] for k in range(2)] == [("p4", 20), ("p5", 21)]
    assert work.window(8, 4).prompts == ["p8", "p9", "p0", "p1"]  # wraps


class WordTokenizer:
    """Whitespace tokens; a chat template that joins role: content lines."""

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": text.split()})

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def test_chat_workload_shares_only_the_system_prompt():
    messages = chat_messages(40)
    assert len(set(messages)) == 40
    assert all(SYSTEM_PROMPT not in m for m in messages)
    work = build_chat_workload(WordTokenizer(), 12, (16, 128))
    system_words = len(SYSTEM_PROMPT.split())
    assert all(t > system_words for t in work.prompt_tokens)
    assert all(16 <= n <= 128 for n in work.max_new_tokens) and len(set(work.max_new_tokens)) > 3


class FakeResponse:
    def __init__(self, status: int, lines: list[bytes], delay: float = 0.0):
        self.status_code, self._lines, self._delay, self.text = status, lines, delay, "boom"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def iter_lines(self):
        for line in self._lines:
            time.sleep(self._delay)
            yield line


class FakeSession:
    def __init__(self, response: FakeResponse):
        self.response, self.sent = response, []

    def post(self, url, json, stream, timeout):
        self.sent.append(json)
        return self.response


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_sse_stream_times_text_chunks_and_counts_usage_tokens():
    lines = [sse({"choices": [{"delta": {"role": "assistant"}}]}),
             *(sse({"choices": [{"delta": {"content": w}}]}) for w in ("a", "b", "c")),
             sse({"choices": [], "usage": {"completion_tokens": 3}}), b"data: [DONE]"]
    rec = sse_one(FakeSession(FakeResponse(200, lines, delay=0.001)), "u", {}, 3)
    assert rec["ok"] and rec["tokens"] == 3 and len(rec["itl"]) == 2 and rec["ttft"] > 0
    no_usage = sse_one(FakeSession(FakeResponse(200, lines[1:3])), "u", {}, 3)
    assert no_usage["tokens"] == 2  # one per text chunk
    failed = sse_one(FakeSession(FakeResponse(500, [])), "u", {}, 3)
    assert not failed["ok"] and failed["error"].startswith("HTTP 500")


class DroppingSession(FakeSession):
    """Closes the first (kept-alive) connection unanswered, as llama-server did."""

    def post(self, url, json, stream, timeout):
        import http.client

        import requests

        if not self.sent:
            self.sent.append(None)
            raise requests.ConnectionError(http.client.RemoteDisconnected("closed without response"))
        return super().post(url, json, stream, timeout)


def test_a_connection_closed_unanswered_is_retried_once():
    lines = [sse({"choices": [{"text": "a"}]}), sse({"choices": [], "usage": {"completion_tokens": 1}})]
    rec = sse_one(DroppingSession(FakeResponse(200, lines)), "u", {"prompt": "p"}, 1)
    assert rec["ok"] and rec["retried"] and rec["tokens"] == 1


def test_openai_senders_force_the_length_and_put_the_system_prompt_first():
    session = FakeSession(FakeResponse(200, []))
    openai_sender("chat", "SYS", {"cache_prompt": True})(session, "u", "hello", 7)
    openai_sender("completions")(session, "u", "text", 5)
    chat, completion = session.sent
    assert chat["messages"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hello"}]
    assert chat["max_tokens"] == 7 and chat["ignore_eos"] and chat["cache_prompt"] and chat["stream"]
    assert completion["prompt"] == "text" and completion["max_tokens"] == 5 and "cache_prompt" not in completion


def test_timed_loop_starts_no_request_after_the_duration():
    starts = []

    def send(session, url, prompt, n):
        starts.append(time.perf_counter())
        time.sleep(0.01)
        return {"ok": True, "prompt": prompt}

    records, wall = timed_loop(send, "u", lambda: ("p", 4), concurrency=3, duration=0.1)
    assert len(records) == len(starts) >= 3
    # the loop starts with its first requests (its clients' collection before it is not its time)
    assert max(starts) - min(starts) < 0.1 <= wall


def row(system, c, tok_s, tpot=None, ttft=None):
    return {"system": system, "concurrency": c, "tok_s": tok_s, "tpot_p50": tpot, "ttft_p50": ttft}


def test_ratio_lines_against_rolling_dynamic_rolling_and_llama_server():
    rows = [row("rolling", 1, 20, tpot=0.040), row("rolling", 32, 100), row("rolling-dynamic", 32, 40),
            row("rolling-dynamic", 1, 15, tpot=0.050), row("rolling-linear-torch", 32, 50),
            row("rolling-fp16", 1, 30, tpot=0.018), row("rolling-fp16", 32, 130),
            row("llama-server", 1, 80), row("llama-server", 32, 150), row("llama-server-f32", 32, 200)]
    lines = "\n".join(target_checks(rows, 32, 16))
    assert "rolling@32 vs rolling-dynamic@32 (the path before the fast engine) tok/s: 100.0 / 40.0 = **2.50x**" in lines
    assert "kv_cache=slots vs dynamic, both on torch's nn.Linear, @32: 50.0 / 40.0 = 1.25x" in lines
    assert "linear_kernel=onednn vs torch, both on slots, @32: 100.0 / 50.0 = 2.00x" in lines
    assert "rolling-fp16@32 vs rolling-dynamic@32 tok/s: 130.0 / 40.0 = **3.25x** (target >= 3.0x) PASS" in lines
    assert "rolling-q4@32 vs rolling-dynamic@32 tok/s: not measured" in lines
    assert tpot_ratios(rows) == [
        "- single-stream TPOT p50 rolling-dynamic / rolling: 50.0 / 40.0 ms = **1.25x**",
        "- single-stream TPOT p50 rolling-fp16 / rolling: 18.0 / 40.0 ms = **0.45x**",
        "- single-stream TPOT p50 rolling / rolling-dynamic: 40.0 / 50.0 ms = **0.80x**",
        "- single-stream TPOT p50 rolling-fp16 / rolling-dynamic: 18.0 / 50.0 ms = **0.36x** (target <= 0.5x) PASS"]
    llama_lines = llama_ratios(rows, [1, 32])
    assert llama_lines[0] == ("- tok/s vs llama-server (Q4_1, 80.0 tok/s) at 1 client(s): rolling 0.25x, "
                              "rolling-dynamic 0.19x, rolling-fp16 0.38x")
    assert "rolling 0.50x" in llama_lines[2] and "F32" in llama_lines[2]


def test_ratio_lines_against_vllm_cpu_divide_every_system_at_each_point():
    rows = [row("rolling", 1, 20), row("vllm-cpu", 1, 25), row("rolling", 32, 150), row("llama-server", 32, 120),
            row("vllm-cpu", 32, 200), row("cb", 32, 40)]
    assert vllm_ratios(rows, [1, 32]) == [
        "- tok/s vs vllm-cpu (25.0 tok/s) at 1 client(s): rolling 0.80x",
        "- tok/s vs vllm-cpu (200.0 tok/s) at 32 client(s): rolling 0.75x, llama-server 0.60x, cb 0.20x"]
    assert vllm_ratios(rows[:1], [1]) == ["- tok/s vs vllm-cpu at 1 client(s): not measured"]
    assert "- tok/s vs vllm-cpu (200.0 tok/s) at 32 client(s): rolling 0.75x" in "\n".join(target_checks(rows, 32, 16))


def test_chat_ttft_ratio_line():
    rows = [row("rolling-no-prefix", 16, 50, ttft=1.5), row("rolling", 16, 60, ttft=0.3)]
    assert ttft_ratio(rows, 16).endswith("1.50 / 0.30 s = **5.00x** (target >= 3x) PASS")
    assert ttft_ratio(rows[:1], 16).endswith("not measured")


def test_bf16_and_q4km_systems_are_held_against_their_own_peers():
    """Issue 67's bf16 against vLLM's bf16, issue 61's Q4_K_M file against the Q4_1 path and llama-server on the
    same file: each a target line of its own, only where the run measured those systems."""
    rows = [row("rolling-bf16", 1, 44), row("vllm-cpu-bf16", 1, 40), row("rolling-bf16", 32, 300),
            row("vllm-cpu-bf16", 32, 340), row("rolling-q4-bf16", 1, 80), row("rolling-q4km-bf16", 1, 78),
            row("llama-server-q4km", 1, 90), row("rolling-q4-bf16", 32, 400), row("rolling-q4km-bf16", 32, 360)]
    lines = "\n".join(target_checks(rows, 32, 16))
    assert "rolling-bf16@1 vs vllm-cpu-bf16@1 tok/s: 44.0 / 40.0 = **1.10x** (target >= 1.1x) PASS" in lines
    assert "rolling-bf16@32 vs vllm-cpu-bf16@32 tok/s: 300.0 / 340.0 = **0.88x** (target >= 1.1x) MISS" in lines
    assert "- tok/s vs vllm-cpu-bf16 (340.0 tok/s) at 32 client(s): rolling-bf16 0.88x" in lines
    assert ("rolling-q4km-bf16@1 vs rolling-q4-bf16@1 (the Q4_1 path) tok/s: 78.0 / 80.0 = **0.97x** "
            "(target >= 0.95x) PASS") in lines
    assert "rolling-q4km-bf16@32 vs rolling-q4-bf16@32 (the Q4_1 path) tok/s: 360.0 / 400.0 = **0.90x**" in lines
    assert "rolling-q4km-bf16@1 vs llama-server-q4km@1 (the same file) tok/s: 78.0 / 90.0 = **0.87x**" in lines
    [llama_line] = [line for line in lines.splitlines() if "vs llama-server-q4km (Q4_K_M, 90.0 tok/s) at 1" in line]
    assert "rolling-q4-bf16 0.89x" in llama_line and "rolling-q4km-bf16 0.87x" in llama_line
    plain = "\n".join(target_checks([row("rolling", 1, 20), row("rolling", 32, 100)], 32, 16))
    assert "vllm-cpu-bf16" not in plain and "(the Q4_1 path)" not in plain and "(the same file)" not in plain


def test_vllm_cpu_bf16_serves_in_bfloat16(tmp_path):
    flags = vllm_cpu.command(tmp_path / "python", "/models/smol", 8123, 32, 512, "bfloat16")[3:]
    assert dict(zip(flags[::2], flags[1::2]))["--dtype"] == "bfloat16"


def test_q4km_systems_without_llama_quantize_are_skipped_with_the_build_hint(tmp_path, monkeypatch):
    """Both serve the GGUF llama-quantize makes: without the llama.cpp build neither starts, and each says why."""
    monkeypatch.setenv("LLAMA_CPP_HOME", str(tmp_path / "no-build"))
    servers = Servers(tmp_path, ["rolling-q4km-bf16", "llama-server-q4km"], ServerSettings(), ModelSource())
    assert servers.servers == {}
    assert all("benchmarks/build_llama_server" in servers.skipped[name]
               for name in ("rolling-q4km-bf16", "llama-server-q4km"))
    assert our_options("rolling-q4km-bf16", ServerSettings())["quantize"] == "q4"
