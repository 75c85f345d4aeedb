"""`python -m lmi_serve.server.tp_follower`: tensor-parallel rank 1..N-1 of one model replica (model/tp.py).

Started by rank 0 (the server's worker) with the model's ModelConfig as JSON on stdin. It joins the
group, loads its shard exactly as rank 0 loads its own, builds the same KV layout, then replays rank
0's model calls (engine/kv/replicate.py) until told to stop. Exit status: 0 after a clean stop, 2 when
the model cannot load (the message is logged; rank 0 fails the same way and says why), 1 when the
group breaks (rank 0 gone, a collective timed out).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

log = logging.getLogger("lmi_serve.tp_follower")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lmi_serve.server.tp_follower", description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--cache-dir", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from lmi_serve.server import logs
    from lmi_serve.config.sources import ModelConfig

    # Rank 0 owns this process: a SIGTERM or Ctrl-C meant for the server (its process group) must not
    # end a rank while rank 0 drains its requests. It ends on rank 0's STOP, or when rank 0 is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = parse_args(argv)
    logs.configure(os.environ.get("LMI_SERVE_LOG_LEVEL", "info"), os.environ.get("LMI_SERVE_LOG_FORMAT", "text"))
    config = ModelConfig.model_validate_json(sys.stdin.read())

    import torch.distributed as dist

    from lmi_serve.engine.build import follower_layout
    from lmi_serve.engine.kv.replicate import follow
    from lmi_serve.kernels.host import probe
    from lmi_serve.kernels.plan import plan_kernels
    from lmi_serve.model.loader import load_generation_model
    from lmi_serve.model.source import ModelLoadError
    from lmi_serve.model.tp import join_group, watch_parent

    watch_parent(os.getppid())  # rank 0 gone: leave at once, whatever a collective waits on (NCCL does not raise)
    device = join_group(args.rank, args.world, args.port, args.threads)
    try:
        loaded = load_generation_model(
            config.model_id or config.model_dir, gguf_file=config.gguf_file, dtype=config.dtype,
            device_map=config.device_map, tensor_parallel_degree=args.world, revision=config.revision,
            trust_remote_code=config.trust_remote_code, cache_dir=args.cache_dir)
    except ModelLoadError as exc:
        log.error("Rank %d: %s", args.rank, exc)
        return 2
    model = loaded.model
    # rank 0's plan (serving/handlers/huggingface.py), so every rank's shard runs the same forward
    plan = plan_kernels(model, config, probe(), device=loaded.device, sharded=True)
    log.info("Rank %d: %s", args.rank, plan.summary())
    try:
        follow(model, follower_layout(model, config), device)
    except Exception as exc:  # rank 0 is gone or out of step: this rank can do nothing more
        log.error("Rank %d leaves the tensor-parallel group: %s", args.rank, exc)
        return 1
    dist.destroy_process_group()
    log.info("Rank %d stopped", args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
