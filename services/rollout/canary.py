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

Invariant: nothing a version generated on this replica is published before its gap is measured
within its dtype's tolerance (`TOLERANCE`, the looser of the trainer's and the replica's dtype).
A version beyond it never has its output published: the follower withdraws it at once (no grant
pins it again), unloads it once unpinned, reports AdapterFailed with the figures and never loads
it again; the versions that passed stay served.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.messages import Canary, CanarySequence, Dtype
from services.rollout.engines.base import Engine, GenRequest, GenResult

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
