"""What the run summary and the progress line say each replica serves (`summary.Serving`): a
version withdrawn after its canary failed, or given up, is no longer counted as served."""

from __future__ import annotations

from proto import messages as m
from services.local.summary import Progress, Serving


def loaded(replica: str, version: int) -> m.AdapterLoaded:
    return m.AdapterLoaded(run="r", replica=replica, version=version, via="object", load_seconds=0.05, loaded_at=1.0)


def failed(replica: str, version: int, will_retry: bool) -> m.AdapterFailed:
    return m.AdapterFailed(run="r", replica=replica, version=version, reason="CanaryFailed: gap", attempt=1,
                           will_retry=will_retry, failed_at=2.0)  # fmt: skip


def test_a_withdrawn_version_is_not_served():
    s = Serving()
    for report in (loaded("a", 0), loaded("a", 1), loaded("b", 0), loaded("b", 1), loaded("a", 2)):
        s.observe(report)
    s.observe(failed("a", 2, will_retry=False))  # its canary failed after it was marked loaded
    s.observe(failed("b", 1, will_retry=True))  # a background check failed: loaded again verify-first
    assert s.newest() == {"a": 1, "b": 1}
    s.observe(failed("b", 0, will_retry=False))
    s.observe(failed("b", 1, will_retry=False))
    assert s.newest() == {"a": 1, "b": -1}


def test_the_progress_line_names_what_each_replica_serves():
    p = Progress()
    for report in (loaded("rollout-0", 0), loaded("rollout-0", 1), failed("rollout-0", 1, will_retry=False)):
        p.serving.observe(report)
    assert "replicas rollout-0:v0" in p.line()
