"""`lorabus evaluate`: score exported versions, as an outside user would.

It is not part of the training loop: it only reads `export.v<N>.done` events, loads the PEFT
directory with plain `peft.PeftModel.from_pretrained` on the base model, runs a scoring hook and
publishes an `EvalResult`. The `evaluator` config section says where the base model runs
(device, dtype), how many held-out prompts and how many per batch, and which versions to score
(`services.clients.eval_policy`: every one, every Nth, or the newest when it falls behind; the
last version always). The default hook is greedy held-out accuracy on `valid_dataset` with the
configured reward function; `evaluator.score` or `--score pkg.mod:fn` plugs in another
(`fn(model, tokenizer, prompts, cfg) -> (metric_name, score)`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from proto import messages as m
from proto import subjects
from services.common import entry
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


class Evaluator:
    """Holds the base model once; each version is a fresh PeftModel over it."""

    def __init__(self, cfg: LorabusConfig, hook) -> None:
        from services.common.data import load_prompts
        from services.common.models import load_base_model, load_tokenizer

        self.cfg = cfg
        self.hook = hook
        e = cfg.evaluator
        self.tokenizer = load_tokenizer(cfg.actor.tokenizer_path or cfg.actor.path)
        dtype = cfg.rollout.dtype if e.dtype == "auto" else e.dtype
        self.base = load_base_model(cfg.actor.path, dtype, e.device)
        self.base.eval()
        self.prompts = load_prompts(cfg.valid_dataset)[: e.max_prompts]
        log.info(
            "base model on %s in %s; %d held-out prompts, batches of %d; scoring %s",
            self.base.device,
            dtype,
            len(self.prompts),
            e.batch_size,
            e.versions if e.versions != "every_nth" else f"every {e.nth}th version",
        )

    def score(self, directory: Path) -> tuple[str, float]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(self.base, str(directory))
        model.eval()
        try:
            return self.hook(model, self.tokenizer, self.prompts, self.cfg)
        finally:
            # unload() hands back the base without the LoRA layers so the next version starts clean
            self.base = model.unload()


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


async def run(cfg: LorabusConfig, hook_spec: str, evaluator_name: str) -> int:
    from services.clients import eval_policy, metrics
    from services.common import streams
    from services.common.metrics import start_metrics_server
    from services.exporter.peft_dir import version_uri

    hook = load_hook(hook_spec)
    evaluator = await asyncio.to_thread(Evaluator, cfg, hook)
    port = start_metrics_server(cfg.metrics)
    log.info("metrics on :%d/metrics", port)
    scratch = Path(cfg.run_dir) / evaluator_name
    stop = entry.stop_event()
    async with entry.connected(cfg, evaluator_name) as bus:

        async def newest_exported(version: int) -> int:
            if cfg.evaluator.versions != "newest":
                return version  # the other policies do not look ahead
            last: m.ExportDone | None = await bus.last(streams.EXPORTS(cfg.run), m.ExportDone)
            if last is None or not own_export(last):  # a stranger's "export" decides nothing
                return version
            return max(version, last.version)

        def own_export(event: m.ExportDone) -> bool:
            return event.run == cfg.run and event.uri.rstrip("/") == version_uri(cfg.exporter.uri, event.version)

        async def on_export(event: m.ExportDone, _meta) -> None:
            from services.common.bus import Refused

            if not own_export(event):
                raise Refused(f"export v{event.version}: {event.uri} is not the run's export of it")
            newest = await newest_exported(event.version)
            if not eval_policy.should_score(cfg.evaluator, event.version, newest, cfg.total_train_steps):
                log.info(
                    "v%d skipped (evaluator.versions %s; newest exported v%d)",
                    event.version,
                    cfg.evaluator.versions,
                    newest,
                )
                return
            directory = local_dir(event.uri, cfg, event.version, scratch)
            started = time.monotonic()
            metric, score = await asyncio.to_thread(evaluator.score, directory)
            elapsed = time.monotonic() - started
            log.info("v%d %s=%.4f (%.1f s)", event.version, metric, score, elapsed)
            metrics.EVAL_SECONDS.labels(cfg.run, evaluator_name).observe(elapsed)
            metrics.EVAL_SCORE.labels(cfg.run, evaluator_name, metric).set(score)
            metrics.EVAL_VERSION.labels(cfg.run, evaluator_name).set(event.version)
            result = m.EvalResult(
                run=cfg.run,
                evaluator=evaluator_name,
                version=event.version,
                metric=metric,
                score=float(score),
                n=len(evaluator.prompts),
                evaluated_at=time.time(),
            )
            await bus.publish(
                subjects.eval_result(cfg.run, evaluator_name), result, msg_id=f"eval-{evaluator_name}-v{event.version}"
            )

        await bus.consume(
            streams.EXPORTS(cfg.run),
            f"eval-{evaluator_name}",
            m.ExportDone,
            on_export,
            batch=1,
            # kept alive while scoring: a killed evaluator's version comes back this soon
            ack_wait_s=streams.ACK_WAIT_S,
        )
        await stop.wait()
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
