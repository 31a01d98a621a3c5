"""`python -m services.trainer --config FILE [key=value ...]` (also `lorabus trainer`).

Under `torchrun --nproc_per_node=N -m services.trainer ...` every rank runs this; rank 0
serves the bus, the others follow its broadcasts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

log = logging.getLogger("services.trainer")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lorabus trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="lorabus YAML config")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from services.common.config import ConfigError, load_config
    from services.common.logs import setup_logging

    setup_logging("trainer", args.log_level)
    try:
        cfg = load_config(args.config, overrides=args.overrides)
    except ConfigError as exc:
        print(f"lorabus trainer: {exc}", file=sys.stderr)
        return 2

    from services.common.metrics import start_metrics_server
    from services.trainer import service
    from services.trainer.engines import make_engine

    engine = make_engine(cfg)
    ckpt = service.restore(engine, cfg)
    if engine.rank != 0:
        service.worker_loop(engine)
        return 0
    port = start_metrics_server(cfg.metrics)
    log.info("metrics on :%d; LoRA r=%d on %s; %s, world size %d", port, engine.lora.rank,
             ",".join(engine.lora.target_modules), engine.device, engine.world_size)
    asyncio.run(service.run_rank0(cfg, engine, ckpt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
