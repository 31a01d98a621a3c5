"""Reward functions: `fn(prompt, completion, answer) -> float`, named as `package.module:fn`.

`completion` is the text `services.common.models.decode_completion` gives: cut at the first
eos, special tokens dropped. Rewards are pure functions of their three strings, so a trainer,
a rollout and an evaluator compute the same number for the same sample.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[str, str, str], float]

_INTEGER = re.compile(r"^-?\d+$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(ValueError):
    pass


def load_reward_fn(spec: str) -> RewardFn:
    """`"services.common.rewards:arith_reward"` -> the function."""
    module_name, sep, attr = (spec or "").partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(
            f"reward_fn: {spec!r} must be 'package.module:function', e.g. 'services.common.rewards:arith_reward'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RewardError(
            f"reward_fn: module {module_name!r} cannot be imported ({exc}); check the name and that it is on PYTHONPATH"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward_fn: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(
            f"reward_fn: {spec!r} is a {type(fn).__name__}, not a function of (prompt, completion, answer)"
        )
    return fn


def arith_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion is exactly the answer (an integer, surrounding whitespace
    allowed), else 0.0. No credit for format alone: the shipped model already has the format,
    so such credit would only shrink the signal RL learns from."""
    del prompt
    text = completion.strip()
    if not _INTEGER.match(text):
        return 0.0
    return 1.0 if int(text) == int(answer.strip()) else 0.0


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def extract_final_number(text: str) -> float | None:
    """GSM8K convention: the number after the last `####` if there is one, else the last
    number in the text. Commas are thousands separators."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return _to_number(found[0]) if found else None
    found = _NUMBER.findall(text)
    return _to_number(found[-1]) if found else None


def numeric_final_answer(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the answer's numerically, else 0.0."""
    del prompt
    got = extract_final_number(completion)
    want = extract_final_number(answer)
    if want is None:
        raise RewardError(f"answer: {answer!r:.80} contains no number to compare against")
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9) else 0.0


class _NoTimeoutNotice(logging.Filter):
    """math-verify warns on every call that its timeout is off; it is off on purpose here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:
        raise RewardError(
            "reward_fn: math_answer needs the math-verify library (pip install math-verify, or lorabus's `data` extra)"
        ) from None
    for name in ("math_verify.parser", "math_verify.grader", "math_verify"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutNotice) for f in logger.filters):
            logger.addFilter(_NoTimeoutNotice())
    return math_verify


def math_answer(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is mathematically equal to `answer`, else 0.0,
    as math-verify (Hugging Face's maintained verifier, the one AReaL's GSM8K reward uses) reads
    it: `\\boxed{}` first, then LaTeX or plain expressions; fractions, decimals, thousands
    separators, signs and units around the number are understood.

    Where the completion writes GSM8K's `#### N`, only the text after the last `####` is read:
    AReaL's reward gives 0 for a bare `####72` (math-verify finds no number glued to the marker)
    and reads a number that follows the marked answer (`#### 72 ... 3 apples`) as the answer.
    A dollar sign escaped as LaTeX writes it in running text (`\\$18`) is read as `$18`;
    math-verify (and so AReaL) finds no number there.
    No timeout is armed: math-verify's own uses SIGALRM, which works in the main thread only
    (AReaL turns it off for the same reason)."""
    del prompt
    mv = _math_verify()
    gold = mv.parse(answer, parsing_timeout=None)
    if not gold:
        raise RewardError(f"answer: {answer!r:.80} holds no answer math-verify can read")
    if "####" in completion:
        completion = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    completion = completion.replace("\\$", "$")
    pred = mv.parse(completion, parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=None) else 0.0
