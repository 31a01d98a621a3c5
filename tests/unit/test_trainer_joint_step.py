"""Several runs' batches in one step (`fsdp2_step`, `ranks.run_steps`, `runs.train_together`):
each run's update equals its solo step's, with different ranks, targets, temperatures,
minibatches, micro-batch budgets and refusals; the adapters' trainable flags come back; a
failure before any update is found run by run, one after an update is every run's; each run
publishes, checkpoints and acks its own version."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import pytest
import torch

from proto.messages import Completion, Trajectory
from services.trainer import lora, ranks, runs
from services.trainer.engines.base import JointStepFailed
from services.trainer.engines.fsdp2 import FSDP2Engine
from tests.fixtures.tiny import tiny_qwen2
from tests.unit.test_canary_follows import event
from tests.unit.test_trainer_siblings import config

CONFIGS = [
    config("a", 8, ["all-linear"]),
    config("b", 4, ["q_proj", "v_proj"], temperature=0.7, ppo={"ppo_n_minibatches": 2}),
    config("c", 2, ["down_proj"], mb_spec_max_tokens=16, optimizer={"lr": 0.02, "type": "sgd"}),
]


def fleet(configs=CONFIGS, **base) -> list[FSDP2Engine]:
    first = FSDP2Engine(configs[0], base=tiny_qwen2(), **base)
    return [first] + [first.sibling(c, c.run) for c in configs[1:]]


def batch(run: str, seed: int, *, logprob: float = -4.5, far: int | None = None) -> list[Trajectory]:
    """Two groups of three; `far`: that group's behaviour logprobs far from any policy's."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(2):
        completions = [
            Completion(
                token_ids=[int(t) for t in torch.randint(2, 90, (3 + k + i,), generator=g)],
                logprobs=[0.0 if i == far else logprob] * (3 + k + i),
                versions=[0] * (3 + k + i),
                reward=float(k),
            )
            for k in range(3)
        ]
        groups.append(
            Trajectory(
                run=run,
                trajectory_id=f"{run}-{seed}-{i}",
                grant_id="g",
                replica="r",
                prompt_id="p",
                prompt_token_ids=[3, 4, 5 + i, 6][: 2 + i + 1],
                completions=completions,
                started_at=time.time(),
                finished_at=time.time(),
            )  # fmt: skip
        )
    return groups


def states(engines: list[FSDP2Engine]) -> list[dict[str, torch.Tensor]]:
    return [e.adapter_state() for e in engines]


def assert_same(alone: list[dict[str, torch.Tensor]], together: list[dict[str, torch.Tensor]]) -> None:
    for run, (x, y) in zip("abc", zip(alone, together)):
        assert x.keys() == y.keys(), run
        for key in x:
            assert torch.allclose(x[key], y[key], atol=2e-6, rtol=1e-5), (run, key, (x[key] - y[key]).abs().max())


def test_each_runs_update_in_a_joint_step_is_its_solo_update():
    solo, joint = fleet(), fleet()
    start = states(solo)
    assert_same(start, states(joint))
    for step in range(2):
        batches = [batch(e.adapter if e.adapter != "default" else "a", 10 * step + i) for i, e in enumerate(solo)]
        alone = [e.train_step(b, head_version=step) for e, b in zip(solo, batches)]
        together = joint[1].train_together([(e, b, step) for e, b in zip(joint, batches)])
        for x, y in zip(alone, together):
            assert (x.step, x.groups, x.tokens) == (y.step, y.groups, y.tokens)
            assert x.loss == pytest.approx(y.loss, abs=1e-6) and x.grad_norm == pytest.approx(y.grad_norm, rel=1e-5)
            assert x.lr == y.lr and x.mismatch == y.mismatch
    assert_same(states(solo), states(joint))
    assert all(not torch.equal(a[k], b[k]) for a, b in zip(start, states(joint)) for k in list(a)[:1])
    assert [e.step for e in joint] == [2, 2, 2]


def test_a_run_left_out_of_a_joint_step_does_not_move():
    engines = fleet()
    before = states(engines)
    engines[0].train_together([(engines[0], batch("a", 1), 0), (engines[2], batch("c", 2), 0)])
    after = states(engines)
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert engines[1].step == 0 and engines[0].step == engines[2].step == 1


def test_the_adapters_trainable_flags_come_back_after_a_joint_step():
    engines = fleet()
    engines[1].activate()
    flags = [[p.requires_grad for p in e.params] for e in engines]
    engines[0].train_together([(e, batch("x", i), 0) for i, e in enumerate(engines)])
    assert [[p.requires_grad for p in e.params] for e in engines] == flags
    assert flags[1] == [True] * len(flags[1]) and not any(flags[0])


def test_refusals_in_a_joint_step_are_each_runs_own():
    cfgs = [config("a", 8, ["all-linear"], max_train_infer_kl=0.5), CONFIGS[1], CONFIGS[2]]
    solo, joint = fleet(cfgs), fleet(cfgs)
    batches = [batch("a", 1, far=1), batch("b", 2), batch("c", 3)]
    alone = [e.train_step(b, head_version=0) for e, b in zip(solo, batches)]
    together = joint[0].train_together([(e, b, 0) for e, b in zip(joint, batches)])
    assert list(alone[0].refused) == list(together[0].refused) == ["a-1-1"]
    assert not together[1].refused and not together[2].refused
    assert [s.groups for s in together] == [1, 2, 2]
    assert alone[0].mismatch == together[0].mismatch
    assert_same(states(solo), states(joint))


def test_a_run_whose_every_group_is_refused_makes_no_update_while_the_others_do():
    cfgs = [config("a", 8, ["all-linear"], max_train_infer_kl=0.5), CONFIGS[1]]
    engines = fleet(cfgs)
    before = states(engines)
    a_batch = [g for i, g in enumerate(batch("a", 1, far=0) + batch("a", 2, far=1)) if i in (0, 3)]
    stats = engines[0].train_together([(engines[0], a_batch, 0), (engines[1], batch("b", 2), 0)])
    assert stats[0].groups == 0 and len(stats[0].refused) == 2 and engines[0].step == 0
    assert stats[1].groups == 2 and engines[1].step == 1
    assert all(torch.equal(before[0][k], t) for k, t in engines[0].adapter_state().items())


def test_gradient_checkpointing_routes_the_recomputed_forward_too():
    cfgs = [config(c.run, c.actor.lora_rank, list(c.actor.target_modules), gradient_checkpointing=True)
            for c in CONFIGS]  # fmt: skip
    solo, joint = fleet(cfgs), fleet(cfgs)
    batches = [batch("a", 1), batch("b", 2), batch("c", 3)]
    for e, b in zip(solo, batches):
        e.train_step(b, head_version=0)
    joint[0].train_together([(e, b, 0) for e, b in zip(joint, batches)])
    assert_same(states(solo), states(joint))


def test_a_joint_step_that_fails_before_any_update_says_so():
    engines = fleet()
    bad = batch("b", 2)
    bad[0].completions[0].token_ids[0] = 10_000  # beyond the tiny model's vocabulary
    before = states(engines)
    with pytest.raises(JointStepFailed) as failed:
        engines[0].train_together([(engines[0], batch("a", 1), 0), (engines[1], bad, 0)])
    assert failed.value.updated is False
    assert all(torch.equal(x[k], y[k]) for x, y in zip(before, states(engines)) for k in x)


def test_a_joint_step_refuses_runs_that_do_not_share_the_model():
    a, other = fleet()[0], fleet()[1]
    with pytest.raises(ValueError, match="distinct runs on one shared model"):
        a.train_together([(a, batch("a", 1), 0), (other, batch("b", 1), 0)])
    with pytest.raises(ValueError, match="distinct runs on one shared model"):
        a.train_together([(a, batch("a", 1), 0), (a, batch("a", 2), 0)])


def test_run_steps_finds_the_failing_run_of_a_joint_step_and_steps_the_others():
    solo, joint = fleet(), fleet()
    bad = batch("b", 2)
    bad[0].completions[0].token_ids[0] = 10_000
    batches = [batch("a", 1), bad, batch("c", 3)]
    for e, b in zip(solo[::2], batches[::2]):
        e.train_step(b, head_version=0)
    results = ranks.run_steps([(e, ranks.Work(b, 0, save_checkpoint=False), None) for e, b in zip(joint, batches)])
    assert isinstance(results[1], IndexError) and joint[1].step == 0
    assert all(isinstance(r, tuple) for r in results[::2])
    assert_same(states(solo)[::2], states(joint)[::2])
    assert_same([states(solo)[0]], [results[0][1]])  # type: ignore[index]


def test_a_joint_step_that_fails_after_an_update_is_every_runs_fault():
    engines = fleet()

    def broken(*_):
        raise RuntimeError("CUDA error: out of memory")

    engines[2].optimizer.register_step_post_hook(broken)
    batches = [batch("a", 1), batch("b", 2), batch("c", 3)]
    results = ranks.run_steps([(e, ranks.Work(b, 0, save_checkpoint=False), None) for e, b in zip(engines, batches)])
    assert all(isinstance(r, JointStepFailed) and r.updated for r in results)


def assert_same_canary(got, want) -> None:
    assert got.dtype == want.dtype and len(got.sequences) == len(want.sequences)
    for g, w in zip(got.sequences, want.sequences):
        assert (g.prompt_token_ids, g.token_ids) == (w.prompt_token_ids, w.token_ids)
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def test_the_canaries_of_runs_that_stepped_together_are_each_runs_own():
    engines = fleet()
    for e, b in zip(engines, [batch("a", 1), batch("b", 2), batch("c", 3)]):
        e.train_step(b, head_version=0)  # B no longer zero: each adapter answers differently
    alone = [e.canary() for e in engines]
    together = engines[0].canary_together(engines)
    for got, want in zip(together, alone):
        assert_same_canary(got, want)
    # the same prompts (one seed), answered apart by the adapters: rows sent through the wrong
    # adapter would not pass the comparison above
    a, b = alone[0].sequences, alone[1].sequences
    assert [q.prompt_token_ids for q in a] == [q.prompt_token_ids for q in b]
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p.logprobs, q.logprobs)) > 1e-2
    assert not any(hasattr(m, "forward") and "forward" in m.__dict__ for m in engines[0].model.modules())


def test_runs_whose_adapters_cannot_be_routed_get_their_canaries_one_after_another():
    engines = fleet([config("a", 8, ["all-linear"]), config("e", 4, ["embed_tokens", "q_proj"])])
    assert lora.unroutable(engines[0].model) is not None  # LoRA on the embedding: no row routing
    for got, e in zip(engines[0].canary_together(engines), engines):
        assert_same_canary(got, e.canary())


class Bus:
    """What a step publishes through, recorded (no canary or event was stored before)."""

    def __init__(self) -> None:
        self.published: list = []

    async def publish(self, subject, msg, msg_id=None):
        self.published.append(msg)

    async def last(self, stream, msg_type, subject=None):
        return None


class Queue:
    trained: list = []

    def __init__(self) -> None:
        self.acked = False

    def mark_trained(self, ids) -> None:
        pass

    async def ack(self, ids) -> None:
        self.acked = True

    async def next_batch(self, size, stop):  # the next batch never comes in this test
        await asyncio.Event().wait()


@dataclasses.dataclass(frozen=True)
class Recorded(runs.Rank0):
    """An announcement that records the version's tensors (the delivery itself is instant)."""

    announced: dict = dataclasses.field(default_factory=dict)

    async def announce(self, version, tensors, *, weights=None, canary_follows=False, trainer_step=None):
        self.announced[version] = ({k: t.clone() for k, t in tensors.items()}, canary_follows)
        return msgspec.structs.replace(event(version, follows=canary_follows), run=self.cfg.run)


async def test_runs_of_a_fleet_step_together_and_publish_each_its_own_version(tmp_path):
    configs = [
        msgspec.structs.replace(c, actor=msgspec.structs.replace(c.actor, checkpoint_dir=str(tmp_path / c.run)))
        for c in CONFIGS[:2]
    ]
    solo, joint = fleet(configs), fleet(configs)
    batches = [batch("a", 1), batch("b", 2)]
    for e, b in zip(solo, batches):
        e.train_step(b, head_version=0)
    model, workers, contexts = asyncio.Lock(), [], []
    for engine, b in zip(joint, batches):
        ctx = Recorded(engine.cfg, engine, Bus(), None, asyncio.Event(), ranks.Followers(1, 5.0), None, "e0")  # type: ignore[arg-type]
        worker = runs.TrainWorker(ctx, None, model, asyncio.Event(), queue=Queue(), version=0, batch=b)  # type: ignore[arg-type]
        workers.append(worker)
        contexts.append(ctx)
    faults = await runs.train_together(workers, step_index=0)
    try:
        assert faults == [None, None] and [w.version for w in workers] == [1, 1] and not model.locked()
        for w in workers:  # each publication goes on behind the run's next step: wait for its end
            await w.drain()
        for ctx, e in zip(contexts, solo):
            tensors, follows = ctx.announced[1]
            assert follows and tensors.keys() == e.adapter_state().keys()
            assert_same([e.adapter_state()], [tensors])
            kinds = [type(m).__name__ for m in ctx.bus.published]
            assert kinds == ["AdapterCanary", "TrainerStep"], kinds
            assert_same_canary(ctx.bus.published[0].canary, e.canary())  # one decode for both runs
            assert ctx.bus.published[1].run == ctx.cfg.run and ctx.bus.published[1].version == 1
        assert all(w.queue.acked for w in workers)
        # each run checkpointed its own step (actor.checkpoint_every 1), in its own directory
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
        assert all((tmp_path / run / "step-00000001").exists() for run in ("a", "b"))
    finally:
        for w in workers:
            w._collector.cancel()


async def test_a_submitted_run_that_cannot_start_leaves_no_adapter_on_the_shared_model(tmp_path, monkeypatch):
    from services.common.store import open_store
    from services.config.schema import StoreConfig
    from services.trainer import service

    own = fleet(CONFIGS[:1])[0]
    store = open_store(StoreConfig(uri=f"file://{tmp_path / 'store'}"))
    ctx = Recorded(own.cfg, own, Bus(), store, asyncio.Event(), ranks.Followers(1, 5.0), None, "e0")  # type: ignore[arg-type]
    make = service.worker_maker(own.cfg, ctx, None, store, asyncio.Lock(), asyncio.Event())  # type: ignore[arg-type]

    def no_port(*_args, **_kwargs):
        raise OSError("[Errno 98] Address already in use")

    monkeypatch.setattr(service, "make_sender", no_port)
    cfg = msgspec.structs.replace(
        CONFIGS[1], actor=msgspec.structs.replace(CONFIGS[1].actor, checkpoint_dir=str(tmp_path / "b"))
    )
    with pytest.raises(OSError, match="Address already in use"):
        await make(cfg, Bus())  # type: ignore[arg-type]
    assert list(own.model.peft_config) == ["default"]
    monkeypatch.undo()
    worker = await make(cfg, Bus())  # type: ignore[arg-type]
    assert worker.sibling is not None and list(own.model.peft_config) == ["default", "b"]
