"""The canary a replica runs on every load, while the version serves and before any of its output
is published.

The trainer publishes with each version a few fixed prompts, its greedy continuation of each
under that adapter, and each continuation token's log-probability (temperature 1, in the serving
dtype: `proto.messages.Canary`). After a loader put the version into the engine, the replica
decodes the same prompts greedily under the version's name (`score`, through the engine's own
`generate`, so it works the same for the embedded engine and the servers) and compares
(`gap`): token by token, the replica's logprob of its own greedy token against the trainer's of
its token. Where the two pick different tokens, a healthy engine is at a near-tie (the two
tokens' logprobs are close); a base model answering under the adapter's name, an adapter loaded
with the wrong scale or targets, or a corrupted tensor moves the logprobs by far more.

The version is marked loaded as soon as it is in the engine and generates while its canary is
decoded beside it (`adapters.AdapterFollower`): the canary costs the run only what publication
waits for it (`AdapterFollower.trusted`), not the version's time to servable.

Where the event says `canary_follows` (the trainer announces without waiting for its canary),
the check first obtains it (`obtain`): the AdapterCanary of the version, read from the CANARIES
stream, waited for up to rollout.canary_wait_s, and refused unless it names the event's run,
trainer epoch, version and adapter sha256 (`binding_problem`). One that does not come, does
not decode or does not match fails the check as a gap beyond tolerance does.

Invariant: nothing a version generated on this replica is published before its gap is measured,
against a canary bound to the version's event, within its dtype's tolerance (`TOLERANCE`, the
looser of the trainer's and the replica's dtype). A version beyond it never has its output
published: the follower withdraws it at once (no grant pins it again), unloads it once unpinned,
reports AdapterFailed with the figures and never loads it again; the versions that passed stay
served.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proto import codec, subjects
from proto.messages import AdapterCanary, AdapterReady, Canary, CanarySequence, Dtype
from services.common import streams
from services.rollout.engines.base import Engine, GenRequest, GenResult

if TYPE_CHECKING:
    from services.common.bus import Bus

TOLERANCE: dict[Dtype, float] = {"float32": 2e-3, "float16": 0.05, "bfloat16": 0.15}
"""largest |Δ logprob| a healthy engine shows against the trainer in each dtype (float32: the
kernels' summation order; half precision: one rounding of the logits, 2**-8 relative for bf16,
on logits of a few units)"""


class CanaryFailed(RuntimeError):
    """The loaded version does not answer as the trainer's adapter does."""


@dataclass(frozen=True)
class Gap:
    """The largest disagreement over a canary's sequences, and where it is."""

    value: float
    sequence: int
    token: int
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.value <= self.tolerance

    def describe(self, n_sequences: int) -> str:
        return (
            f"canary gap {self.value:.4g} > tolerance {self.tolerance:g} at sequence {self.sequence} "
            f"token {self.token} (largest |Δ logprob| over {n_sequences} sequences)"
        )


def tolerance(canary: Canary, serving: Dtype | None = None) -> float:
    """The looser of the trainer's dtype and the replica's own (`serving`, rollout.dtype): a
    bf16 replica of a float32 trainer rounds its logits as bf16 does."""
    return max(TOLERANCE[canary.dtype], TOLERANCE[serving] if serving is not None else 0.0)


def gap(canary: Canary, results: list[GenResult], serving: Dtype | None = None) -> Gap:
    """The replica's greedy `results` (one per canary sequence) against the trainer's; the
    replica serves in `serving` (None: the canary's dtype)."""
    if len(results) != len(canary.sequences):
        raise ValueError(f"results: {len(results)} for {len(canary.sequences)} canary sequences; one each")
    worst = Gap(0.0, 0, 0, tolerance(canary, serving))
    for i, (seq, got) in enumerate(zip(canary.sequences, results)):
        for j, (want_id, want_lp) in enumerate(zip(seq.token_ids, seq.logprobs)):
            if j >= len(got.token_ids):
                if got.finish_reason == "stop":
                    # it agreed on every token up to an end token, where a server stops and the
                    # trainer's reference (which knows no end tokens) goes on: nothing to compare
                    break
                # it stopped short otherwise (aborted): no answer is not the trainer's answer
                return Gap(float("inf"), i, j, worst.tolerance)
            diff = abs(got.logprobs[j] - want_lp)
            if diff > worst.value:
                worst = Gap(diff, i, j, worst.tolerance)
            if got.token_ids[j] != want_id:
                break  # a near-tie or a fault, measured above; the rest conditions on other tokens
    return worst


def requests(sequences: list[CanarySequence]) -> list[GenRequest]:
    return [
        GenRequest(prompt_token_ids=s.prompt_token_ids, n=1, max_new_tokens=len(s.token_ids), temperature=0.0, seed=0)
        for s in sequences
    ]


async def score(engine: Engine, version: int, canary: Canary, serving: Dtype | None = None) -> Gap:
    """Decode the canary's prompts under `version` (already loaded) and measure the gap."""
    outs = await engine.generate(requests(canary.sequences), version)
    return gap(canary, [o[0] for o in outs], serving)


# --- the canary that follows its event ---------------------------------------------------------

WITHDRAWN = (
    "withdrawn on this replica (nothing it generated is published), which keeps serving the versions that passed"
)


def expected(ev: AdapterReady) -> bool:
    """Whether `ev`'s version is checked: its canary rides on the event, or follows it."""
    return ev.canary is not None or ev.canary_follows


def binding_problem(ev: AdapterReady, msg: AdapterCanary) -> str | None:
    """Why `msg` is not the canary of the version `ev` announced (another run, trainer epoch,
    version or adapter bytes), or None."""
    obj = ev.object_payload()
    sha = obj.sha256 if obj is not None else None
    for field, got, want in (
        ("run", msg.run, ev.run),
        ("trainer_epoch", msg.trainer_epoch, ev.trainer_epoch),
        ("version", msg.version, ev.version),
        ("adapter_sha256", msg.adapter_sha256, sha),
    ):
        if got != want:
            return f"{field}: {got!r} is not the event's {want!r}"
    return None


async def obtain(bus: Bus, ev: AdapterReady, wait_s: float, orphaned: asyncio.Future[str] | None = None) -> Canary:
    """The canary to check `ev`'s version against: the event's own, or the AdapterCanary that
    follows it, waited for up to `wait_s`, or until `orphaned` says it never can come (then the
    stream is read once more: what its trainer stored before it went still counts). Raises
    `CanaryFailed` saying why there is none to trust (it never came, can never come, does not
    decode, or is another version's or other weights')."""
    if ev.canary is not None:
        return ev.canary
    if not ev.canary_follows:
        raise ValueError(f"{ev.adapter_name}: its event carries no canary and says none follows")
    subject = subjects.adapter_canary(ev.run, ev.version)
    stream = streams.CANARIES(ev.run)
    waiting = asyncio.ensure_future(bus.wait_last(stream, AdapterCanary, subject, timeout=wait_s))
    try:
        # `orphaned` is the follower's: waited on, never cancelled here
        either: list[asyncio.Future[Any]] = [waiting] if orphaned is None else [waiting, orphaned]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done() or orphaned is None:
            msg = await waiting
        else:
            waiting.cancel()
            msg = await bus.last(stream, AdapterCanary, subject)
            if msg is None:
                raise CanaryFailed(f"{ev.adapter_name}: {orphaned.result()}; {WITHDRAWN}")
    except codec.DecodeError as exc:
        raise CanaryFailed(f"{ev.adapter_name}: the canary on {subject} does not decode ({exc}); {WITHDRAWN}") from exc
    finally:
        waiting.cancel()
    if msg is None:
        raise CanaryFailed(
            f"{ev.adapter_name}: its event says a canary follows, but none came on {subject} within "
            f"rollout.canary_wait_s {wait_s:g} s (did the trainer stop before sending it?); {WITHDRAWN}"
        )
    if (problem := binding_problem(ev, msg)) is not None:
        raise CanaryFailed(f"{ev.adapter_name}: the canary on {subject} is not this event's ({problem}); {WITHDRAWN}")
    return msg.canary
