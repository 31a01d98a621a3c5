"""`python -m services.rollout --config FILE --replica ID [key=value ...]` (and `lorabus rollout`)."""

from __future__ import annotations

import asyncio
import logging
import sys

from proto.messages import EngineKind
from services.common import entry
from services.config.schema import LorabusConfig

log = logging.getLogger("services.rollout")
PROG = "lorabus rollout"

ENGINES = ("embedded", "vllm", "sglang")


def build_engine(name: str, cfg):
    """The one dispatch point for engines; server engines arrive as their modules land."""
    if name == "embedded":
        from services.rollout.engines.embedded import EmbeddedEngine

        return EmbeddedEngine.from_config(cfg)
    try:
        module = __import__(f"services.rollout.engines.{name}", fromlist=["from_config"])
    except ModuleNotFoundError as exc:
        raise SystemExit(f"--engine {name}: services/rollout/engines/{name}.py is not available ({exc})") from None
    return module.from_config(cfg)


def fetcher(cfg):
    from services.common import durable
    from services.common.store import store_for_uri

    def fetch(ev) -> bytes:
        obj = ev.object_payload()
        return durable.read(store_for_uri(obj.uri, cfg.store), obj)

    return fetch


async def serve(cfg: LorabusConfig, replica: str, engine_name: EngineKind) -> int:
    from services.common import capacity, models
    from services.common.data import load_prompts
    from services.common.metrics import start_metrics_server
    from services.common.rewards import load_reward_fn
    from services.rollout.fleet import FleetReplica
    from services.rollout.run_engines import RunEngines
    from services.rollout.service import RolloutService

    port = start_metrics_server(cfg.metrics)
    log.info("rollout %s: metrics on port %d", replica, port)
    tok = models.load_tokenizer(cfg.actor.tokenizer_path or cfg.actor.path)
    engine = build_engine(engine_name, cfg)
    slots, _ = capacity.slots(cfg)
    stager = None
    # The fast load path installs the engine's slots for the fleet's own run alone; a fleet sized
    # for submitted runs (more slots, or a higher padded rank) loads through `RunEngines` instead.
    own_only = slots == cfg.rollout.keep_versions + 1 and capacity.max_rank(cfg) == cfg.actor.lora_rank
    if engine_name == "embedded" and own_only:
        from services.common.store import store_for_uri
        from services.rollout.load_path import Stager

        stager = Stager(engine, lambda uri: store_for_uri(uri, cfg.store))
    async with entry.connected(cfg, f"rollout-{replica}"[:64]) as bus:

        def make(run_cfg: LorabusConfig, run_engine, run_bus) -> RolloutService:
            return RolloutService(
                run_cfg,
                replica,
                run_engine,
                run_bus,
                fetch=fetcher(run_cfg),
                encode=lambda text: models.encode_prompt(tok, text),
                decode_text=lambda ids: models.decode_completion(tok, ids),
                reward_fn=load_reward_fn(run_cfg.train_dataset.reward_fn),
                prompts=load_prompts(run_cfg.train_dataset),
                engine_name=engine_name,
                admission_timeout_s=min(run_cfg.rollout.request_timeout_s, 5.0),
                # the fast load path writes straight into the engine's slots, whose version
                # numbers are the fleet's own run's; submitted runs load through their views
                stager=stager if run_cfg.run == cfg.run else None,
            )

        engines = RunEngines(engine, cfg.run, slots=slots, rank=capacity.max_rank(cfg))
        fleet_replica = FleetReplica(
            cfg, replica, bus, engines, make, admission_timeout_s=min(cfg.rollout.request_timeout_s, 5.0)
        )
        try:
            await fleet_replica.run(entry.stop_event())
        finally:
            await engine.close()
    log.info("rollout %s: stopped", replica)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = entry.parser(PROG, "rollout service")
    ap.add_argument("--replica", help="replica id ([A-Za-z0-9_-], unique per run); required to serve")
    ap.add_argument(
        "--engine", choices=ENGINES, default=None, help="defaults to rollout.engine of the config (embedded)"
    )
    ap.add_argument(
        "--server-url",
        action="append",
        default=[],
        metavar="URL",
        help="vllm/sglang: a server replica's base URL (repeat for each data-parallel "
        "replica); replaces rollout.server_urls",
    )
    ap.add_argument(
        "--print-server-cmd",
        action="store_true",
        help="print the vLLM/SGLang server command line the config asks for, and exit",
    )
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.engine:
        args.overrides = [f"rollout.engine={args.engine}", *args.overrides]
    if args.server_url:
        args.overrides = [*args.overrides, f"rollout.server_urls=[{','.join(args.server_url)}]"]

    from proto import subjects
    from services.common.logs import setup_logging

    cfg = entry.load_or_exit(args, PROG)
    try:
        if args.print_server_cmd:
            from services.rollout.server_cmd import server_command, server_env, shell_line

            print(shell_line(server_command(cfg), server_env(cfg)))
            return 0
        if args.replica is None:
            print("lorabus rollout: --replica is required to serve (e.g. --replica r0)", file=sys.stderr)
            return 2
        subjects.token(args.replica, "--replica")
    except (subjects.SubjectError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    setup_logging(f"rollout-{args.replica}", args.log_level)
    return asyncio.run(serve(cfg, args.replica, args.engine or cfg.rollout.engine))


if __name__ == "__main__":
    sys.exit(main())
