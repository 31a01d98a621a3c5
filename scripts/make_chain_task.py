"""Build the long-rollout GPU task: sums of 2-5 three-digit numbers, worked one addition at a time.

arith3's answers are 3-4 tokens, so its rollouts are 8 % of an RL step and asynchrony has
nothing to hide (README, "Synchronous vs asynchronous"). Here the model writes each partial sum
before the answer, `123+456+789=` -> `123+456=579;579+789=1368;####1368`: 18-64 new tokens by the
number of operands, so generation is most of a step, and a synchronous round waits for its
longest rollout while an asynchronous one does not (the long tail AReaL's 2.77x comes from).
The reward is the number after `####` (`numeric_final_answer`, GSM8K's convention): the steps
earn nothing themselves.

Writes `--out` (default examples/chain/):
  data/train.jsonl, data/valid.jsonl   the prompts with their final answers, disjoint splits
                                       (500 held-out prompts), operand counts 2-5 equally often
  model/                               the arith3 maker's Llama (hidden 768, 12 layers),
                                       pre-trained on the worked solutions until its greedy
                                       held-out accuracy first reaches --target
  pretrain_metrics.json                what the stop looked like

Deterministic as scripts/make_arith3_task.py is; run from the repo root:
  python scripts/make_chain_task.py                     # CUDA
  python scripts/make_chain_task.py --data-only         # the data alone (CPU, seconds)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.make_arith3_task import arguments, make_model, write_data
from services.common.data import Prompt
from services.common.models import encode_prompt
from services.common.rewards import numeric_final_answer

SEED = 5321
OPERANDS = (2, 3, 4, 5)
MAX_OPERAND = 999
VALID = 500
TRAIN = 60_000
MAX_NEW_TOKENS = 80
"""the longest worked solution (five operands) is 64 tokens with its eos"""


def solution(operands: list[int]) -> str:
    """The worked answer: each partial sum written out, then `####` and the total."""
    steps, total = [], operands[0]
    for x in operands[1:]:
        steps.append(f"{total}+{x}={total + x};")
        total += x
    return "".join(steps) + f"####{total}"


def problem(operands: list[int]) -> Prompt:
    return Prompt(
        prompt_id="sum-" + "-".join(map(str, operands)),
        text="+".join(map(str, operands)) + "=",
        answer=str(sum(operands)),
    )


def splits() -> tuple[list[Prompt], list[Prompt]]:
    """Disjoint seeded samples, each operand count equally often (repeats rejected)."""
    rng = random.Random(SEED)
    seen: set[str] = set()
    out: list[Prompt] = []
    while len(out) < VALID + TRAIN:
        operands = [rng.randint(0, MAX_OPERAND) for _ in range(OPERANDS[len(out) % len(OPERANDS)])]
        p = problem(operands)
        if p.prompt_id not in seen:
            seen.add(p.prompt_id)
            out.append(p)
    return out[VALID:], out[:VALID]


def operands_of(p: Prompt) -> list[int]:
    return [int(x) for x in p.text.rstrip("=").split("+")]


def examples(tok, prompts: list[Prompt]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, worked solution ids + eos) of each prompt: the loss is on the second part."""
    out = []
    for p in prompts:
        worked = tok.encode(solution(operands_of(p)), add_special_tokens=False)
        out.append((encode_prompt(tok, p.text), [*worked, tok.eos_token_id]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__ or "", ROOT / "examples" / "chain").parse_args(argv)
    train, valid = splits()
    write_data(args.out, train, valid)
    if not args.data_only:
        make_model(
            args,
            lambda tok: examples(tok, train),
            valid,
            max_positions=128,
            max_new_tokens=MAX_NEW_TOKENS,
            reward=numeric_final_answer,
            well_formed=lambda text: "####" in text,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
