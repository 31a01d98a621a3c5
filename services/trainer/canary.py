"""The trainer's half of the load canary: what a version must answer on a few fixed prompts.

`prompts` draws the fixed prompts once per run (seeded token ids inside the vocabulary, the same
for every version). `reference` decodes each greedily under the adapter with the model the
caller hands it (the base with the version's adapter applied, in the serving dtype) and records
each continuation token's log-probability at temperature 1: the `Canary` published with the
version, that every replica checks its load against (`services.rollout.canary`).

Invariant: the reference is computed from the trainer's own weights in the dtype the replicas
serve, never from what a replica loaded; equal weights give equal canaries.
"""

from __future__ import annotations

import torch

from proto.messages import Canary, CanarySequence, Dtype

N_PROMPTS = 4
PROMPT_TOKENS = 8
CONTINUATION_TOKENS = 8


def prompts(vocab_size: int, seed: int, n: int = N_PROMPTS, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """The run's fixed canary prompts (token ids 1..vocab_size-1: no padding id)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size: {vocab_size} leaves no token for a canary prompt; it must be >= 2")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (n, length), generator=gen).tolist()


@torch.no_grad()
def reference(model: torch.nn.Module, prompt_ids: list[list[int]], dtype: Dtype,
              n_tokens: int = CONTINUATION_TOKENS) -> Canary:  # fmt: skip
    """Greedy continuations of `prompt_ids` under `model` (a causal LM returning `.logits`, its
    adapter applied, already in `dtype`), each token's temperature-1 logprob beside it."""
    device = next(model.parameters()).device
    sequences = []
    for prompt in prompt_ids:
        ids = torch.tensor([prompt], device=device)
        tokens, logprobs = [], []
        for _ in range(n_tokens):
            logits = model(input_ids=ids).logits[0, -1].float()
            lp = logits.log_softmax(-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(min(0.0, float(lp[token])))
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        sequences.append(CanarySequence(prompt_token_ids=list(prompt), token_ids=tokens, logprobs=logprobs))
    return Canary(dtype=dtype, sequences=sequences)
