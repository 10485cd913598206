"""The stop path's NCCL flight-recorder dump before ``os._exit`` (issue 20, item 8)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nansentinel.effects import stop
from nansentinel.effects.stop import dump_flight_recorder, flight_recorder_path


@pytest.fixture
def dumps(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """torch's NCCL dump, faked (a CPU build has none): each call's arguments."""
    calls: list[dict[str, object]] = []

    def fake(**kwargs: object) -> bytes:
        calls.append(kwargs)
        return pickle.dumps({"version": "fake", "entries": [{"profiling_name": "nccl:all_reduce"}]})

    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", fake, raising=False)
    return calls


def test_the_dump_goes_where_torch_writes_its_own(
    tmp_path: Path, dumps: list[dict[str, object]]
) -> None:
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "trace_")}
    path = dump_flight_recorder("nccl", 5, env)
    assert path == tmp_path / "fr" / "trace_5" and dumps == [{}]  # torch's defaults: everything
    assert pickle.loads(path.read_bytes())["entries"][0]["profiling_name"] == "nccl:all_reduce"
    assert [p.name for p in path.parent.iterdir()] == ["trace_5"]  # no temp file left
    # The older name, then torch 2.13's default under the cache directory.
    assert flight_recorder_path(2, {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/d/nccl_"}) == Path(
        "/d/nccl_2")
    assert flight_recorder_path(3, {"HOME": "/home/u"}) == Path(
        "/home/u/.cache/torch/comm_lib_trace_rank_3")
    assert flight_recorder_path(3, {"XDG_CACHE_HOME": "/c", "HOME": "/home/u"}) == Path(
        "/c/torch/comm_lib_trace_rank_3")
    dynamic = {"TORCH_FR_DUMP_TEMP_FILE": "/d/exact", "TORCH_FR_DUMP_DYNAMIC_FILE_NAME": "1"}
    assert flight_recorder_path(3, dynamic) == Path("/d/exact")


@pytest.mark.parametrize(
    ("backend", "env"),
    [("gloo", {}), ("", {}), ("nccl", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}),
     ("nccl", {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})],
    ids=["gloo", "alone", "buffer-off", "buffer-off-new-name"],
)
def test_no_dump_off_nccl_or_with_the_recorder_off(
    tmp_path: Path, dumps: list[dict[str, object]], backend: str, env: dict[str, str]
) -> None:
    env = {**env, "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")}
    assert dump_flight_recorder(backend, 0, env) is None
    assert dumps == [] and not list(tmp_path.iterdir())


def test_a_failed_dump_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(**kwargs: object) -> bytes:
        raise RuntimeError("recorder gone")

    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", broken, raising=False)
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "t_")}
    assert dump_flight_recorder("nccl", 1, env) is None
    assert "recorder gone" in caplog.text and not list(tmp_path.iterdir())


def test_on_timeout_dumps_before_it_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dumps: list[dict[str, object]]
) -> None:
    """The order of the watchdog's stop: diagnosis, verdict, dump, then os._exit."""
    from nansentinel.config import SentinelConfig
    from nansentinel.result import ExchangeTimeoutError, RankIdentity

    events: list[str] = []
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "trace_"))
    monkeypatch.setattr(stop, "leave_verdict", lambda *a, **k: events.append("verdict"))
    real_dump = stop.dump_flight_recorder
    monkeypatch.setattr(stop, "dump_flight_recorder",
                        lambda *a: events.append("dump") or real_dump(*a))

    def exit_(code: int) -> None:
        events.append(f"exit {code}")
        raise SystemExit(code)

    monkeypatch.setattr(stop.os, "_exit", exit_)
    exchange = SimpleNamespace(
        backend="nccl", timeout=30.0,
        diagnose=lambda step, cause: ExchangeTimeoutError("no answer from rank 1", [1]),
    )
    identity = RankIdentity(1, 1, 2, "node-b", "cuda:1", "1", "")
    with pytest.raises(SystemExit):
        stop.on_timeout(4, config=SentinelConfig(), identity=identity,
                        exchange=exchange)  # type: ignore[arg-type]
    assert events == ["verdict", "dump", "exit 5"]
    assert (tmp_path / "trace_1").exists()  # not initialised: this rank's own number


def test_an_uncaught_collective_failure_exits_5_after_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook behind ``sys.excepthook``: a diagnosed failure, or a transport error it
    diagnoses now, prints through the previous hook, then ends the process (exit 5 in the
    real run); the loop's own errors, and anything after close(), only print."""
    import sys

    from nansentinel.result import ExchangeTimeoutError

    printed: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(str(value)))
    diagnosed: list[int] = []
    error = ExchangeTimeoutError("no answer from rank 1 (node3)", [1])

    class Exchange:
        world_size = 2
        diagnosis: ExchangeTimeoutError | None = None

        def diagnose(self, step: int, cause: BaseException | None) -> ExchangeTimeoutError:
            diagnosed.append(step)
            self.diagnosis = error
            return error

    exchange = Exchange()
    ended: list[tuple[int, str]] = []
    closed = [False]
    stop.exit_on_failure(exchange, lambda: 6, lambda step, e: ended.append((step, str(e))),
                         lambda: closed[0])  # type: ignore[arg-type]
    first = sys.excepthook
    sys.excepthook(ValueError, ValueError("the loop's own bug"), None)
    assert printed == ["the loop's own bug"] and not ended and not diagnosed
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    sys.excepthook(RuntimeError, gloo, None)
    assert printed[-1] == str(gloo) and diagnosed == [6] and ended == [(6, str(error))]
    # DDP's hook future: torch re-raises the diagnosis as a new RuntimeError; already made.
    wrapped = RuntimeError(f"Got the following error when running the callback: {error}")
    sys.excepthook(RuntimeError, wrapped, None)
    assert diagnosed == [6] and ended[-1] == (6, str(error))
    # A diagnosis stays one after close() (a loop's ``finally`` closed the sentinel)...
    closed[0] = True
    sys.excepthook(RuntimeError, RuntimeError("raised by close()"), None)
    assert len(ended) == 3
    # ...but after a clean close a transport error is no longer the run's.
    exchange.diagnosis = None
    sys.excepthook(RuntimeError, gloo, None)
    assert len(ended) == 3 and diagnosed == [6]
    # A second Sentinel replaces the hook, it does not stack on it.
    stop.exit_on_failure(exchange, lambda: 7, lambda step, e: None, lambda: True)  # type: ignore[arg-type]
    assert sys.excepthook.nansentinel_previous is first.nansentinel_previous  # type: ignore[attr-defined]


def test_the_exit_comes_even_when_the_verdict_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full or read-only run directory must not keep the watchdog's thread from ending
    the process (it would raise there, and the rank would hang on)."""
    from nansentinel.config import SentinelConfig
    from nansentinel.result import ExchangeTimeoutError, RankIdentity

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stop, "leave_verdict", full)

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(stop.os, "_exit", exit_)
    exchange = SimpleNamespace(backend="gloo", timeout=30.0)
    identity = RankIdentity(1, 1, 2, "node-b", "cpu", "1", "")
    with pytest.raises(SystemExit) as info:
        stop.end_failed(4, ExchangeTimeoutError("no answer from rank 0", [0]),
                        config=SentinelConfig(run_dir=str(tmp_path)), identity=identity,
                        exchange=exchange)  # type: ignore[arg-type]
    assert info.value.code == 5


_SIGNAL_SCRIPT = r'''
import os, signal, sys, torch, nansentinel
mode = sys.argv[1]
seen = []
if mode == "user":
    signal.signal(signal.SIGTERM, lambda n, f: seen.append(n))
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
s = nansentinel.Sentinel(model, opt, metrics_port=0)
ours = signal.getsignal(signal.SIGTERM)
def step():
    s.check_batch(torch.ones(1, 2))
    loss = model(torch.ones(1, 2)).sum()
    s.check_loss(loss)
    loss.backward()
    return s.step()
step()
if mode == "cause":  # the launcher says why it stops the workers, then signals them
    from nansentinel.common.verdicts import STORE_GONE, write_stop_cause
    write_stop_cause(os.environ["NANSENTINEL_RUN_DIR"], STORE_GONE,
                     "the rendezvous store at node1:29400 is gone")
if mode != "fork":
    os.kill(os.getpid(), signal.SIGTERM)
    import time
    time.sleep(0.2)  # the signal thread notes it within milliseconds; then the row carries it
if mode == "user":  # the user's handler kept: it ran, and no stop is asked
    print("user", seen == [signal.SIGTERM], step().stop_requested, flush=True)
    s.close()
    sys.exit(0)
if mode == "fork":  # a DataLoader worker's SIGTERM is the worker's, not the rank's
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    import time
    time.sleep(0.3)  # the rank's signal thread would have noted a byte by now
    print("fork", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM,
          step().stop_requested, flush=True)
    s.close()
    sys.exit(0)
if mode == "twice":
    import time
    import nansentinel.effects.stop as stop
    stop.REPEAT_WINDOW_S = 0.3  # a test's window (5 s in a run)
    os.kill(os.getpid(), signal.SIGTERM)  # a copy of the first (the launcher's forward)
    print("copy kept", s.check_batch(torch.ones(1, 2)) is not None, flush=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # a second request ends the process at once
    time.sleep(2)  # (the signal thread's exit takes milliseconds)
    print("still alive", flush=True)
    sys.exit(0)
result = step()
print("asked", result.stop_requested, result.stop_signal, result.applied, flush=True)
try:
    s.check_batch(torch.ones(1, 2))
except nansentinel.StopRequested as exc:
    print("stop", exc.code, exc.step, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
          flush=True)
    raise
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["default", "user", "twice", "fork", "cause"])
def test_sigterm_becomes_a_stop_only_where_the_default_handler_was(mode: str,
                                                                   tmp_path: Path) -> None:
    """With the default handler, SIGTERM becomes a stop after the step that carries it: the
    result says so, the next sentinel call raises StopRequested (exit 143, the default handler
    given back). A handler of the user's own is never replaced. A copy of the signal within
    REPEAT_WINDOW_S (the launcher chain's) changes nothing; a second SIGTERM after it ends the
    process at once, with 143. A launcher that stopped its workers for a cause of its own
    (the rendezvous store is gone) said so first: the verdict names that, not the signal."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    env.pop("NANSENTINEL_RUN_DIR", None)
    if mode == "cause":
        env["NANSENTINEL_RUN_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT, mode], env=env, text=True,
                          capture_output=True, timeout=100)
    lines = proc.stdout.split("\n")
    if mode == "cause":
        from nansentinel.common.verdicts import read_verdicts

        assert proc.returncode == 143, proc.stderr[-3000:]
        [verdict] = read_verdicts(tmp_path).values()
        assert (verdict.outcome, verdict.step, verdict.signal, verdict.message) == (
            "store_gone", 1, 15, "the rendezvous store at node1:29400 is gone; every rank "
            "stopped after step 1")
        assert "asked the run to stop" not in proc.stderr
    elif mode == "default":
        assert proc.returncode == 143, proc.stderr[-3000:]
        assert lines[:2] == ["asked True 15 True", "stop 143 1 True"], proc.stdout
        assert "Traceback" not in proc.stderr
    elif mode == "user":
        assert proc.returncode == 0 and lines[0] == "user True False", proc.stderr[-3000:]
    elif mode == "fork":  # the forked child died by its SIGTERM; the rank was not asked
        assert proc.returncode == 0 and lines[0] == "fork True False", proc.stderr[-3000:]
    else:
        assert proc.returncode == 143, proc.stderr[-3000:]
        assert lines[0] == "copy kept True" and "still alive" not in proc.stdout
