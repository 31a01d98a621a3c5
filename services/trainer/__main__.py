"""`python -m services.trainer --config FILE [key=value ...]` (also `lorabus trainer`).

Under `torchrun --nproc_per_node=N -m services.trainer ...` every rank runs this; rank 0
serves the bus, the others follow its broadcasts.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.trainer.engines.base import TrainEngine

from services.common import entry

log = logging.getLogger("services.trainer")
PROG = "lorabus trainer"


def main(argv: list[str] | None = None) -> int:
    args = entry.parser(PROG, __doc__.splitlines()[0]).parse_args(sys.argv[1:] if argv is None else argv)
    cfg = entry.start(args, PROG, service="trainer")

    from services.common.metrics import start_metrics_server
    from services.trainer import canary as trainer_canary
    from services.trainer import ranks, resume, service
    from services.trainer.engines import make_engine
    from services.trainer.engines.base import collective_timeout_s

    if "TORCHELASTIC_RUN_ID" in os.environ:
        follow_parent()
    engine = make_engine(cfg)
    ckpt = resume.restore(engine, cfg)
    # the untrained adapter is v0; gathering it is a collective, so every rank takes part, as
    # in the first version's canary (a forward of the sharded model)
    initial = engine.adapter_state() if ckpt is None else None
    canary, _ = trainer_canary.timed(engine)
    freeze_startup()
    if engine.rank != 0:
        ranks.worker_loop(engine)
        return leave(engine)
    followers = ranks.Followers(engine.world_size, wait_s=min(30.0, collective_timeout_s()))
    try:
        try:
            port = start_metrics_server(cfg.metrics)
            lora = engine.lora_spec()
            log.info(
                "metrics on :%d; LoRA r=%d on %s; %s, world size %d",
                port,
                lora.rank,
                ",".join(lora.target_modules),
                engine.device,
                engine.world_size,
            )
            asyncio.run(service.run_rank0(cfg, engine, ckpt, initial, followers, canary))
        finally:
            followers.stop()  # however rank 0 ends, the followers must stop too
    except ranks.PeerLost as exc:
        log.error("%s", exc, exc_info=exc)
        logging.shutdown()
        os._exit(1)  # a send is stuck in gloo: a normal exit would wait for it
    return leave(engine)


def freeze_startup() -> None:
    """Put what start-up built (the model, the optimizer, every import) out of the cyclic
    collector's sight: its full collections then scan only what the steps make. In a CPU fleet
    of 8 runs the trainer tracked 417k objects and a full collection stopped every thread, the
    step's and the event loop's, for up to 355 ms (7 of them 1.34 s in 50 s)."""
    gc.collect()
    gc.freeze()


def leave(engine: TrainEngine) -> int:
    """0 in one process; over several ranks the process ends in `leave_distributed` (status 0)."""
    if engine.world_size > 1:
        from services.trainer.engines.base import leave_distributed

        leave_distributed()
    return 0


def follow_parent() -> None:
    """Get SIGTERM when torchrun dies (even by SIGKILL): its workers run in their own
    sessions, and without this they would outlive it and keep the ports and GPUs."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); ranks may outlive torchrun", ctypes.get_errno())


if __name__ == "__main__":
    sys.exit(main())
