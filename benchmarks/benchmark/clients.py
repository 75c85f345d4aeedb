"""HTTP clients: streaming LMI (rolling), non-streaming (dynamic) and OpenAI SSE (completions, chat; our
server and llama-server) requests, driven closed-loop for a number of requests or for a duration."""

from __future__ import annotations

import gc
import json
import threading
import time
from typing import Any

from .workload import Workload


def stream_one(session, url: str, prompt: str, max_new_tokens: int, parameters: dict | None = None) -> dict:
    """One streaming jsonlines request; timestamps each complete line as it arrives. `parameters`:
    more request parameters (e.g. a LoRA adapter)."""
    payload = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True,
                                                **(parameters or {})},
               "stream": True}
    rec: dict[str, Any] = {"ok": False, "error": None, "tokens": 0, "target": max_new_tokens, "ttft": None,
                           "itl": [], "streamed": True}
    start = time.perf_counter()
    rec["start"] = start
    try:
        with session.post(url, json=payload, stream=True, timeout=(10, 600)) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                rec["e2e"] = time.perf_counter() - start
                return rec
            buf, last, final = b"", None, False
            for chunk in resp.iter_content(chunk_size=None):
                now = time.perf_counter()
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    if "error" in obj:
                        rec["error"] = f"stream error line: {obj}"
                    if "token" in obj:
                        rec["tokens"] += 1
                        if last is None:
                            rec["ttft"] = now - start
                        else:
                            rec["itl"].append(now - last)
                        last = now
                    if "generated_text" in obj:
                        final = True
            rec["e2e"] = time.perf_counter() - start
            if rec["error"] is None and not final:
                rec["error"] = "stream ended without generated_text"
            rec["ok"] = rec["error"] is None
    except Exception as exc:  # noqa: BLE001 - every failure is counted, never raised
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["e2e"] = time.perf_counter() - start
    return rec


def sse_one(session, url: str, payload: dict, max_new_tokens: int) -> dict:
    """One OpenAI SSE stream: TTFT and the gaps between chunks that carry text; output tokens from
    the usage chunk when the server sends one, else one per text chunk."""
    rec: dict[str, Any] = {"ok": False, "error": None, "tokens": 0, "target": max_new_tokens, "ttft": None,
                           "itl": [], "streamed": True, "start": time.perf_counter()}
    chunks, usage = 0, None
    try:
        resp = post_fresh_on_drop(session, url, payload, rec)
        with resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
            last = None
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:200]
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if last is None:
                        rec["ttft"] = now - rec["start"]
                    else:
                        rec["itl"].append(now - last)
                    last = now
        rec["tokens"] = usage["completion_tokens"] if usage else chunks
        rec["ok"] = rec["error"] is None and rec["tokens"] > 0
    except Exception as exc:  # noqa: BLE001 - every failure is counted
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["e2e"] = time.perf_counter() - rec["start"]
    return rec


def post_fresh_on_drop(session, url: str, payload: dict, rec: dict):
    """POST, streaming. A kept-alive connection that the server closed before answering (seen with
    llama-server: its log shows the request never arrived) is retried once on a new connection and
    the clock restarts, as a browser does; the record says `retried`."""
    import requests

    try:
        return session.post(url, json=payload, stream=True, timeout=(10, 600))
    except requests.ConnectionError as exc:
        if "RemoteDisconnected" not in repr(exc):
            raise
        rec["start"], rec["retried"] = time.perf_counter(), True
        return session.post(url, json=payload, stream=True, timeout=(10, 600))


def openai_sender(route: str, system_prompt: str | None = None, extra: dict | None = None):
    """A sender for /v1/completions (`route="completions"`, the prompt as text) or /v1/chat/completions
    (`"chat"`: the prompt is the user message, after `system_prompt`), greedy, forced length
    (`max_tokens` + `ignore_eos`); `extra` fields go into every request (llama-server's cache_prompt)."""
    def send(session, url: str, prompt: str, max_new_tokens: int) -> dict:
        payload: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
                                   "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
        if route == "chat":
            system = [{"role": "system", "content": system_prompt}] if system_prompt else []
            payload["messages"] = [*system, {"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        return sse_one(session, url, payload, max_new_tokens)

    return send


def beam_one(session, url: str, prompt: str, max_new_tokens: int, num_beams: int = 4) -> dict:
    """One non-streaming LMI beam-search request (`parameters.num_beams`; beams need do_sample=false
    and stream=false); its latency is the E2E."""
    payload = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "num_beams": num_beams,
                                                "do_sample": False}}
    rec: dict[str, Any] = {"ok": False, "error": None, "tokens": 0, "target": max_new_tokens, "streamed": False,
                           "start": time.perf_counter()}
    try:
        resp = session.post(url, json=payload, timeout=(10, 600))
        if resp.status_code != 200:
            rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
        rec["ok"] = rec["error"] is None
    except Exception as exc:  # noqa: BLE001
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["e2e"] = time.perf_counter() - rec["start"]
    rec["ttft"] = rec["e2e"]
    return rec


class DynamicClient:
    def __init__(self, tokenizer, send_ignore_eos: bool):
        self.tokenizer, self.send_ignore_eos = tokenizer, send_ignore_eos

    def payload(self, prompt: str, max_new_tokens: int) -> dict:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        if self.send_ignore_eos:
            params["ignore_eos_token"] = True
        return {"inputs": prompt, "parameters": params}

    def __call__(self, session, url: str, prompt: str, max_new_tokens: int) -> dict:
        rec: dict[str, Any] = {"ok": False, "error": None, "tokens": 0, "target": max_new_tokens, "streamed": False}
        start = time.perf_counter()
        rec["start"] = start
        try:
            resp = session.post(url, json=self.payload(prompt, max_new_tokens), timeout=(10, 600))
            rec["e2e"] = time.perf_counter() - start
            rec["ttft"] = rec["e2e"]
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            body = resp.json()
            body = body[0] if isinstance(body, list) else body
            text = body["generated_text"]
            if self.send_ignore_eos:
                rec["tokens"] = max_new_tokens  # forced length: the server generated exactly this many ids
            else:  # EOS may stop it early: count by re-tokenizing the text
                rec["tokens"] = len(self.tokenizer(text, add_special_tokens=False).input_ids)
            rec["ok"] = True
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec.setdefault("e2e", time.perf_counter() - start)
        return rec


def quiet_collector() -> None:
    """Freeze what exists before a point out of Python's cyclic collector: a full collection of this
    process (193 ms, measured in a 3-minute run) stalls every client thread at once, and the streams'
    next tokens would read as a gap of whichever server is measured. What the point creates is collected
    as usual."""
    gc.collect()
    gc.freeze()


def closed_loop(send, url: str, workload: Workload, concurrency: int, num_requests: int) -> tuple[list[dict], float]:
    """`concurrency` clients, each sending its next request as soon as its previous one ends.
    Request k always carries prompt/length k, whatever client takes it."""
    import requests

    quiet_collector()
    counter = iter(range(num_requests))
    lock = threading.Lock()
    records: list[dict] = []

    def client() -> None:
        with requests.Session() as session:
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                _, prompt, n = workload.request(k)
                rec = send(session, url, prompt, n)
                rec["k"] = k
                with lock:
                    records.append(rec)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ends = [r["start"] + r["e2e"] for r in records]
    wall = (max(ends) if ends else time.perf_counter()) - started
    return sorted(records, key=lambda r: r["k"]), wall


def timed_loop(send, url: str, next_request, concurrency: int, duration: float) -> tuple[list[dict], float]:
    """`concurrency` clients in a closed loop for `duration` seconds: no request starts after that,
    the ones in flight finish. `next_request()` -> (prompt, max_new_tokens), thread-safe."""
    import requests

    quiet_collector()  # before the deadline: its collection is not the loop's time
    deadline = time.perf_counter() + duration
    lock = threading.Lock()
    records: list[dict] = []

    def client() -> None:
        with requests.Session() as session:
            while time.perf_counter() < deadline:
                prompt, n = next_request()
                rec = send(session, url, prompt, n)
                with lock:
                    records.append(rec)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - started
