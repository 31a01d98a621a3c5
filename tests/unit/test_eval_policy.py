"""Which versions the evaluator scores, and how long `lorabus up` waits for the missing ones (its
own run's, and the newest export of every run submitted to its fleet)."""

from __future__ import annotations

from services.clients.eval_policy import should_score, still_to_score
from services.config.schema import EvaluatorConfig, LorabusConfig
from services.local.summary import Progress, RunRecord, training_done

FINAL = 10


def test_every_scores_each_version_in_order():
    e = EvaluatorConfig(versions="every")
    assert all(should_score(e, v, newest_exported=FINAL, final=FINAL) for v in range(FINAL + 1))
    assert still_to_score(e, exported=range(6), scored=[0, 1, 2], final=FINAL) == [3, 4, 5]


def test_every_nth_scores_multiples_and_always_the_last():
    e = EvaluatorConfig(versions="every_nth", nth=4)
    assert [v for v in range(FINAL + 1) if should_score(e, v, v, FINAL)] == [0, 4, 8, 10]
    assert still_to_score(e, exported=range(FINAL + 1), scored=[0, 4], final=FINAL) == [8, 10]


def test_newest_skips_versions_with_a_newer_one_waiting():
    e = EvaluatorConfig(versions="newest")
    assert should_score(e, 3, newest_exported=3, final=FINAL)
    assert not should_score(e, 3, newest_exported=5, final=FINAL)
    # behind: only the newest exported is still to come; caught up: nothing
    assert still_to_score(e, exported=range(6), scored=[0, 2], final=FINAL) == [5]
    assert still_to_score(e, exported=range(6), scored=[0, 5], final=FINAL) == []


def cfg_with(**evaluator) -> LorabusConfig:
    return LorabusConfig(total_train_steps=3, evaluator=EvaluatorConfig(**evaluator))


def test_run_ends_at_once_when_every_score_is_in(capsys):
    progress, record = Progress(), RunRecord(exported={v: "" for v in range(4)}, evals={v: 0.5 for v in range(4)})
    assert training_done(cfg_with(), record, progress, evaluate=True, now=100.0)
    assert progress.eval_wait is None and capsys.readouterr().out == ""


def test_missing_scores_are_waited_for_a_bounded_time_and_named(capsys):
    cfg = cfg_with(max_wait_s=30.0)
    progress, record = Progress(), RunRecord(exported={v: "" for v in range(4)}, evals={0: 0.4})
    assert not training_done(cfg, record, progress, evaluate=True, now=100.0)
    first = capsys.readouterr().out
    assert "training done, waiting for the evaluator: 3 version(s) to score (v1, v2, v3)" in first
    record.evals[1] = 0.45
    assert not training_done(cfg, record, progress, evaluate=True, now=120.0)
    assert progress.eval_wait is not None
    assert "2 version(s) to score (v2, v3); 20s of at most 30s" in progress.eval_wait.line(now=120.0)
    assert "waiting for the evaluator: 2 version(s)" in progress.line()
    assert training_done(cfg, record, progress, evaluate=True, now=130.0)
    assert "stopped waiting for the evaluator after 30s (evaluator.max_wait_s); 2 version(s) unscored: v2, v3" in (
        capsys.readouterr().out
    )
    assert progress.eval_wait.waited_s == 30.0


def test_without_an_evaluator_nothing_is_waited_for():
    progress, record = Progress(), RunRecord(exported={v: "" for v in range(4)})
    assert training_done(cfg_with(), record, progress, evaluate=False, now=0.0)


def test_a_run_is_finished_only_when_its_last_version_is_exported_and_scored():
    cfg = cfg_with()
    assert not RunRecord(exported={0: "", 1: ""}).finished(cfg, evaluate=False)
    record = RunRecord(exported={v: "" for v in range(4)}, evals={0: 0.4})
    assert record.finished(cfg, evaluate=False) and not record.finished(cfg, evaluate=True)


def test_a_submitted_runs_last_score_is_waited_for_alike(capsys):
    cfg = cfg_with(max_wait_s=30.0)
    progress, record = Progress(), RunRecord(exported={v: "" for v in range(4)}, evals={v: 0.5 for v in range(4)})
    idle = {"head": -1, "exported": -1, "scored": -1}  # submitted, nothing exported yet: nothing owed
    progress.others = {"r4": {"head": 5, "exported": 5, "scored": 3}, "idle": idle}
    progress.other_finals = {"r4": 5}
    assert not training_done(cfg, record, progress, evaluate=True, now=100.0)
    assert "waiting for the evaluator: 1 version(s) to score (r4 v5)" in capsys.readouterr().out
    progress.others["r4"]["scored"] = 5
    assert training_done(cfg, record, progress, evaluate=True, now=101.0)
    assert progress.eval_wait is not None and progress.eval_wait.others == []


def test_a_submitted_runs_wait_is_bounded_too_and_its_unscored_version_named(capsys):
    cfg = cfg_with(max_wait_s=30.0)
    progress, record = Progress(), RunRecord(exported={v: "" for v in range(4)}, evals={v: 0.5 for v in range(4)})
    progress.others = {"r4": {"head": 5, "exported": 5, "scored": -1}}
    assert not training_done(cfg, record, progress, evaluate=True, now=100.0)
    assert training_done(cfg, record, progress, evaluate=True, now=130.0)
    assert "30s (evaluator.max_wait_s); 1 version(s) unscored: r4 v5" in capsys.readouterr().out
    assert training_done(cfg_with(), record, Progress(others=dict(progress.others)), evaluate=False, now=0.0)


def test_a_version_the_policy_skips_is_not_waited_for():
    # every 4th: a run stopped at v5 gets no score for it (v5 is not its last, v10 would be)
    progress = Progress(others={"r4": {"head": 5, "exported": 5, "scored": 4}}, other_finals={"r4": 10})
    assert progress.others_unscored(EvaluatorConfig(versions="every_nth", nth=4)) == []
    assert progress.others_unscored(EvaluatorConfig(versions="every")) == ["r4 v5"]
