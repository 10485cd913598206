"""The pure parts of the replica fingerprints: hashing, comparing, voting, the drill's bit
flip, the config fields and the metric."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from nansentinel.common.inject import Injector, parse_inject
from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.effects.metrics import SentinelMetrics
from nansentinel.rare.replicas import (
    Finding,
    action_for,
    comparand,
    disagreeing,
    fingerprint,
    flip_bit,
    replicated_state,
    vote,
)
from nansentinel.result import Outcome, RankIdentity, StepResult
from nansentinel.wire.context import Watched


def _max_reduce(*prints: torch.Tensor) -> list[int]:
    """What the replica group's MAX all-reduce of the comparands returns."""
    return torch.stack([comparand(p) for p in prints]).max(0).values.tolist()


def test_one_flipped_bit_changes_the_fingerprint_and_only_its_slot() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(64), torch.randn(3, 5), torch.zeros(0), torch.tensor(7.0)]
    copy = [t.clone() for t in tensors]
    assert torch.equal(fingerprint(tensors), fingerprint(copy))
    before = copy[1].clone()
    flip_bit(copy[1])
    assert torch.isfinite(copy[1]).all() and not torch.equal(copy[1], before)
    rel = ((copy[1] - before).abs().max() / before.abs().view(-1)[0]).item()
    assert 0 < rel < 1e-3  # ~0.05%: finite and small, as a silent fault is
    fp = fingerprint(tensors)
    assert fp.dtype == torch.int64 and bool((fp >= 0).all())  # 63 bits: -fp never overflows
    assert disagreeing(_max_reduce(fp, fp, fp)) == []
    assert disagreeing(_max_reduce(fp, fingerprint(copy), fp)) == [1]


def test_sparse_and_complex_state_tensors_are_fingerprinted() -> None:
    """SGD's momentum buffer of an embedding's sparse gradient is sparse (``hash_tensor`` has
    no sparse kernel: the fingerprint pass ended every rank): a changed value or index
    changes its slot alone; a CSR one too; one that stores nothing hashes as an empty one."""
    buf = torch.sparse_coo_tensor([[1, 4, 1]], [0.5, -2.0, 0.25], (2 ** 40,))
    dense = torch.randn(3)
    csr = torch.eye(2).to_sparse_csr()
    fp = fingerprint([dense, buf, csr])
    assert torch.equal(fp, fingerprint([dense.clone(), buf.clone(), csr.clone()]))
    moved = torch.sparse_coo_tensor([[1, 5, 1]], [0.5, -2.0, 0.25], (2 ** 40,))
    changed = buf.clone()
    changed._values()[2] = 0.5
    for other in (moved, changed):
        assert disagreeing(_max_reduce(fp, fingerprint([dense, other, csr]), fp)) == [1]
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), [], (5,))
    assert fingerprint([empty]).tolist() == fingerprint([torch.zeros(0)]).tolist() == [0]
    cplx = torch.tensor([1.0 + 2.0j, -3.0j])  # a complex parameter (no complex hash kernel)
    assert fingerprint([cplx]).tolist() == fingerprint([torch.view_as_real(cplx)]).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_bit_flip_stays_finite_in_every_float_dtype(dtype: torch.dtype) -> None:
    t = torch.full((4,), 1.5, dtype=dtype)
    flip_bit(t)
    assert torch.isfinite(t).all() and t[0] != 1.5 and bool((t[1:] == 1.5).all())


def test_vote_names_the_minority() -> None:
    a, b = (1, 2), (1, 3)
    v = vote({0: a, 1: a, 2: b, 3: a})
    assert (v.majority, v.agreed, v.bad) == (True, [0, 1, 3], [2])


def test_vote_without_a_majority_names_every_rank() -> None:
    assert vote({0: (1,), 1: (2,)}) == vote({0: (1,), 1: (2,)})
    v = vote({0: (1,), 1: (2,)})
    assert (v.majority, v.bad) == (False, [0, 1])
    v = vote({4: (1,), 5: (1,), 6: (2,), 7: (2,)})  # a tie is no majority either
    assert not v.majority and v.bad == [4, 5, 6, 7] and v.agreed == [4, 5]
    assert not vote({0: (1,), 1: (2,), 2: (3,)}).majority


def _finding(majority: bool) -> Finding:
    return Finding([0, 2, 4], majority, [0, 4] if majority else [0], [2] if majority else
                   [0, 2, 4], {0: "a", 2: "b", 4: "c"}, ["w", "w.exp_avg"],
                   0 if majority else None)


def test_no_majority_turns_repair_into_abort_and_is_described() -> None:
    assert action_for([_finding(True)], "repair") == "repair"
    assert action_for([_finding(True), _finding(False)], "repair") == "abort"
    assert action_for([_finding(False)], "warn") == "warn"
    text = _finding(True).describe()
    assert text == ("replica group [0, 2, 4]: rank 2 (host b) diverged from ranks [0, 4] "
                    "(which agreed) in [w, w.exp_avg]")
    assert "no majority" in _finding(False).describe()
    assert Finding.from_json(_finding(True).to_json()) == _finding(True)


def test_replicated_state_holds_parameters_and_optimizer_state_in_order() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    assert [n for n, _ in replicated_state(model, opt)] == ["weight", "bias"]
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    names = [n for n, _ in replicated_state(model, opt, skip=("bias",))]
    assert names == ["weight", "weight.exp_avg", "weight.exp_avg_sq", "weight.step"]


def test_config_fields_validate_and_come_from_the_environment() -> None:
    cfg = SentinelConfig.from_env({"NANSENTINEL_FINGERPRINT_EVERY": "7",
                                   "NANSENTINEL_DIVERGENCE_ACTION": "warn"})
    assert (cfg.fingerprint_every, cfg.divergence_action) == (7, "warn")
    assert SentinelConfig().divergence_action == "repair"
    with pytest.raises(ConfigError, match="NANSENTINEL_DIVERGENCE_ACTION") as err:
        SentinelConfig.from_env({"NANSENTINEL_DIVERGENCE_ACTION": "fix"})
    assert "repair, abort, warn" in str(err.value)
    with pytest.raises(ConfigError, match="fingerprint_every=-1 must be >= 0"):
        SentinelConfig(fingerprint_every=-1)


def test_bitflip_drill_parses_and_fires_once_on_its_rank() -> None:
    faults = parse_inject("kind=bitflip,rank=2,step=5")
    assert faults[0].kind == "bitflip" and faults[0].rank == 2
    on, off = Injector(faults, 2, "h"), Injector(faults, 1, "h")
    assert [on.due("bitflip", s) for s in (4, 5, 6)] == [False, True, False]
    assert not off.due("bitflip", 5) and on.fired == [(5, "bitflip")]
    with pytest.raises(ValueError, match="bitflip takes no value"):
        parse_inject("kind=bitflip,rank=2,step=5,value=nan")
    with pytest.raises(ValueError, match="bitflip"):  # the kinds are listed
        parse_inject("kind=bits,step=5")


def test_divergence_counter_counts_the_diverged_rank_only() -> None:
    registry = CollectorRegistry()
    metrics = SentinelMetrics(RankIdentity(2, 2, 4, "h", "cpu"), registry=registry,
                              cluster_view=False)
    name = "nansentinel_replica_divergence_total"
    assert registry.get_sample_value(name) == 0.0
    result = StepResult(step=7, applied=True, outcome=Outcome.APPLIED, bad_ranks=[2],
                        bad_hosts=["h"], kinds=["replica"], local_kinds=["replica"],
                        local_loss=1.0, local_grad_norm=1.0, consecutive_skips=0,
                        verdict="sdc")
    metrics.observe_step(result, 0.001)
    assert registry.get_sample_value(name) == 1.0
    assert registry.get_sample_value("nansentinel_blamed_steps_total") == 0.0  # finite
    assert registry.get_sample_value("nansentinel_rank_healthy") == 1.0


def test_a_repair_moves_only_the_disagreeing_slots_at_a_large_simulated_world() -> None:
    """Issue 35 item 8: on a mismatch every rank of the replica group shares its row, summed on
    every rank. Under DDP at a simulated 4,096 ranks (torch's fake backend: collectives are
    no-ops, so each rank's row is written into every slot as the real sum would fill them) the
    bytes grow with the world times the tensors that differ (one), not times all of them."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nansentinel.rare.replicas import ReplicaCheck
    from nansentinel.wire.collectives import Peers

    world = 4096
    moved: list[int] = []
    real = dist.all_reduce

    def simulated(t: torch.Tensor, *args: object, **kwargs: object) -> object:
        moved.append(t.numel() * t.element_size())
        if t.dtype == torch.int64 and t.numel() == world:  # the rows' sizes: every rank's
            t.fill_(int(t[0]))
        elif t.dtype == torch.uint8 and t.numel() and t.numel() % world == 0:  # the rows
            t.copy_(t[: t.numel() // world].repeat(world))
        return real(t, *args, **kwargs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(100)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        ctx = _context(Peers(None, torch.device("cpu")), RankIdentity(0, 0, world, "node-0000",
                                                                      "cpu"), every=1)
        check = ReplicaCheck(ctx, Watched(model, model, opt), None)
        state, fp, slots = check.compare()
        assert len(state) == 800 and slots == []  # 200 parameters, 3 Adam tensors each
        dist.all_reduce = simulated  # type: ignore[assignment]
        try:
            check._name(state, fp, [123])  # one tensor differs somewhere in the group
        finally:
            dist.all_reduce = real  # type: ignore[assignment]
    finally:
        dist.destroy_process_group()
    rows = moved[1]
    assert moved[0] == 8 * world  # the sizes
    assert rows <= 100 * world, f"{rows:,} bytes summed for one differing tensor at W={world}"


def test_a_repair_and_the_bitflip_drill_wait_for_the_snapshot_copies_before_writing() -> None:
    """Issue 35 item 6: a snapshot's copies of the parameters run on a side stream that only
    their next writer waits for; a repair (and the drill's flip) writes into them right after
    a save, so it calls ``before_write`` (the copies' ``hold``) first."""
    from nansentinel.rare.replicas import ReplicaCheck
    from nansentinel.wire.collectives import Peers

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = _context(Peers(None, torch.device("cpu")), RankIdentity(0, 0, 1, "h", "cpu"), every=10)
    check = ReplicaCheck(ctx, Watched(model, model, opt), None, inject=lambda s: s == 3)
    seen: list[torch.Tensor] = []
    check.before_write = lambda: seen.append(model.weight.detach().clone())
    before = model.weight.detach().clone()
    result = StepResult(step=3, applied=True, outcome=Outcome.APPLIED, bad_ranks=[],
                        bad_hosts=[], kinds=[], local_kinds=[], local_loss=1.0,
                        local_grad_norm=1.0, consecutive_skips=0)
    check.check(3, result, None, None)  # type: ignore[arg-type]
    assert len(seen) == 1 and torch.equal(seen[0], before)  # called before the flip
    assert not torch.equal(model.weight, before)
    check._source = 0
    finding = Finding([0], True, [0], [], {0: "h"}, ["weight"], 0)
    check._repair(replicated_state(model, opt), [finding])
    assert len(seen) == 2


def _context(peers: object, identity: RankIdentity, *, every: int) -> object:
    """The run as a replica check reads it (its peers, identity, device, config, deadline)."""
    import contextlib
    from types import SimpleNamespace

    from nansentinel.config import SentinelConfig

    config = SentinelConfig(fingerprint_every=every, divergence_action="repair")
    return SimpleNamespace(peers=peers, identity=identity, device=torch.device("cpu"),
                           config=config, guarded=contextlib.nullcontext)
