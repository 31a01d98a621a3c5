"""The long-rollout GPU task (scripts/make_chain_task.py): every worked solution earns the
reward its final answer names, a wrong total earns nothing, the splits are disjoint and each
operand count is equally common; sync_async's targets for it come from the runs."""

from __future__ import annotations

from collections import Counter

from benchmarks.sync_async import relative_targets
from scripts.make_chain_task import MAX_NEW_TOKENS, examples, operands_of, solution, splits
from scripts.make_tiny_task import build_tokenizer
from services.common.rewards import numeric_final_answer


def test_worked_solutions_earn_their_reward_and_fit_the_rollout():
    train, valid = splits()
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in valid}
    assert Counter(len(operands_of(p)) for p in valid) == {2: 125, 3: 125, 4: 125, 5: 125}
    for p in valid:
        worked = solution(operands_of(p))
        assert numeric_final_answer(p.text, worked, p.answer) == 1.0
        wrong = worked.rsplit("####", 1)[0] + f"####{int(p.answer) + 1}"
        assert numeric_final_answer(p.text, wrong, p.answer) == 0.0
    lengths = [len(target) for _, target in examples(build_tokenizer(), valid)]
    assert 18 <= min(lengths) and max(lengths) <= MAX_NEW_TOKENS


def test_a_solution_writes_each_partial_sum():
    assert solution([123, 456, 789]) == "123+456=579;579+789=1368;####1368"


def test_targets_from_the_runs_lie_between_v0_and_the_synchronous_final():
    runs = [
        {"k": 0, "v0_score": 0.3, "final_score": 0.5},
        {"k": 0, "v0_score": 0.3, "final_score": 0.7},
        {"k": 2, "v0_score": 0.3, "final_score": 0.9},
    ]
    assert relative_targets(runs) == [0.45, 0.525, 0.57]
