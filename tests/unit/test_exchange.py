"""The exchange vector and what is read from it, with no process group: the same code as N
ranks."""

from __future__ import annotations

import dataclasses
import datetime
import math
import random

import pytest
import torch

from nansentinel.checks.health import BOUNDARY, ROW, LocalHealth, Row, assembled
from nansentinel.wire import schema
from nansentinel.wire.exchange import HealthExchange
from nansentinel.wire.schema import EXCHANGE_BYTES, SIZE, O, OwnRow, R, T, Totals, pack

CPU = torch.device("cpu")
NO_REF = torch.full((5,), math.inf)  # spike references still warming up


def row(batch: float, loss: float, grad: float, *, injected: float = 0.0,
        quarantined: float = 0.0, boundary: tuple[float, ...] = (0.0,) * 5,
        stop: tuple[float, float] = (0.0, 0.0),
        buffers: tuple[float, float, float] = (0.0, 0.0, 0.0), hyper: float = 0.0,
        ) -> torch.Tensor:
    """A health row; ``boundary``: fwd_origin, bwd_origin, recv_act, recv_grad, loss_origin;
    ``stop``: SIGTERM, SIGINT received; ``buffers``: the buffers' max-abs as the step left
    them, this rank's own, as they arrived; ``hyper``: a hyperparameter is non-finite."""
    return torch.tensor([batch, loss, grad, injected, 1.0, 1.0, quarantined, *boundary, *stop,
                         *buffers, hyper])


def test_vector_flags_each_kind_from_its_value_and_sums_to_counts() -> None:
    bad = pack(row(3.0, math.nan, -math.inf, injected=1.0), NO_REF, 0, amp=False)
    good = pack(row(1.0, 2.0, 0.5), NO_REF, 1, amp=False)
    assert bad.shape == (SIZE,) and bad.dtype == torch.float32
    assert EXCHANGE_BYTES == T.size * 4 <= 256  # at any world size
    own = OwnRow.from_values(bad.tolist())
    assert own.kinds == ("loss", "grad") and own.injected and math.isnan(own.loss or 0)
    assert OwnRow.from_values(good.tolist()).kinds == () and OwnRow.from_values(
        good.tolist()).loss == 2.0
    summed = (bad[:T.size] + good[:T.size]).tolist()
    totals = Totals.from_values(summed)
    assert (totals.bad_batch, totals.bad_loss, totals.bad_grad) == (0, 1, 1)
    assert totals.blamed == totals.flagged == 1 and totals.single_flagged == 0
    assert totals.injected == 1 and totals.loss_n == 1 and totals.mean("loss") == 2.0
    # The sums stay finite: a non-finite value is counted, never added.
    assert all(math.isfinite(v) for v in summed)


def test_the_sum_of_indices_names_a_single_flagged_rank() -> None:
    vectors = [pack(row(1.0, math.nan if r == 5 else 1.0, 1.0), NO_REF, r, amp=False)
               for r in range(8)]
    totals = Totals.from_values(torch.stack(vectors)[:, :T.size].sum(0).tolist())
    assert totals.flagged == 1 and totals.single_flagged == 5
    vectors[2] = pack(row(math.inf, 1.0, 1.0), NO_REF, 2, amp=False)
    totals = Totals.from_values(torch.stack(vectors)[:, :T.size].sum(0).tolist())
    assert totals.flagged == 2 and totals.single_flagged is None


def test_amp_overflow_and_quarantine_are_counted_not_blamed() -> None:
    overflow = Totals.from_values(pack(row(1.0, 1.0, math.inf), NO_REF, 3, amp=True).tolist())
    assert overflow.bad_grad == 1 and overflow.blamed == 0 and overflow.flagged == 0
    quarantined = Totals.from_values(
        pack(row(1.0, math.nan, 1.0, quarantined=1.0), NO_REF, 3, amp=False).tolist())
    assert quarantined.bad_loss == 1 and quarantined.quarantined == 1
    assert quarantined.blamed == quarantined.flagged == 0


def test_spikes_and_quiet_are_judged_on_the_device_against_the_thresholds() -> None:
    # spike loss, grad; quiet loss, grad; spike batch
    thresholds = torch.tensor([10.0, 50.0, 3.0, 7.0, math.inf])
    calm = OwnRow.from_values(pack(row(1.0, 1.0, 1.0), thresholds, 0, amp=False).tolist())
    assert not calm.spiked() and not calm.not_quiet and not calm.flagged
    uneasy = OwnRow.from_values(pack(row(1.0, 4.0, 1.0), thresholds, 0, amp=False).tolist())
    assert not uneasy.spiked() and uneasy.not_quiet and not uneasy.flagged
    vector = pack(row(1.0, 11.0, 60.0), thresholds, 6, amp=False)
    spiking = OwnRow.from_values(vector.tolist())
    assert spiking.spiked() == ["loss", "grad_norm"] and spiking.flagged
    totals = Totals.from_values(vector.tolist())
    assert (totals.spike_loss, totals.spike_grad, totals.spike_any) == (1, 1, 1)
    assert totals.blamed == 0 and totals.single_flagged == 6


def test_local_health_accumulates_micro_batches_and_packs_without_a_group() -> None:
    local = LocalHealth(CPU)
    local.add_batch({"x": torch.ones(2)}, [torch.tensor(1.0)])
    local.add_batch({"x": torch.ones(2)}, [torch.tensor(math.nan)])  # second micro-batch
    local.add_loss(torch.tensor(1.0))
    local.add_loss(torch.tensor(3.0))
    local.add_grads(torch.tensor(3.0))  # two buckets
    local.add_grads(torch.tensor(4.0))
    exchange = HealthExchange(None, CPU, timeout=5)
    assert exchange.world_size == 1 and not exchange.launched
    exchange.launch(0, pack(local.row(), NO_REF, 0, amp=False))
    assert exchange.launched and exchange.settled()
    step, values = exchange.wait()
    mine = OwnRow.from_values(values)
    assert step == 0 and mine.kinds == ("batch",) and mine.loss == 2.0 and mine.grad_norm == 5.0
    assert Totals.from_values(values).bad_batch == 1


def test_a_rank_without_loss_or_grads_reports_none() -> None:
    exchange = HealthExchange(None, CPU, timeout=5)
    exchange.launch(0, pack(LocalHealth(CPU).row(), NO_REF, 0, amp=False))
    _, values = exchange.wait()
    mine = OwnRow.from_values(values)
    assert mine.kinds == () and mine.loss is None and mine.grad_norm is None
    assert Totals.from_values(values).loss_n == 0 and Totals.from_values(values).mean(
        "loss") is None


def test_plain_keeps_data_and_names_what_it_drops() -> None:
    import collections

    from nansentinel.wire.collectives import plain

    point = collections.namedtuple("point", "x y")

    class Meta:
        pass

    batch = {"x": torch.ones(2), "n": [1, 2.5, None, "s", b"b", True], "m": Meta(),
             "t": (torch.zeros(1), Meta()), "p": point(1, 2), 3: "int key", (1, 2): "tuple key"}
    out, dropped = plain(batch)
    assert isinstance(out, dict) and set(out) == {"x", "n", "t", "p", 3}
    assert out["n"] == [1, 2.5, None, "s", b"b", True] and out["t"][1] is None
    assert out["p"] == (1, 2) and type(out["p"]) is tuple
    assert any(d.startswith("batch['m'] (") and "Meta" in d for d in dropped)
    assert any(d.startswith("batch['t'][1]") for d in dropped)
    assert any("point type" in d for d in dropped)
    assert any("key of type tuple" in d for d in dropped)
    assert plain(Meta()) == (None, [f"batch ({Meta.__module__}.{Meta.__qualname__})"])
    assert plain({"x": torch.ones(1)})[1] == []


def test_an_absent_value_is_neither_a_spike_nor_unquiet() -> None:
    # A log-likelihood's thresholds are negative; an absent loss (0.0 in the row) is above
    # them, and must still count for nothing.
    thresholds = torch.tensor([-4.0, math.inf, -4.5, math.inf, math.inf])
    no_loss = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, *[0.0] * (len(ROW) - 7)])
    own = OwnRow.from_values(pack(no_loss, thresholds, 0, amp=False).tolist())
    assert not own.spiked() and not own.not_quiet and not own.flagged and own.loss is None


class _Work:
    """A launched collective that has finished, with or without an error, as NCCL's work
    tells it: ``get_future_result()`` holds a ``WorkResult`` (0 SUCCESS, 1 TIMEOUT, 2
    COMM_ERROR) once NCCL's watchdog has seen it; ``exception()`` is deprecated (it warns on
    every call, from the sentinel's watchdog thread) and must not be called."""

    def __init__(self, error: BaseException | None, seen: bool = True) -> None:
        self.error = error
        self.result: torch.futures.Future = torch.futures.Future()
        if seen:
            self.result.set_result(0 if error is None else 2)
        self.waits: list[dict[str, object]] = []

    def is_completed(self) -> bool:
        return True  # NCCL says so for a failed work too

    def get_future_result(self) -> torch.futures.Future:
        return self.result

    def exception(self) -> BaseException | None:
        raise AssertionError("Work.exception() is deprecated and warns")

    def wait(self, **kwargs: object) -> bool:
        self.waits.append(kwargs)
        return True


def test_a_failed_nccl_work_is_not_settled_so_the_watchdog_still_names() -> None:
    """Issue 20, item 8: on NCCL no error reaches the bucket's future (it completes at enqueue)
    and a work that NCCL's watchdog failed says is_completed(); only the sentinel's deadline is
    left to name the missing ranks, so that work must not count as done. Gloo keeps its own
    path: the training thread's wait raises and diagnoses."""
    exchange = HealthExchange(None, CPU, 5.0)
    assert exchange.backend == "" and not exchange.nccl
    assert not exchange.settled()  # nothing launched yet
    exchange.launch(0, torch.zeros(SIZE))
    assert exchange.settled()  # alone: no collective at all
    for nccl, error, settled in [(True, None, True), (True, RuntimeError("watchdog timeout"),
                                 False), (False, RuntimeError("reset by peer"), True)]:
        exchange.nccl = nccl
        exchange._work = _Work(error)  # type: ignore[assignment]
        assert exchange.settled() is settled, (nccl, error)
    exchange.nccl = True
    exchange._work = _Work(None, seen=False)  # type: ignore[assignment]
    assert exchange.settled()  # completed, and NCCL's watchdog has not marked it yet


def test_the_nccl_wait_does_not_poll_with_a_timeout() -> None:
    """Issue 35 item 7: ``work.wait(timeout=...)`` makes NCCL block the host and poll the
    work's events with sleeps before the read syncs again; the stream waits instead (no
    timeout) and the step's watchdog bounds a hang, as in ``take()``. Gloo's host wait keeps
    its timeout: nothing else bounds it there."""
    exchange = HealthExchange(None, CPU, 5.0)
    for nccl, how in [(True, {}), (False, {"timeout": datetime.timedelta(seconds=5.0)})]:
        for call in (exchange.wait, exchange.take):
            exchange.launch(3, torch.zeros(SIZE))
            exchange.nccl = nccl
            work = exchange._work = _Work(None)  # type: ignore[assignment]
            assert call()[0] == 3
            assert work.waits == [how], (nccl, call)


def test_a_failed_bucket_future_becomes_the_steps_diagnosis() -> None:
    """Gloo: the bucket's future carries the peer's error, which becomes the diagnosis; a
    future that completed (NCCL: at enqueue) resolves to the reduced tensor itself."""
    exchange = HealthExchange(None, CPU, 5.0)
    tensor = torch.ones(3)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result([tensor])
    assert exchange.diagnosed(done, 2, tensor).wait() is tensor
    failed: torch.futures.Future = torch.futures.Future()
    chained = exchange.diagnosed(failed, 3, tensor)
    failed.set_exception(RuntimeError("Connection reset by peer"))
    with pytest.raises(RuntimeError, match="collectives of step 3 failed or timed out") as info:
        chained.wait()
    assert "Connection reset by peer" in str(info.value)


class _Store:
    """Records the store requests of the late check-in."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.requests: list[str] = []

    def set(self, key: str, value: str) -> None:
        self.requests.append(f"set {key}")
        self.keys[key] = 1

    def add(self, key: str, n: int) -> int:
        self.requests.append(f"add {key}")
        self.keys[key] = self.keys.get(key, 0) + n
        return self.keys[key]

    def delete_key(self, key: str) -> bool:
        self.requests.append(f"delete {key}")
        return self.keys.pop(key, None) is not None


def test_check_ins_leave_a_bounded_number_of_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check-in removes this rank's key and the count and answer of the step it last
    checked in for: however many steps check in, the keys stay those of the last."""
    from nansentinel.wire import exchange as module

    store = _Store()
    monkeypatch.setattr(module, "_default_store", lambda: store)
    exchange = HealthExchange(None, CPU, 4.0)
    exchange.world_size = 1  # the count completes: the answer key is written too
    for step in range(5, 50, 4):
        exchange.check_in(step)
        exchange.check_in(step)  # once per step
    prefix = f"nansentinel/arrived/{exchange._attempt}/49"
    assert sorted(store.keys) == [f"{prefix}/0", f"{prefix}/count", f"{prefix}/missing"]
    assert len(store.requests) == 3 + 6 * 11  # no second request for a step checked in


def test_the_first_diagnosing_rank_looks_after_the_blocked_ranks_checked_in() -> None:
    """They check in once their step has been armed the timeout (late_after): the first rank
    to diagnose waits until its own arming plus the timeout and a grace."""
    exchange = HealthExchange(None, CPU, 4.0)  # grace 5 s
    assert exchange._look_in(3) == 9.0  # no watchdog: from now
    exchange.armed_for = lambda step: {3: 0.5, 4: 20.0}.get(step)
    assert exchange._look_in(3) == 8.5  # a peer died at once: wait for the blocked ones
    assert exchange._look_in(4) == 0.1  # the watchdog's expiry: they have checked in
    assert exchange._look_in(5) == 9.0  # not the armed step


def test_host_bytes_reads_a_tensor_in_one_copy() -> None:
    """gather_from's read of the speakers' bytes (was bytes(storage): one Python call per
    byte, 130 s for the 41 MB of rows that 131,072 named ranks sent)."""
    import time

    from nansentinel.wire.collectives import host_bytes

    data = torch.frombuffer(bytearray(b"[1, 2] null"), dtype=torch.uint8)
    assert host_bytes(data) == b"[1, 2] null" and host_bytes(data[7:]) == b"null"
    assert host_bytes(torch.zeros(0, dtype=torch.uint8)) == b""
    big = torch.full((16 * 2**20,), 32, dtype=torch.uint8)
    started = time.perf_counter()
    assert host_bytes(big) == b" " * (16 * 2**20)
    assert time.perf_counter() - started < 1.0


# --- one schema: the positions, the packing, the decoding and the row agree -----------------


def test_the_positions_are_the_records_fields_in_order() -> None:
    assert [getattr(T, f.name) for f in dataclasses.fields(Totals)] == list(range(T.size))
    assert [getattr(O, f.name) for f in dataclasses.fields(OwnRow)] == list(
        range(T.size, T.size + O.size))
    assert [getattr(R, f.name) for f in dataclasses.fields(Row)] == list(range(R.size))
    assert T.size + O.size == SIZE and O.names[:R.size] == R.names == ROW
    with pytest.raises(AttributeError, match="no field 'bad_everything' on the wire"):
        _ = T.bad_everything


def test_every_field_is_packed_where_the_schema_puts_it_and_decodes_back() -> None:
    """Each row field set to a value of its own (the flags one at a time): pack places it and
    OwnRow reads it back under its own name; a field pack forgot would fail here."""
    values = {"batch_norm": 1.5, "loss_value": 2.5, "grad_norm_value": 3.5,
              "has_loss": 1.0, "has_grad": 1.0}
    for flag in (f.name for f in dataclasses.fields(Row) if f.type == "bool"):
        given = {**values, flag: 1.0}
        own = OwnRow.from_values(pack(torch.tensor([given.get(n, 0.0) for n in R.names]),
                                      NO_REF, 0, amp=False).tolist())
        for name in R.names:
            assert float(getattr(own, name)) == given.get(name, 0.0), (flag, name)


def test_the_host_rule_and_the_device_rule_pack_the_same_vector() -> None:
    """The CPU packs on host floats, an accelerator with tensor operations: bit for bit the
    same vector (NaN where NaN) for rows of every kind of value and flag, thresholds below,
    at and above the values, with and without GradScaler and a dropped flag. Seeded and
    printed: a failure names its seed and its row."""
    seed = random.randrange(2**32)
    print(f"pack equivalence seed {seed}")
    rng = random.Random(seed)
    values = (0.0, 1.5, -2.0, 7.0, 1e30, 3.0e38, math.inf, -math.inf, math.nan)
    thresholds = (0.5, 1.5, 7.0, 1e30, math.inf)
    for _ in range(3000):
        flags = [float(rng.random() < 0.3) for _ in range(R.size - 3)]
        for slot in (R.buffer_norm, R.buffer_own, R.buffer_arrived):  # values, not flags
            flags[slot - 3] = rng.choice(values)
        given = torch.tensor([rng.choice(values) for _ in range(3)] + flags)
        refs = torch.tensor([rng.choice(thresholds) for _ in range(5)])
        rank, amp = rng.randrange(100_000), rng.random() < 0.5
        dropped = rng.choice((None, torch.tensor(False), torch.tensor(True)))
        host = pack(given, refs, rank, amp=amp, dropped=dropped)
        device = schema.pack_on_device(given, refs, rank, amp=amp, dropped=dropped)
        assert host.dtype == device.dtype == torch.float32
        assert torch.equal(host.isnan(), device.isnan()), (seed, given, refs, rank, amp)
        assert torch.equal(host.nan_to_num(), device.nan_to_num()), (seed, given, refs, rank, amp)


def test_a_field_the_packing_does_not_compute_is_an_error_naming_it() -> None:
    pieces = ((("bad_batch", "bad_loss"), torch.zeros(2)),)
    with pytest.raises(AssertionError, match=r"not computed \['bad_grad'\]"):
        assembled(pieces, ("bad_batch", "bad_loss", "bad_grad"))
    swapped = ((("b", "a"), torch.tensor([2.0, 1.0])),)
    assert assembled(swapped, ("a", "b")).tolist() == [1.0, 2.0]  # placed by name


def test_the_health_row_is_the_rows_schema() -> None:
    health = LocalHealth(CPU)
    health.add_batch(None, [torch.tensor(4.0)])
    health.add_loss(torch.tensor(2.0))
    health.add_grads(torch.tensor(3.0))
    health.injected = True
    health.add_boundaries(torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0]))
    decoded = Row(*health.row().tolist())
    assert decoded == Row(4.0, 2.0, 3.0, injected=1.0, has_loss=1.0, has_grad=1.0,
                          bwd_origin=1.0, loss_origin=1.0)  # type: ignore[arg-type]
    assert BOUNDARY == ("fwd_origin", "bwd_origin", "recv_act", "recv_grad", "loss_origin")


@pytest.mark.parametrize("state", ["empty", "healthy", "micro-batches", "nan", "flags"])
def test_the_host_row_is_the_device_row(state: str) -> None:
    """The CPU reads its row as host floats (LocalHealth.host_row): the same values, in the
    same places, as the row built with tensor operations, whatever the step recorded."""
    health = LocalHealth(CPU)
    if state != "empty":
        health.add_batch(None, [torch.tensor(4.0), torch.tensor(math.inf if state == "nan"
                                                                 else 1.0)])
        health.add_loss(torch.tensor(math.nan if state == "nan" else 2.0))
        health.add_grads(torch.tensor(3.0))
    if state == "micro-batches":
        health.add_loss(torch.tensor(5.0))
        health.add_grads(torch.tensor(1e30))
    if state == "flags":
        health.injected, health.stop_signal = True, 15
        health.add_quarantined(torch.tensor(1.0))
        health.add_boundaries(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    device = health.row().tolist()
    assert len(health.host_row()) == R.size == len(device)
    assert [str(v) for v in health.host_row()] == [str(v) for v in device]  # NaN as NaN


class _DeafStore:
    """A store across a partition: every request blocks (as a TCPStore whose peer's link is
    down blocks for the store's own timeout, minutes)."""

    host, port = "10.0.0.1", 29400

    def __init__(self) -> None:
        import threading

        self.released = threading.Event()

    def _block(self, *args: object, **kwargs: object) -> None:
        self.released.wait(60)
        raise RuntimeError("store gone")

    set = add = wait = get = check = delete_key = _block


def test_a_store_that_never_answers_bounds_the_diagnosis_and_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut-off side of a partition: the diagnosis gives up on the store after its bound
    and says what it could not reach, and every diagnosis is recorded once, first."""
    import time

    from nansentinel.wire import exchange as module

    store = _DeafStore()
    monkeypatch.setattr(module, "_default_store", lambda: store)
    monkeypatch.setattr(module, "_STORE_MARGIN_S", 0.0)
    monkeypatch.setattr(module, "diagnosis_grace", lambda timeout: 0.5)
    exchange = HealthExchange(None, CPU, 0.2)
    exchange.world_size = 4
    exchange.armed_for = lambda step: 10.0  # the watchdog's expiry: look at once
    recorded: list[tuple[int, str]] = []
    exchange.on_diagnosed = lambda step, error: recorded.append((step, str(error)))
    started = time.monotonic()
    try:
        error = exchange.diagnose(7, None)
    finally:
        store.released.set()
    assert time.monotonic() - started < 0.1 + 0.5 + 1.0  # look_in + the store's bound + slack
    assert "could not reach the rendezvous store at 10.0.0.1:29400 (no answer in 1 s" in str(
        error)
    assert "which of the other 3 rank(s) are missing" in str(error) and error.missing == []
    assert recorded == [(7, str(error))] and exchange.diagnosis is error
    assert exchange.diagnose(7, None) is error and len(recorded) == 1  # once per step


def test_transport_failures_are_told_from_the_loops_own_errors() -> None:
    import torch.distributed as dist

    from nansentinel.result import ExchangeTimeoutError
    from nansentinel.wire.exchange import is_transport_failure

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [10.0.0.2]:1165")
    assert is_transport_failure(gloo)
    assert is_transport_failure(dist.DistBackendError("NCCL communicator was aborted"))
    # Under TORCH_DISTRIBUTED_DEBUG=DETAIL the dead peer is met at the wrapper's barrier.
    assert is_transport_failure(RuntimeError(
        "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 60000 ms"))
    assert is_transport_failure(ExchangeTimeoutError("no answer from rank 1", [1]))
    try:  # raised from one: DDP's wrapped callback error keeps the cause's text, others chain
        raise ValueError("while reducing") from gloo
    except ValueError as exc:
        assert is_transport_failure(exc)
    assert not is_transport_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    # A data loader's re-raised network error is the loop's, not a collective's.
    assert not is_transport_failure(RuntimeError("Caught ConnectionResetError in DataLoader "
                                                 "worker process 0: Connection reset by peer"))
    assert not is_transport_failure(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_transport_failure(None)


def test_a_stop_request_travels_in_the_summed_slots() -> None:
    """One rank's SIGTERM is in the sum every rank reads back; the vector's size is the same."""
    import signal

    from nansentinel.decide.policy import requested_stop

    asked = pack(row(1.0, 2.0, 0.5, stop=(1.0, 0.0)), NO_REF, 0, amp=False)
    quiet = pack(row(1.0, 2.0, 0.5), NO_REF, 1, amp=False)
    assert asked.shape == quiet.shape == (SIZE,)
    summed = Totals.from_values((asked[:T.size] + quiet[:T.size]).tolist())
    assert (summed.stop_term, summed.stop_int, summed.flagged) == (1, 0, 0)
    assert requested_stop(summed) == signal.SIGTERM and not summed.device_skips
    assert OwnRow.from_values(asked.tolist()).stop_term
