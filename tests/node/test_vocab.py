"""Growing the vocabulary keeps every old row and all optimizer state; new rows are deterministic;
a replica grows at the round its verifier schedules; a checker reads the vocabulary off what it checks."""

import dataclasses

import torch

from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig, Transformer, build_stage
from neuroshard.node.reporting import Reporting
from neuroshard.node.vocab import VocabSchedule, grow_replica, stage_vocab, state_vocab, vocab_of
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.roster import MemberList

CONFIG = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
DILOCO = DiLoCoConfig(inner_steps=3, warmup_steps=0, total_steps=100)


def _trained() -> tuple[Transformer, DiLoCo]:
    model = Transformer(CONFIG)
    diloco = DiLoCo(model, DILOCO)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for _ in range(3):
            x = torch.randint(0, 300, (2, 16), generator=gen)
            diloco.inner_step(x, torch.roll(x, -1, 1))
        diloco.outer_step(diloco.pseudo_gradient())
    return model, diloco


def test_old_rows_and_state_survive_and_new_rows_are_fresh_and_deterministic() -> None:
    model, diloco = _trained()
    grown, g = grow_replica(model, diloco, 340)
    assert grown.config.vocab_size == 340 and grown.embedding is not None and grown.head is not None
    assert torch.equal(grown.embedding.weight[:300], model.embedding.weight)  # type: ignore[union-attr]
    assert torch.equal(grown.head.weight[:300], model.head.weight)  # type: ignore[union-attr]
    fresh = Transformer(grown.config)
    assert torch.equal(grown.embedding.weight[300:], fresh.embedding.weight[300:])  # type: ignore[union-attr]
    assert torch.equal(g.theta_round, torch.nn.utils.parameters_to_vector(grown.parameters()))
    assert (g.step, g.round, g.current_lr) == (diloco.step, diloco.round, diloco.current_lr)
    old_m = diloco.outer_optimizer.state[diloco.theta_round]["momentum_buffer"]
    new_m = g.outer_optimizer.state[g.theta_round]["momentum_buffer"]
    assert new_m.numel() == g.theta_round.numel() and torch.equal(new_m[: 300 * 32], old_m[: 300 * 32])
    assert torch.count_nonzero(new_m[300 * 32 : 340 * 32]) == 0
    adam = g.inner_optimizer.state[grown.head.weight]  # type: ignore[union-attr]
    assert torch.count_nonzero(adam["exp_avg"][300:]) == 0 and torch.count_nonzero(adam["exp_avg"][:300]) > 0


def test_old_ids_predict_exactly_as_before_growth() -> None:
    model, diloco = _trained()
    grown, _ = grow_replica(model, diloco, 340)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.allclose(grown(x)[..., :300], model(x), atol=0, rtol=0)


def test_grown_replica_keeps_training() -> None:
    model, diloco = _trained()
    _, g = grow_replica(model, diloco, 340)
    x = torch.randint(0, 340, (2, 16))
    loss = g.inner_step(x, torch.roll(x, -1, 1))
    assert torch.isfinite(torch.tensor(loss))
    g.outer_step(g.pseudo_gradient())
    assert g.round == diloco.round + 1


def test_a_checker_reads_the_vocabulary_off_a_theta_s_length_or_a_checkpoint_s_rows() -> None:
    three = dataclasses.replace(CONFIG, n_layers=3)
    for stage in range(3):
        grown = build_stage(dataclasses.replace(three, vocab_size=340), stage, 3)
        numel = sum(p.numel() for p in grown.parameters())
        expected = 300 if stage == 1 else 340  # the middle stage holds no rows: its θ does not change
        assert stage_vocab(three, stage, 3, numel) == expected
        assert state_vocab(grown.state_dict(), 300) == expected
        assert stage_vocab(three, stage, 3, numel + 1) is None  # no whole number of rows
    whole = sum(p.numel() for p in Transformer(CONFIG).parameters())
    assert stage_vocab(CONFIG, 0, 1, whole + 2 * 32 * 5) == 305  # one row in each of embedding and head
    assert stage_vocab(CONFIG, 0, 1, whole - 2 * 32) is None  # a vocabulary never shrinks


def test_a_schedule_grows_an_engine_only_from_its_round() -> None:
    _, diloco = _trained()  # at round 2
    schedule = VocabSchedule()
    assert schedule.grow_due(diloco) is None  # nothing scheduled
    schedule.set(340, 3)
    assert schedule.due(2) == 0 and schedule.due(3) == schedule.due(9) == 340
    assert schedule.grow_due(diloco) is None
    heard: list[int] = []
    schedule.on_grown = lambda engine: heard.append(vocab_of(engine))
    diloco.round = 3
    grown = schedule.grow_due(diloco)
    assert grown is not None and vocab_of(grown) == 340 and heard == [340]
    assert schedule.grow_due(grown) is None  # already there


def test_the_tracker_hands_a_member_list_s_vocabulary_to_the_replica_s_schedule() -> None:
    class Network:
        def set_roster(self, roster: object, effective_round: int) -> None:
            self.effective_round = effective_round

    operator, member = Wallet.from_token("vocab-operator"), Wallet.from_token("vocab-member")
    lines: list[str] = []
    reporting = Reporting(url="http://127.0.0.1:9", operator_key=operator.public_key_hex, log=lines.append)
    reporting.vocab = VocabSchedule()

    def members(vocab_size: int | None, from_round: int | None) -> MemberList:
        return MemberList.create(
            operator, network="n", expires_at=2**40, stage=1, epoch=2, effective_round=5, policy="open",
            admitted=(member.public_key_hex,), probation=(), admission_rounds=3,
            vocab_size=vocab_size, vocab_from_round=from_round,
        )  # fmt: skip

    network = Network()
    reporting._take_members(network, members(None, None))  # type: ignore[arg-type]
    assert reporting.vocab.planned == (0, 0) and network.effective_round == 5
    reporting._take_members(network, members(600, 7))  # type: ignore[arg-type]
    assert reporting.vocab.planned == (600, 7)
    assert lines == ["tracker: the verifier schedules vocabulary 600 for stage 1 from round 7"]


def test_a_verifier_that_cannot_be_read_at_start_leaves_the_schedule_to_the_tracker() -> None:
    lines: list[str] = []
    reporting = Reporting(
        url="http://127.0.0.1:9",
        operator_key="ab" * 32,
        log=lines.append,
        network_name="n",
        vocab=VocabSchedule(),
    )
    reporting.read_vocab(1)
    assert reporting.vocab is not None and reporting.vocab.planned == (0, 0)
    assert len(lines) == 1 and "stage 1's member list not read at start" in lines[0]
