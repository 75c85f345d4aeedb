"""HTTP checks scripts/test-container runs against a running container, as a client outside it would.

Each check prints one line, `PASS <name>` or `FAIL <name>: <why>`, which the script counts; the exit
status is the number of failures (capped at 100).

  container_checks.py ready  URL [--timeout S] [--alive CMD]
                                                     /ping: 503 while the models load, then 200 (CMD,
                                                     printing `true` while the container runs, ends
                                                     the wait early when the container has died)
  container_checks.py api    URL MODEL [--tensor-model M]
                                                     /invocations whole and streamed, an OpenAI chat,
                                                     a Triton infer (on MODEL, and on M when given)
  container_checks.py drain  URL -- STOP...          a stream in flight when STOP (e.g. `podman stop`)
                                                     sends SIGTERM runs to its end; /ping turns 503
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import numpy as np
import requests
import tritonclient.http as triton
from openai import OpenAI

failures = 0


def check(name: str, run: Callable[[], None]) -> None:
    """Run one check; an AssertionError or any exception is its failure, reported on one line."""
    global failures
    try:
        run()
    except Exception as exc:  # a check's failure, whatever it is, is reported and counted
        failures += 1
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"PASS {name}", flush=True)


def still_running(alive: str | None) -> bool:
    if not alive:
        return True
    answer = subprocess.run(shlex.split(alive), capture_output=True, text=True, timeout=120)
    return answer.stdout.strip() == "true"


def ping_statuses(url: str, timeout: float, alive: str | None) -> list[int]:
    """Every /ping status seen from now until the first 200 (connection errors are not statuses)."""
    seen: list[int] = []
    deadline, next_alive_check = time.monotonic() + timeout, time.monotonic() + 5
    while time.monotonic() < deadline:
        if time.monotonic() > next_alive_check:
            assert still_running(alive), f"the container stopped before /ping answered 200 (statuses seen: {seen})"
            next_alive_check = time.monotonic() + 5
        try:
            status = requests.get(f"{url}/ping", timeout=10).status_code
        except requests.RequestException:
            status = None
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"/ping did not answer 200 within {timeout:.0f} s (statuses seen: {seen})")


def check_ready(url: str, timeout: float, alive: str | None) -> None:
    seen: list[int] = []

    def reaches_200() -> None:
        seen.extend(ping_statuses(url, timeout, alive))

    def loading_was_503() -> None:
        assert seen and seen[0] == 503 and seen[-1] == 200, f"statuses in order: {seen}"
        assert set(seen) == {503, 200}, f"statuses in order: {seen}"

    check("ping answers 200 once the models are loaded", reaches_200)
    check("ping answered 503 while the models loaded", loading_was_503)


def invoke(url: str, body: dict, **kwargs) -> requests.Response:
    response = requests.post(f"{url}/invocations", json=body, timeout=300, **kwargs)
    assert response.status_code == 200, f"{response.status_code}: {response.text[:300]}"
    return response


def check_api(url: str, model: str, tensor_model: str | None) -> None:
    prompt = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
    whole: dict = {}

    def invocations_whole() -> None:
        whole.update(invoke(url, prompt).json())
        assert isinstance(whole.get("generated_text"), str) and whole["generated_text"].strip(), whole

    def invocations_streamed() -> None:
        response = invoke(url, {**prompt, "stream": True}, stream=True)
        lines = [json.loads(line) for line in response.iter_lines() if line]
        assert len(lines) >= 2, lines
        tokens = "".join(line["token"]["text"] for line in lines if "token" in line)
        assert lines[-1]["generated_text"] == tokens == whole.get("generated_text"), (lines[-1], tokens, whole)

    def openai_chat() -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.model == model and reply.choices[0].message.content.strip(), reply
        assert reply.choices[0].finish_reason in ("stop", "length"), reply

    def triton_infer_text() -> None:
        client = triton.InferenceServerClient(urlsplit(url).netloc, network_timeout=300.0)
        text = triton.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"The capital of France is"], dtype=object))
        output = client.infer(model, [text]).as_numpy("text_output")
        assert output is not None and output.size == 1 and output.reshape(-1)[0].strip(), output

    def triton_infer_tensor() -> None:
        client = triton.InferenceServerClient(urlsplit(url).netloc, network_timeout=300.0)
        first, second = np.arange(16, dtype=np.int32).reshape(1, 16), np.ones((1, 16), dtype=np.int32)
        inputs = [triton.InferInput("INPUT0", [1, 16], "INT32"), triton.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(first)
        inputs[1].set_data_from_numpy(second, binary_data=True)
        result = client.infer(tensor_model, inputs)
        assert np.array_equal(result.as_numpy("OUTPUT0"), first + second), result.get_response()
        assert np.array_equal(result.as_numpy("OUTPUT1"), first - second), result.get_response()

    check("/invocations answers a whole generation", invocations_whole)
    check("/invocations streams jsonlines that add up to the whole answer", invocations_streamed)
    check(f"OpenAI chat completion (openai client) on {model}", openai_chat)
    check(f"Triton infer (tritonclient) on {model}", triton_infer_text)
    if tensor_model:
        check(f"Triton infer (tritonclient, binary tensors) on {tensor_model}", triton_infer_tensor)


class InFlightStream(threading.Thread):
    """One LMI stream of exactly `tokens` tokens, read on its own thread; `started` is set at its first line."""

    def __init__(self, url: str, tokens: int):
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.lines: list[dict] = []
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        body = {"inputs": "1, 2, 3, 4,", "stream": True,
                "parameters": {"max_new_tokens": self.tokens, "ignore_eos_token": True, "details": True}}
        try:
            for line in invoke(self.url, body, stream=True).iter_lines():
                if line:
                    self.lines.append(json.loads(line))
                    self.started.set()
        except Exception as exc:  # the check reads it
            self.error = exc
        finally:
            self.started.set()


def check_drain(url: str, stop: list[str], tokens: int = 100) -> None:
    stream = InFlightStream(url, tokens)
    stream.start()
    stopper: subprocess.Popen | None = None
    lines_at_sigterm = 0

    def ping_503_while_a_stream_drains() -> None:
        nonlocal stopper, lines_at_sigterm
        assert stream.started.wait(300) and stream.error is None, f"the stream did not start: {stream.error}"
        lines_at_sigterm = len(stream.lines)
        stopper = subprocess.Popen(stop)
        deadline = time.monotonic() + 60
        while (status := requests.get(f"{url}/ping", timeout=10).status_code) != 503:
            assert time.monotonic() < deadline, f"/ping still answers {status} 60 s after SIGTERM"
            time.sleep(0.2)

    def stream_ran_to_its_end() -> None:
        stream.join(600)
        assert not stream.is_alive(), "the stream never ended"
        assert stream.error is None, stream.error
        last = stream.lines[-1]
        assert last.get("details", {}).get("finish_reason") == "length", last
        assert last["details"].get("generated_tokens") == tokens, last["details"]
        assert len(stream.lines) > lines_at_sigterm, "no token came after SIGTERM: the stream was not in flight"

    def stop_command_returned() -> None:
        assert stopper is not None, "never sent"
        assert stopper.wait(900) == 0, f"{' '.join(stop)} exited {stopper.returncode}"

    check("SIGTERM with a stream in flight: ping answers 503", ping_503_while_a_stream_drains)
    check(f"the in-flight stream runs to its end ({tokens} tokens) after SIGTERM", stream_ran_to_its_end)
    check("the stop command returns", stop_command_returned)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("ready")
    ready.add_argument("url")
    ready.add_argument("--timeout", type=float, default=900)
    ready.add_argument("--alive", help="a command printing `true` while the server runs")
    api = commands.add_parser("api")
    api.add_argument("url")
    api.add_argument("model")
    api.add_argument("--tensor-model")
    drain = commands.add_parser("drain")
    drain.add_argument("url")
    drain.add_argument("stop", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "ready":
        check_ready(args.url, args.timeout, args.alive)
    elif args.command == "api":
        check_api(args.url, args.model, args.tensor_model)
    else:
        check_drain(args.url, [part for part in args.stop if part != "--"])
    return min(failures, 100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
