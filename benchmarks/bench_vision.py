"""Vision-language serving, measured: what one image costs a prefill, and throughput with image and text
rows mixed, the rolling batch against one row at a time, in one run.

The model is SmolVLM-256M's shape with random weights (no Hub here): Idefics3 with a SigLIP-B/16 vision
tower at 512 pixels (12 layers, 768 wide), a pixel-shuffle connector (scale 4: 64 tokens per 512-pixel
tile) and SmolLM2-135M as the text model (its real tokenizer). Timing does not depend on the weights'
values; generations are forced to --tokens tokens (ignore_eos).

Two servers, one at a time (an idle server would hold cores): `rolling` (the default rolling batch)
and `sequential` (option.max_rolling_batch_size=1). Each gets:
1. prefill: TTFT of one chat request alone, with one 512x512 image and without it (same text), the
   median of --repeats; the difference is the image's encoder + its 64+ prompt tokens;
2. mix: --clients closed-loop clients, every other request with an image, --requests in all;
   generated tok/s, TTFT p50, and the worker's peak RSS (VmHWM) after load and after the run.

Run: .venv/bin/python -m benchmarks.bench_vision [--clients 8] [--requests 32] [--tokens 32]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from benchmarks.benchmark.common import cpu_summary
from benchmarks.benchmark.suite import helper
from benchmarks.soak import worker_pid

ROOT = Path(__file__).resolve().parents[1]
serving = helper("server_process").serving
CHAT_TEMPLATE = helper("tiny_vlm").CHAT_TEMPLATE  # ChatML; an image part becomes <image>, as the tests' VLMs

QUESTIONS = ["What is in the picture?", "Describe the colours you see.", "Is there any text in this image?",
             "Count the objects in the picture.", "What is the weather like here?"]


def smolvlm_256m_shape(folder: Path) -> Path:
    import torch
    import transformers as tf
    smollm2_folder = helper("tp_model").smollm2_folder

    tokenizer = tf.AutoTokenizer.from_pretrained(str(smollm2_folder()))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", "<global-img>"]},
                                 replace_extra_special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    images = tf.Idefics3ImageProcessor(size={"longest_edge": 512}, max_image_size={"longest_edge": 512})
    processor = tf.Idefics3Processor(images, tokenizer, image_seq_len=64, chat_template=CHAT_TEMPLATE)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=512, patch_size=16)
    config = tf.Idefics3Config(vision_config=vision, text_config=text, scale_factor=4,
                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = tf.Idefics3ForConditionalGeneration(config).float().eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def picture(seed: int) -> str:
    import torch
    from PIL import Image

    pixels = torch.randint(0, 256, (512, 512, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(base: str, question: str, image: str | None, tokens: int) -> tuple[float, int]:
    """(TTFT s, tokens) of one streamed chat request."""
    content = ([{"type": "image_url", "image_url": {"url": image}}] if image else []) + [{"type": "text", "text": question}]
    started, first, count = time.monotonic(), None, 0
    with requests.post(f"{base}/v1/chat/completions", stream=True, timeout=600, json={
            "model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                first = first or time.monotonic()
                count += 1
    return (first or time.monotonic()) - started, count


def peak_rss_mib(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) / 1024


def measure(system: str, store: Path, args, images: list[str]) -> dict:
    options = "option.max_rolling_batch_size=1\n" if system == "sequential" else ""
    (store / "vlm" / "serving.properties").write_text(options)
    with serving("--model-store", str(store)) as server:
        pid = worker_pid(server.proc.pid)
        chat(server.base, QUESTIONS[0], images[0], 2)  # warm-up
        loaded = peak_rss_mib(pid)
        with_image = statistics.median(chat(server.base, QUESTIONS[0], images[i % len(images)], 1)[0]
                                       for i in range(args.repeats))
        text_only = statistics.median(chat(server.base, QUESTIONS[0], None, 1)[0] for _ in range(args.repeats))
        ttfts, tokens, lock, counter = [], [0], threading.Lock(), iter(range(args.requests))

        def client() -> None:
            for i in counter:  # shared: each index once
                ttft, n = chat(server.base, QUESTIONS[i % len(QUESTIONS)], images[i % len(images)] if i % 2 == 0 else None,
                               args.tokens)
                with lock:
                    ttfts.append(ttft)
                    tokens[0] += n

        started = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        return {"system": system, "prefill_image_ms": round(1000 * with_image, 1),
                "prefill_text_ms": round(1000 * text_only, 1),
                "image_cost_ms": round(1000 * (with_image - text_only), 1),
                "mix_tok_s": round(tokens[0] / elapsed, 1), "mix_ttft_p50_s": round(statistics.median(ttfts), 2),
                "peak_rss_loaded_mib": round(loaded), "peak_rss_after_mib": round(peak_rss_mib(pid))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"# {cpu_summary()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as root:
        store = Path(root)
        smolvlm_256m_shape(store / "vlm")
        images = [picture(seed) for seed in range(4)]
        rows = [measure(system, store, args, images) for system in ("rolling", "sequential")]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"rolling / sequential, mixed tok/s: {rows[0]['mix_tok_s'] / rows[1]['mix_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
