"""`lorabus evaluate`: score exported versions, as an outside user would.

It is not part of the training loop: it only reads `export.v<N>.done` events, loads the PEFT
directory with plain `peft.PeftModel.from_pretrained` on the base model, runs a scoring hook and
publishes an `EvalResult`. Like the exporter it serves every run of its fleet (a `RunHost`
following the run table, in every state, so a stopped run's last exports are scored too): one
base model for the process, and per run an `EvalWorker` with the run's config (its
`valid_dataset`, reward and export location), its own durable on the run's EXPORTS stream and its
results and metrics under the run. A bus user that cannot read the run table scores its own run
alone, as before fleets. The `evaluator` config section says where the base model runs
(device, dtype), how many held-out prompts and how many per batch, and which versions to score
(`services.clients.eval_policy`: every one, every Nth, or the newest when it falls behind; the
last version always). The default hook is greedy held-out accuracy on `valid_dataset` with the
configured reward function; `evaluator.score` or `--score pkg.mod:fn` plugs in another
(`fn(model, tokenizer, prompts, cfg) -> (metric_name, score)`).

Invariant: a score is computed with its run's own config and published under that run only,
one version at a time over the one base model.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from proto import messages as m
from proto import subjects
from services.common import entry
from services.common.bus import Bus
from services.config.schema import LorabusConfig

log = logging.getLogger("lorabus.evaluate")
PROG = "lorabus evaluate"


def load_hook(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--score: {spec!r} must look like package.module:function")
    return getattr(importlib.import_module(module_name), attr)


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 64) -> list[str]:
    from services.common.models import decode_completion, encode_prompt

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    device = next(model.parameters()).device
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):  # left padding: generation continues every row's end
            ids[i, width - len(e) :] = torch.tensor(e)
            mask[i, width - len(e) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for row in gen[:, width:].tolist():
            out.append(decode_completion(tokenizer, row))
    return out


def heldout_reward(model, tokenizer, prompts, cfg: LorabusConfig) -> tuple[str, float]:
    """Mean reward of greedy completions on the held-out prompts."""
    from services.common.rewards import load_reward_fn

    reward_fn = load_reward_fn(cfg.valid_dataset.reward_fn or cfg.train_dataset.reward_fn)
    texts = greedy_completions(
        model, tokenizer, [p.text for p in prompts], cfg.gconfig.max_new_tokens, cfg.evaluator.batch_size
    )
    rewards = [reward_fn(p.text, t, p.answer) for p, t in zip(prompts, texts)]
    return "heldout_reward", sum(rewards) / max(len(rewards), 1)


class SharedBase:
    """The base model and tokenizer of a fleet, loaded once per process. Scoring wraps this one
    model in a PeftModel and unwraps it again, so versions are scored one at a time (`lock`),
    whichever run they belong to."""

    def __init__(self, cfg: LorabusConfig) -> None:
        from services.common.models import load_base_model, load_tokenizer

        e = cfg.evaluator
        self.tokenizer = load_tokenizer(cfg.actor.tokenizer_path or cfg.actor.path)
        self.dtype = cfg.rollout.dtype if e.dtype == "auto" else e.dtype
        self.model = load_base_model(cfg.actor.path, self.dtype, e.device)
        self.model.eval()
        self.lock = threading.Lock()


class Evaluator:
    """One run's scorer: its held-out prompts and config over the shared base; each version is
    a fresh PeftModel over it. `for_run` makes another run's over the same base."""

    def __init__(self, cfg: LorabusConfig, hook, shared: SharedBase | None = None) -> None:
        from services.common.data import load_prompts

        self.cfg = cfg
        self.hook = hook
        self.shared = shared if shared is not None else SharedBase(cfg)
        e = cfg.evaluator
        self.prompts = load_prompts(cfg.valid_dataset)[: e.max_prompts]
        log.info(
            "run %s: base model on %s in %s; %d held-out prompts, batches of %d; scoring %s",
            cfg.run,
            self.shared.model.device,
            self.shared.dtype,
            len(self.prompts),
            e.batch_size,
            e.versions if e.versions != "every_nth" else f"every {e.nth}th version",
        )

    def for_run(self, cfg: LorabusConfig) -> Evaluator:
        """Another run of the fleet (the same base: `actor.path` is a fleet setting)."""
        return Evaluator(cfg, self.hook, self.shared)

    def score(self, directory: Path) -> tuple[str, float]:
        from peft import PeftModel

        with self.shared.lock:
            model = PeftModel.from_pretrained(self.shared.model, str(directory))
            model.eval()
            try:
                return self.hook(model, self.shared.tokenizer, self.prompts, self.cfg)
            finally:
                # unload() hands back the base without the LoRA layers so the next version starts clean
                self.shared.model = model.unload()


def local_dir(uri: str, cfg: LorabusConfig, version: int, scratch: Path) -> Path:
    """A local directory holding the exported version (downloads from S3 if needed). Only the
    run's own export of `version` is read: an event naming anything else is refused."""
    from services.common.store import S3Store, StoreError
    from services.exporter.peft_dir import version_uri

    expected = version_uri(cfg.exporter.uri, version)
    if uri.rstrip("/") != expected:
        raise StoreError(f"{uri}: not the run's export of v{version} ({expected}); only that is evaluated")
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(parsed.path)
    store = S3Store.from_config(cfg.store, uri=cfg.exporter.uri, create_bucket=False)
    target = scratch / f"v{version}"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        store.get_file(uri.rstrip("/") + "/" + name, target / name)
    return target


class EvalWorker:
    """One run's versions scored (a `RunWorker` of the evaluator's `RunHost`): its durable
    `eval-<name>` on the run's EXPORTS stream, results on the run's eval subject."""

    def __init__(self, cfg: LorabusConfig, bus: Bus, evaluator: Evaluator, name: str) -> None:
        self.cfg, self.bus, self.evaluator, self.name = cfg, bus, evaluator, name
        self.scratch = Path(cfg.run_dir) / name

    async def start(self) -> None:
        from services.common import streams

        await self.bus.consume(
            streams.EXPORTS(self.cfg.run),
            f"eval-{self.name}",
            m.ExportDone,
            self.on_export,
            batch=1,
            # kept alive while scoring: a killed evaluator's version comes back this soon
            ack_wait_s=streams.ACK_WAIT_S,
        )

    async def drain(self) -> None:
        """Nothing to wait for: the host retires runs only when the process stops, and a version
        whose score was not published is not acked, so it comes back to the next evaluator."""

    async def close(self) -> None:
        """Nothing of its own to release: the base is the process's, the consumer the view's."""

    def own_export(self, event: m.ExportDone) -> bool:
        from services.exporter.peft_dir import version_uri

        cfg = self.cfg
        return event.run == cfg.run and event.uri.rstrip("/") == version_uri(cfg.exporter.uri, event.version)

    async def newest_exported(self, version: int) -> int:
        from services.common import streams

        if self.cfg.evaluator.versions != "newest":
            return version  # the other policies do not look ahead
        last: m.ExportDone | None = await self.bus.last(streams.EXPORTS(self.cfg.run), m.ExportDone)
        if last is None or not self.own_export(last):  # a stranger's "export" decides nothing
            return version
        return max(version, last.version)

    async def on_export(self, event: m.ExportDone, _meta) -> None:
        from services.clients import eval_policy, metrics
        from services.common.bus import Refused

        cfg, name = self.cfg, self.name
        if not self.own_export(event):
            raise Refused(f"export v{event.version}: {event.uri} is not the run's export of it")
        newest = await self.newest_exported(event.version)
        if not eval_policy.should_score(cfg.evaluator, event.version, newest, cfg.total_train_steps):
            log.info("run %s: v%d skipped (evaluator.versions %s; newest exported v%d)",
                     cfg.run, event.version, cfg.evaluator.versions, newest)  # fmt: skip
            return
        directory = local_dir(event.uri, cfg, event.version, self.scratch)
        started = time.monotonic()
        metric, score = await asyncio.to_thread(self.evaluator.score, directory)
        elapsed = time.monotonic() - started
        log.info("run %s: v%d %s=%.4f (%.1f s)", cfg.run, event.version, metric, score, elapsed)
        metrics.EVAL_SECONDS.labels(cfg.run, name).observe(elapsed)
        metrics.EVAL_SCORE.labels(cfg.run, name, metric).set(score)
        metrics.EVAL_VERSION.labels(cfg.run, name).set(event.version)
        result = m.EvalResult(
            run=cfg.run,
            evaluator=name,
            version=event.version,
            metric=metric,
            score=float(score),
            n=len(self.evaluator.prompts),
            evaluated_at=time.time(),
        )
        await self.bus.publish(subjects.eval_result(cfg.run, name), result, msg_id=f"eval-{name}-v{event.version}")


async def keep_serving(bus: Bus, fleet: str, run: str, service: str, fault: BaseException) -> bool:
    """A run the evaluator cannot score (its held-out data, its reward) is logged, never stopped:
    scoring is not part of training, and the evaluator user may not stop runs."""
    log.error("%s: run %s of fleet %s is not scored: %s", service, run, fleet, fault)
    return False


async def run(cfg: LorabusConfig, hook_spec: str, evaluator_name: str) -> int:
    from services.common.metrics import start_metrics_server
    from services.common.run_host import ALL_STATES, RunHost

    hook = load_hook(hook_spec)
    evaluator = await asyncio.to_thread(Evaluator, cfg, hook)
    port = start_metrics_server(cfg.metrics)
    log.info("metrics on :%d/metrics", port)
    stop = entry.stop_event()
    async with entry.connected(cfg, evaluator_name) as bus:

        async def make(run_cfg: LorabusConfig, run_bus: Bus) -> EvalWorker:
            # another run's held-out prompts are read off the event loop, as the own run's were
            scorer = evaluator if run_cfg.run == cfg.run else await asyncio.to_thread(evaluator.for_run, run_cfg)
            return EvalWorker(run_cfg, run_bus, scorer, evaluator_name)

        # every state opens (a stopped or finished run's exports are still scored), none ends
        host = RunHost(
            cfg, bus, make, name=f"evaluator {evaluator_name}", opens=ALL_STATES, ends=(), report=keep_serving
        )
        await host.start()
        try:
            await stop.wait()
        finally:
            await host.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = entry.parser(PROG, __doc__.splitlines()[0])
    p.add_argument("--score", help="scoring hook, package.module:function (default: evaluator.score)")
    p.add_argument("--name", default="heldout", help="evaluator id in the eval subject")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    cfg = entry.start(args, PROG, service=args.name)
    return asyncio.run(run(cfg, args.score or cfg.evaluator.score, subjects.token(args.name, "--name")))


if __name__ == "__main__":
    sys.exit(main())
