"""`docker compose up` for real: deploy/docker-compose.cpu.yml runs the tiny task end to end in
containers on a real Docker engine, with images built from this checkout (deploy/localimages.py).

The commands are the README's: `python deploy/localimages.py`, then `docker compose -f
deploy/docker-compose.cpu.yml up -d`, then `down -v`. The test follows the run from the host
as the `operator` NATS user (live events only; NATS published on 127.0.0.1), reads the bucket
with the S3 keys and asks Prometheus for its targets, as an operator of the deployment would.

What is asserted, and why it cannot pass by chance:
- The trainer container exits 0 after `STEPS` steps, every version is exported into the S3
  bucket (listed there, not taken from the events), and the evaluator container published a
  held-out score for each.
- The held-out evaluator decodes greedily: a version's score is a deterministic function of its
  adapter. v0 is the untrained adapter, i.e. the base model (37.6 % on the 500 held-out prompts,
  examples/tiny/README.md); the best of the last three versions must beat it by MARGIN. The
  set is fixed, so there is no sampling noise in the score: a rise means training changed the
  model's answers for the better on problems it never saw (`lorabus up` on the same task:
  0.376 -> 0.434 in 10 steps).
- No accepted trajectory was staler than the budget k.
- Prometheus scraped every lorabus service of the file (each target up at least once).
- `docker compose down -v` leaves no container, volume or network of the project.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.local.ports import free_ports
from tests.deploy.compose import CPU_COMPOSE_FILE, Project, env_file_with_fresh_secrets
from tests.deploy.deployment import (
    exported_versions,
    observe,
    operator_config,
    tear_down,
    wait_for_end,
    wait_for_scrape,
)

STEPS = 10
MARGIN = 0.03
# service -> metrics port, as docker-compose.cpu.yml sets them (metrics.port=)
SCRAPED = {
    "registry": 9101,
    "trainer": 9102,
    "exporter": 9103,
    "evaluator": 9106,
    "rollout-cpu-0": 9107,
    "rollout-cpu-1": 9108,
}

pytestmark = [
    pytest.mark.timeout(1800),
]


async def test_cpu_profile_runs_the_tiny_task_end_to_end(tmp_path, monkeypatch, cpu_images):
    nats_port, s3_port, prometheus_port = free_ports(3)
    env = env_file_with_fresh_secrets(
        tmp_path / ".env",
        NATS_PORT=nats_port,
        S3_PORT=s3_port,
        PROMETHEUS_PORT=prometheus_port,
        LORABUS_CPU_TOTAL_STEPS=STEPS,
        LORABUS_TRIAL=f"t{uuid.uuid4().hex[:6]}",
    )
    project = Project(f"lorabus-cpu-{uuid.uuid4().hex[:8]}", [CPU_COMPOSE_FILE], tmp_path / ".env")
    cfg = operator_config(env, monkeypatch)
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    bus = None
    try:
        # NATS first, so that the operator sees every event from v0 on
        await asyncio.to_thread(project.up, "nats")
        bus, seen = await observe(cfg)
        # the rollouts last: until they deliver, the trainer waits at v0, so Prometheus sees it
        # before it finishes (on a quiet machine ten steps take seconds)
        others = [s for s in SCRAPED if not s.startswith("rollout-")] + ["prometheus"]
        await asyncio.to_thread(project.up, *others, wait=False)
        await wait_for_scrape(prometheus, {f"{s}:{SCRAPED[s]}" for s in others if s in SCRAPED})
        await asyncio.to_thread(project.up, wait=False)
        await wait_for_end(project, seen, STEPS, 1200, evaluated=True)
        print(seen.line())
        print(f"held-out by version: {dict(sorted(seen.evals.items()))}")

        exported = await asyncio.to_thread(exported_versions, env, cfg.run)
        for version in range(STEPS + 1):
            assert {"adapter_config.json", "adapter_model.safetensors"} <= exported.get(version, set()), (
                f"v{version} is not in the bucket: {exported}"
            )
            assert seen.exported[version].startswith(f"s3://{env['MINIO_BUCKET']}/export/{cfg.run}/")

        evals = seen.evals
        assert set(range(STEPS + 1)) <= set(evals), f"versions not evaluated: {evals}"
        best_late = max(evals[v] for v in (STEPS - 2, STEPS - 1, STEPS))
        assert best_late >= evals[0] + MARGIN, f"held-out score did not rise: {evals}"
        assert seen.steps == STEPS
        assert seen.verdicts.get("accepted", 0) >= STEPS * cfg.rollout.consumer_batch_size
        assert seen.max_accepted_staleness <= cfg.rollout.max_head_offpolicyness
        assert {"cpu-0", "cpu-1"} <= set(seen.loaded), seen.loaded

        # the rollouts are still up; on a loaded machine one may not have had its first scrape yet
        await wait_for_scrape(prometheus, {f"{service}:{port}" for service, port in SCRAPED.items()}, timeout_s=60)
    finally:
        left = await tear_down(bus, [project], tmp_path)
    assert not left, f"`down -v` left {left}"
