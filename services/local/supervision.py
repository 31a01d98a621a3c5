"""The restart policy of `lorabus up`: which dead process comes back, when, and when to give up.

Pure bookkeeping (the launcher passes `now`), so the rule is testable without processes. Every
service resumes where it stopped (durable consumers, the registry's journal, the trainer's
checkpoint), so a death is answered by a restart, never by ending the run: after a backoff that
doubles from `base_s` up to `max_s`, within a budget of `budget` restarts per `window_s`. Only a
process that keeps dying faster than that is given up on, which is what ends the run. The same
policy is written for compose in deploy/docker-compose.yml (`restart: on-failure`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    base_s: float = 1.0
    """delay before the first restart; doubled for each further restart inside the window"""
    max_s: float = 30.0
    budget: int = 5
    """restarts allowed per process inside `window_s`; one more death ends the run"""
    window_s: float = 600.0
    """restarts older than this no longer count: a process that dies once an hour is not given up on"""


@dataclass
class Restarts:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    done: dict[str, list[float]] = field(default_factory=dict)
    """name -> when each restart happened"""
    due: dict[str, float] = field(default_factory=dict)
    """name -> when its pending restart may happen"""

    def recent(self, name: str, now: float) -> int:
        return sum(1 for t in self.done.get(name, []) if now - t < self.policy.window_s)

    def on_death(self, name: str, now: float) -> float | None:
        """Schedule the restart of `name`, which was just found dead: the delay, or None when
        its budget is spent. Idempotent while a restart is pending."""
        if name in self.due:
            return self.due[name] - now
        n = self.recent(name, now)
        if n >= self.policy.budget:
            return None
        delay = min(self.policy.max_s, self.policy.base_s * 2**n)
        self.due[name] = now + delay
        return delay

    def ready(self, name: str, now: float) -> bool:
        """Whether the pending restart of `name` may happen now; it counts from here on."""
        at = self.due.get(name)
        if at is None or now < at:
            return False
        del self.due[name]
        self.done.setdefault(name, []).append(now)
        return True

    def counts(self) -> dict[str, int]:
        return {name: len(times) for name, times in sorted(self.done.items())}


def describe_exit(returncode: int | None) -> str:
    """`exit 1`, `killed by SIGKILL`: how a process ended, in words."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"
