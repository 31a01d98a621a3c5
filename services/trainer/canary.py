"""The trainer's half of the load canary: what a version must answer on a few fixed prompts.

`prompts` draws the fixed prompts once per run (seeded token ids inside the vocabulary, the same
for every version). `reference` decodes each greedily under the adapter with the model the
caller hands it (the base with the version's adapter applied, in the serving dtype) and records
each continuation token's log-probability at temperature 1: the `Canary` published with the
version, that every replica checks its load against (`services.rollout.canary`).

The trainer computes it in each step, after the update, from the model it trains (`timed`:
in a thread beside the upload or broadcast and the announcement in one process, `beside`; for
every run of a fleet's joint step in one decode, each run's rows through its own adapter,
`beside_together`; in `ranks.run_step` over several ranks, where it is a collective; the first
version's at start),
and publishes it as its own message after the version's AdapterReady, which says it follows
(`publish.publish_canary`), on either path (object store or XCCL): the announcement never
waits for it.

Invariant: the reference is computed from the trainer's own weights in the dtype the replicas
serve, never from what a replica loaded; equal weights give equal canaries.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import time
from collections.abc import Iterator, Sequence

import torch

from proto.messages import Canary, CanarySequence, Dtype
from services.trainer.engines.base import CanaryEngine, SharedBaseEngine
from services.trainer.lora import Route

Timed = tuple[Canary | None, float | None]
"""a canary and the seconds it took to compute; (None, None) for an engine that computes none"""

# Its cost is its sequential forwards (the trainer's decode, which the replicas' check waits
# for; the replica's, which the version's first trajectories wait for): many short sequences in one
# batch compare as many tokens as a few long ones for a quarter of the latency. Two tokens
# each, so a replica's decode path (KV cache, its decode kernels) is checked beside its
# prefill; 16 is what the wire allows.
N_PROMPTS = 16
PROMPT_TOKENS = 8
CONTINUATION_TOKENS = 2


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
    adapter applied, already in `dtype`), each token's temperature-1 logprob beside it. Prompts
    of one length are decoded as one batch (the run's prompts are: `n_tokens` forwards in all),
    the tokens after the first from the KV cache where the model keeps one (`_keeps_cache`)."""
    [canary] = references(model, [prompt_ids], [dtype], n_tokens)
    return canary


@torch.no_grad()
def references(
    model: torch.nn.Module,
    prompt_sets: Sequence[list[list[int]]],
    dtypes: Sequence[Dtype],
    n_tokens: int = CONTINUATION_TOKENS,
    route: list[Route] | None = None,
    adapters: Sequence[str] = (),
) -> list[Canary]:
    """`reference` of each prompt set (labelled with its dtype) in the same forwards. With
    `route` (`lora.rows_by_adapter`'s, open around the call) each set's rows go through the
    adapter of the same index in `adapters`: a fleet's joint step checks every run's version in
    `n_tokens` forwards, where one canary per run took `n_tokens` each."""
    device = next(model.parameters()).device
    by_length: dict[int, list[tuple[int, int]]] = {}
    for s, prompts_ in enumerate(prompt_sets):
        for i, prompt in enumerate(prompts_):
            by_length.setdefault(len(prompt), []).append((s, i))
    cached = _keeps_cache(model)
    decoded = []
    for rows in by_length.values():  # each set's rows are contiguous (sets in order): one span each
        if route is not None:
            route[0] = _spans(rows, adapters)
        ids = torch.tensor([prompt_sets[s][i] for s, i in rows], device=device)
        decoded.append(_decode(model, ids, n_tokens, cached))
    # one copy to the host for every token and logprob (float64 holds any token id exactly)
    host = torch.cat(decoded).tolist()
    sequences: list[list[CanarySequence | None]] = [[None] * len(p) for p in prompt_sets]
    for (s, i), row in zip((r for rows in by_length.values() for r in rows), host, strict=True):
        sequences[s][i] = CanarySequence(
            prompt_token_ids=list(prompt_sets[s][i]),
            token_ids=[int(t) for t in row[:n_tokens]],
            logprobs=row[n_tokens:],
        )
    return [
        Canary(dtype=d, sequences=[q for q in seqs if q is not None]) for d, seqs in zip(dtypes, sequences, strict=True)
    ]


def _spans(rows: list[tuple[int, int]], adapters: Sequence[str]) -> Route:
    """The route of a batch of (set, prompt) rows, each set's rows contiguous."""
    spans, lo = [], 0
    for s, n in collections.Counter(s for s, _ in rows).items():  # in the rows' order
        spans.append((adapters[s], lo, lo + n))
        lo += n
    return spans


def _keeps_cache(model: torch.nn.Module) -> bool:
    """Whether `model` may be asked for a KV cache: an HF causal LM (or peft's wrapper, which
    passes keyword arguments on) may; Megatron's `_HFCall` takes `input_ids` alone."""
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _cache_of(out: object) -> dict[str, object]:
    """The KV cache a forward returned, as the keyword that hands it back (transformers 5 names
    it `cache`, 4 `past_key_values`); empty when it returned none."""
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return {name: value}
    return {}


def _decode(model: torch.nn.Module, ids: torch.Tensor, n_tokens: int, cached: bool) -> torch.Tensor:
    """[batch, 2 * n_tokens] float64 on the device: the greedy tokens, then their logprobs."""
    tokens, logprobs = [], []
    past: dict[str, object] = {}
    for _ in range(n_tokens):
        if past:
            out = model(input_ids=ids[:, -1:], use_cache=True, **past)
        elif cached:
            out = model(input_ids=ids, use_cache=True)
        else:
            out = model(input_ids=ids)
        # a model that returns no cache is given the whole sequence again
        past = _cache_of(out) if cached else {}
        lp = out.logits[:, -1].float().log_softmax(-1)
        token = lp.argmax(-1, keepdim=True)
        tokens.append(token[:, 0])
        logprobs.append(lp.gather(-1, token)[:, 0].clamp(max=0.0))
        ids = torch.cat([ids, token], dim=1)
    return torch.cat([torch.stack(tokens, 1).double(), torch.stack(logprobs, 1).double()], dim=1)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """`model` and each of its modules in eval mode (dropout off, the KV cache on under
    gradient checkpointing) for the block, then each back in its own mode.

    The flag is set in each module's `__dict__`, where `nn.Module.__setattr__` (which `.eval()`
    and `.train()` go through) would store it: that costs ~2.5 us a module, ~10 ms a canary on a
    1.5B model with all-linear LoRA (2,300 modules), and the canary holds the shared model."""
    modules = list(model.modules())
    modes = [m.training for m in modules]
    for m in modules:
        m.__dict__["training"] = False
    try:
        yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.__dict__["training"] = mode


def computes(engine: object) -> bool:
    """Whether `engine` computes canaries (`CanaryEngine`): its events say `canary_follows`."""
    return isinstance(engine, CanaryEngine)


def timed(engine: object) -> Timed:
    """(the canary of the adapter `engine` holds now, seconds it took); (None, None) for an
    engine that computes none (`CanaryEngine`): its versions are then served unchecked.
    A collective under FSDP2: every rank calls it at the same point."""
    if not isinstance(engine, CanaryEngine):
        return None, None
    t0 = time.perf_counter()
    canary = engine.canary()
    return canary, time.perf_counter() - t0


def beside(engine: object) -> asyncio.Future[Timed]:
    """A one-process trainer's `timed` canary, computed in a thread while the version is stored
    or broadcast and announced; the caller holds the model until it is done (it reads the
    model with this run's adapter active) and publishes it after the event."""
    return asyncio.ensure_future(asyncio.to_thread(timed, engine))


def timed_together(engines: Sequence[object]) -> list[Timed]:
    """`timed` for each of `engines`, runs on one shared model that has just stepped together:
    one joint decode (`SharedBaseEngine.canary_together`), its seconds each run's; one after
    another for engines that share no base."""
    lead = engines[0]
    if not isinstance(lead, SharedBaseEngine):
        return [timed(e) for e in engines]
    t0 = time.perf_counter()
    canaries = lead.canary_together(list(engines))
    seconds = time.perf_counter() - t0
    return [(c, seconds) for c in canaries]


def beside_together(engines: Sequence[object]) -> list[asyncio.Future[Timed]]:
    """`beside` for the runs of a joint step: one thread computes them all (`timed_together`);
    a future per engine, in order."""
    together = asyncio.ensure_future(asyncio.to_thread(timed_together, engines))

    async def nth(i: int) -> Timed:
        return (await together)[i]

    return [asyncio.ensure_future(nth(i)) for i in range(len(engines))]
