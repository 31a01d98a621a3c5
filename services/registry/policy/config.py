"""The policy's whole view of the configuration: a small frozen `PolicyConfig`.

The registry narrows its `LorabusConfig` to this at its door (`fleet.policy_config`); nothing
in the policy sees the rest of the config, and a journal snapshot stores exactly this, so a
replay decides under the config its entries were decided under.
"""

from __future__ import annotations

from msgspec import Struct


class PolicyConfig(Struct, frozen=True, kw_only=True):
    max_head_offpolicyness: int
    """k: the most versions a sample may lag the head"""
    consumer_batch_size: int
    """B: groups per trainer step"""
    max_concurrent_rollouts: int
    lease_seconds: float
    seen_limit: int = 256
    """trajectory ids remembered for idempotent duplicates (see `policy.decisions`)"""
    retry_after_s: float = 0.25
    silent_after_s: float | None = None
    """a replica not heard from (report or admission request) for this long loses its grants
    (`release_silent`); None: only the lease frees them"""

    def __post_init__(self) -> None:
        checks = [
            ("rollout.max_head_offpolicyness", self.max_head_offpolicyness >= 0, ">= 0"),
            ("rollout.consumer_batch_size", self.consumer_batch_size >= 1, ">= 1"),
            ("rollout.max_concurrent_rollouts", self.max_concurrent_rollouts >= 1, ">= 1"),
            ("rollout.lease_seconds", self.lease_seconds > 0, "> 0"),
            ("seen_limit", self.seen_limit >= 1, ">= 1"),
            ("retry_after_s", self.retry_after_s >= 0, ">= 0"),
            ("silent_after_s", self.silent_after_s is None or self.silent_after_s > 0, "> 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name}: must be {rule}")


SILENT_HEARTBEATS = 4
"""heartbeat periods a replica may miss before its grants are freed: one lost or late heartbeat
is not a death, four in a row are (a stopped or killed process)"""


def seen_limit_for(max_concurrent: int) -> int:
    """Duplicates come from redelivery after a crash (at most the un-acked in-flight messages)
    and from rollouts resending recent work, so a few times the concurrency is plenty; every
    snapshot of the ledger carries them, so remembering more costs on every snapshot."""
    return max(256, 8 * max_concurrent)
