"""What several integration tests share about a running server: prompts, the engine's counters,
and streams held open on their own threads or half-read."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager

import requests
from server_process import wait_for

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "List three colors:", "1, 2, 3,",
    "Once upon a time", "The best way to learn Python is", "Water boils at", "My favourite food is",
    "In 1492,", "The opposite of hot is", "Explain gravity in one sentence:", "Japanese words: 東京, 大阪, 京都,",
]


def token_ids(body):
    return [t["id"] for t in body["details"]["tokens"]]


def engine_stats(server, model):
    return requests.get(server.url(f"/models/{model}"), timeout=10).json()[0]["models"][0]["engine"]


class Stream(threading.Thread):
    """Consumes one stream on its own thread; `started` is set at its first chunk."""

    def __init__(self, chunks):
        super().__init__(daemon=True)
        self.source, self.chunks, self.error = chunks, [], None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.source():
                self.chunks.append(chunk)
                self.started.set()
        except Exception as exc:  # the assertions read it
            self.error = exc
        finally:
            self.started.set()

    def result(self, timeout: float = 180):
        self.join(timeout)
        assert not self.is_alive(), "the stream never ended"
        return self


class OpenStream:
    """A long stream on `faulty` whose first line was read; the rest stays unread until close().
    The line iterator is kept: dropping it would let urllib3 release (close) the connection."""

    def __init__(self, server, prompt, tokens=400):
        self.response = requests.post(server.url("/predictions/faulty"), stream=True, timeout=180, json={
            "inputs": prompt, "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True}, "stream": True})
        self.lines = self.response.iter_lines()
        assert "token" in json.loads(next(self.lines))

    def close(self):
        self.response.close()


@contextmanager
def both_rows_busy(server):
    """Two long streams fill `faulty`'s two rows; on exit they are closed and the rows freed,
    whatever the test did, so one failure cannot starve the next test."""
    streams = []
    try:
        streams = [OpenStream(server, p) for p in ("Once upon a time", "Tell me about the sea")]
        # A joiner's first token is sent before it is merged into the batch: poll, don't assert.
        wait_for(lambda: engine_stats(server, "faulty")["running"] == 2)
        yield streams
    finally:
        for stream in streams:
            stream.close()
        wait_for(lambda: engine_stats(server, "faulty")["running"] == 0)
