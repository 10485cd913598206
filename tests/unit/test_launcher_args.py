"""``nansentinel run`` arguments, worker environment, hook formatting, exit-code mapping.

Nothing here launches a worker; the launches are in tests/e2e/test_launcher.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nansentinel.common import exitcodes
from nansentinel.common.verdicts import (
    RankVerdict,
    archive_verdicts,
    outcome_from_verdicts,
    read_verdicts,
    write_verdict,
)
from nansentinel.launcher import run as launcher
from nansentinel.launcher.on_exclude import check_hook, format_hook, run_hook
from nansentinel.launcher.run import main, split_argv


@pytest.mark.parametrize(
    ("argv", "ours", "theirs"),
    [
        (["--nnodes=2", "train.py"], [], ["--nnodes=2", "train.py"]),
        (
            ["--metrics-port", "9500", "--host-strikes=2", "--nnodes=2:3", "train.py", "--lr=1"],
            ["--metrics-port", "9500", "--host-strikes=2"],
            ["--nnodes=2:3", "train.py", "--lr=1"],
        ),
        # The first unknown argument ends ours; later look-alikes belong to torchrun/script.
        (
            ["--job-id", "j", "--standalone", "train.py", "--job-id", "mine"],
            ["--job-id", "j"],
            ["--standalone", "train.py", "--job-id", "mine"],
        ),
        # No abbreviations: --metrics is not --metrics-port.
        (["--metrics", "1", "t.py"], [], ["--metrics", "1", "t.py"]),
        (["--on-exclude", "kubectl cordon {host}", "t.py"],
         ["--on-exclude", "kubectl cordon {host}"], ["t.py"]),
        (["--report_dir=/r", "-h"], ["--report_dir=/r", "-h"], []),
    ],
)
def test_split_argv(argv: list[str], ours: list[str], theirs: list[str]) -> None:
    assert split_argv(argv) == (ours, theirs)


def test_torchrun_options_pass_through_unchanged() -> None:
    """What reaches torchrun's parser is byte-for-byte what the user wrote."""
    from torch.distributed.run import parse_args

    torch_part = ["--nnodes=1:4", "--max-restarts=3", "--monitor-interval", "0.25",
                  "--rdzv-conf=join_timeout=5", "--standalone", "train.py", "--epochs", "2"]
    _, theirs = split_argv(["--exclusion-file=/x", "--host-strikes", "4", *torch_part])
    assert theirs == torch_part
    args = parse_args(theirs)
    assert (args.max_restarts, args.monitor_interval, args.nnodes) == (3, 0.25, "1:4")
    assert args.training_script_args == ["--epochs", "2"]


def test_help_shows_our_options_then_torchruns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == exitcodes.EXIT_OK
    out = capsys.readouterr().out
    ours = out.index("--exclusion-file")
    theirs = out.index("\ntorchrun options:")
    assert ours < theirs < out.index("--max-restarts")
    assert theirs < out.index("--rdzv-endpoint")
    assert "NANSENTINEL_METRICS_PORT" in out and "--on-exclude" in out


def test_help_among_torchrun_options_shows_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--standalone", "--help"]) == exitcodes.EXIT_OK
    out = capsys.readouterr().out
    assert "--host-strikes" in out and "--max-restarts" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--host-strikes", "0", "--standalone", "t.py"],
         "host_strikes=0 must be >= 1 (from --host-strikes)"),
        (["--metrics-port", "70000", "--standalone", "t.py"], "metrics_port=70000"),
        (["--exchange-timeout", "soon", "t.py"], "invalid float value"),
        (["--standalone", "--host-strikes", "2", "t.py"], "must come before all torchrun options"),
        (["--on-exclude", "drain {node}", "t.py"], "only {host} and {reason}"),
        (["--on-exclude", "drain {host", "t.py"], "malformed"),
        (["--nnodes=3:1", "t.py"], "nodes"),  # torch's words differ by release
        (["--nnodes=a:b:c", "t.py"], "nnodes=a:b:c"),  # the value, not torch's wording
        (["--metrics-port"], "expected one argument"),
        (["--standalone"], "training_script"),
    ],
)
def test_bad_options_are_config_errors_without_traceback(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == exitcodes.EXIT_CONFIG
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_worker_env_flags_override_and_job_id_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NANSENTINEL_METRICS_PORT", "9000")
    monkeypatch.delenv("NANSENTINEL_JOB_ID", raising=False)
    opts = launcher.build_parser().parse_args(["--metrics-port", "9500", "--host-strikes=2"])
    env = launcher._worker_env(opts, "rdzv-42")
    assert env == {
        "NANSENTINEL_METRICS_PORT": "9500",
        "NANSENTINEL_HOST_STRIKES": "2",
        "NANSENTINEL_JOB_ID": "rdzv-42",
    }
    assert "overrides NANSENTINEL_METRICS_PORT=9000" in capsys.readouterr().err
    monkeypatch.setenv("NANSENTINEL_JOB_ID", "users-own")
    opts = launcher.build_parser().parse_args([])
    assert launcher._worker_env(opts, "rdzv-42") == {"NANSENTINEL_JOB_ID": "users-own"}


def test_standalone_is_resolved_like_torchrun_does() -> None:
    from torch.distributed.run import parse_args

    args = parse_args(["--standalone", "t.py"])
    launcher._resolve_standalone(args)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:0")
    args = parse_args(["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "t.py"])
    launcher._resolve_standalone(args)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "h:1")


HOSTILE = [
    "evil$(touch${IFS}pwned)",
    "`touch pwned`",
    "a'b\"c",
    "x; touch pwned; echo",
    "line1\nline2",
    "h" * 5000,
    "nœud-ünïcode-节点",
    "{reason}",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hook_runs_without_a_shell_with_the_literal_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    # The operator's habit: fields inside double quotes, as in a shell command line.
    template = (
        f"{sys.executable} -c 'import sys, os, pathlib; pathlib.Path(sys.argv[1]).write_text("
        f"repr([sys.argv[2:], os.environ[\"NANSENTINEL_EXCLUDED_HOST\"], "
        f"os.environ[\"NANSENTINEL_EXCLUSION_REASON\"]]))' {out} \"excluded-{{host}}\" {{reason}}"
    )
    assert check_hook(template) is None
    assert run_hook(template, value, f"why: {value}") == 0
    expected = [[f"excluded-{value}", f"why: {value}"], value, f"why: {value}"]
    assert out.read_text() == repr(expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing else ran


def test_hook_arguments_are_split_before_substitution() -> None:
    assert format_hook("kubectl cordon {host}", "node-1", "r") == ["kubectl", "cordon", "node-1"]
    assert format_hook('touch "excluded-{host}"', "a b;$(x)", "r") == ["touch", "excluded-a b;$(x)"]
    assert format_hook("echo {{literal}} {reason}", "h", "two words") == [
        "echo", "{literal}", "two words",
    ]


def test_a_shell_is_used_only_when_named(tmp_path: Path) -> None:
    out = tmp_path / "hook.txt"
    template = f'sh -c \'printf "%s" "$NANSENTINEL_EXCLUDED_HOST" > {out}\''
    assert run_hook(template, "evil$(touch pwned)", "r") == 0
    assert out.read_text() == "evil$(touch pwned)"
    assert not (tmp_path / "pwned").exists()


def test_hook_template_problems_are_named() -> None:
    assert "malformed" in (check_hook("echo 'unclosed {host}") or "")
    assert "{nope}" in (check_hook("echo {nope}") or "")
    assert "empty" in (check_hook("   ") or "")


def test_missing_hook_program_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_hook("/nonexistent/hook {host}", "h", "r") is None
    assert "could not be started" in capsys.readouterr().err


def test_failing_hook_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_hook("sh -c 'exit 7'", "h", "r") == 7
    assert "exited with status 7" in capsys.readouterr().err
    assert run_hook(None, "h", "r") is None


def test_hook_timeout_is_bounded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("nansentinel.launcher.on_exclude.HOOK_TIMEOUT_S", 0.5)
    assert run_hook("sleep 30", "h", "r") is None
    assert "did not finish" in capsys.readouterr().err


# -- verdict files -> exit code ----------------------------------------------------------------


def _verdict(rank: int, outcome: str, excluded: str | None = None) -> RankVerdict:
    return RankVerdict(rank=rank, local_rank=rank % 2, hostname=f"node{rank // 2}", step=5,
                       outcome=outcome, message=f"{outcome} at step 5", bad_ranks=[1],
                       bad_hosts=["node0"], kinds=["loss"], excluded_host=excluded)


@pytest.mark.parametrize(
    ("outcomes", "host", "code"),
    [
        ({}, "node0", exitcodes.EXIT_WORKER_FAILED),
        ({0: ("aborted", None), 1: ("aborted", None)}, "node0", exitcodes.EXIT_NONFINITE_ABORT),
        ({0: ("exchange_timeout", None)}, "node0", exitcodes.EXIT_EXCHANGE_TIMEOUT),
        ({0: ("excluded", "node1"), 2: ("excluded", "node1")}, "node1",
         exitcodes.EXIT_HOST_EXCLUDED),
        # Another host was excluded and no restart is left: the run stopped on non-finite.
        ({0: ("excluded", "node1")}, "node0", exitcodes.EXIT_NONFINITE_ABORT),
        # An abort outranks the timeouts it causes.
        ({0: ("exchange_timeout", None), 1: ("aborted", None)}, "node0",
         exitcodes.EXIT_NONFINITE_ABORT),
        ({0: ("something_new", None)}, "node0", exitcodes.EXIT_WORKER_FAILED),
    ],
)
def test_exit_code_from_verdict_files(
    tmp_path: Path, outcomes: dict[int, tuple[str, str | None]], host: str, code: int
) -> None:
    for rank, (outcome, excluded) in outcomes.items():
        write_verdict(tmp_path, _verdict(rank, outcome, excluded))
    result = outcome_from_verdicts(read_verdicts(tmp_path), host)
    assert result.exit_code == code
    assert result.explanation


def test_verdict_files_are_atomic_readable_and_archived(tmp_path: Path) -> None:
    odd = dataclasses.replace(_verdict(3, "aborted"), report_path=object())  # type: ignore[arg-type]
    path = write_verdict(tmp_path, odd)  # a value JSON cannot hold is written as its str()
    assert path == tmp_path / "verdicts" / "rank-3.json"
    (tmp_path / "verdicts" / "rank-4.json").write_text("{torn")
    (tmp_path / "verdicts" / "rank-5.json").write_text('{"outcome": "aborted", "step": "x"}')
    (tmp_path / "verdicts" / "notes.txt").write_text("ignored")
    verdicts = read_verdicts(tmp_path)
    assert list(verdicts) == [3] and verdicts[3].outcome == "aborted"
    assert verdicts[3] == dataclasses.replace(odd, report_path=verdicts[3].report_path)
    assert str(verdicts[3].report_path).startswith("<object object at")
    assert [p.name for p in (tmp_path / "verdicts").iterdir() if p.name.startswith(".")] == []
    assert archive_verdicts(tmp_path) == tmp_path / "verdicts.attempt-0"
    write_verdict(tmp_path, _verdict(0, "aborted"))
    assert archive_verdicts(tmp_path) == tmp_path / "verdicts.attempt-1"
    assert read_verdicts(tmp_path) == {} and archive_verdicts(tmp_path) is None


def test_exit_codes_are_the_documented_contract() -> None:
    assert (exitcodes.EXIT_OK, exitcodes.EXIT_WORKER_FAILED, exitcodes.EXIT_CONFIG,
            exitcodes.EXIT_NONFINITE_ABORT, exitcodes.EXIT_HOST_EXCLUDED,
            exitcodes.EXIT_EXCHANGE_TIMEOUT, exitcodes.EXIT_NONFINITE_STATE, exitcodes.EXIT_SIGINT,
            exitcodes.EXIT_SIGTERM) == (0, 1, 2, 3, 4, 5, 6, 130, 143)
    assert set(exitcodes.NAMES) == {0, 1, 2, 3, 4, 5, 6, 130, 143}
    from nansentinel.launcher.signals import signal_exit_code

    assert signal_exit_code(signal.SIGTERM) == exitcodes.EXIT_SIGTERM
    assert signal_exit_code(signal.SIGINT) == exitcodes.EXIT_SIGINT


#: The sets `nansentinel files` writes out.
LAUNCH = Path(__file__).parents[2] / "nansentinel" / "files"


def test_torchrun_wrapper_script_forwards_arguments(tmp_path: Path) -> None:
    """The torchrun set's wrapper runs ``python -m nansentinel run`` with every argument."""
    script = LAUNCH / "torchrun" / "torchrun-wrapper.sh"
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "<%s>" "$a"; done\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    done = subprocess.run([str(script), "--nnodes=2", "a b", "train.py"], env=env,
                          capture_output=True, text=True, timeout=10, check=True)
    assert done.stdout == "<-m><nansentinel><run><--nnodes=2><a b><train.py>"


def test_sentinel_flags_are_exactly_the_documented_ones() -> None:
    """Guards the CLI surface: a new flag must be documented here and in the manual."""
    flags = {f for a in launcher.build_parser()._actions for f in a.option_strings}
    documented = {"--metrics-port", "--report-dir", "--exclusion-file", "--host-strikes",
                  "--strike-window", "--exchange-timeout", "--job-id", "--on-exclude"}
    aliases = {f.replace("-", "_").replace("__", "--", 1) for f in documented}
    assert flags == documented | aliases | {"-h", "--help"}
    assert all(f in (launcher.__doc__ or "") for f in documented)


# -- the shipped launch scripts ------------------------------------------------------------------


def test_slurm_script_runs_one_launcher_per_node_with_the_right_options(tmp_path: Path) -> None:
    """Run the sbatch script with stand-ins for srun, scontrol and nansentinel: the one
    launcher per node gets the sentinel's options first, the store apart (is_host=0) and the
    job's rendezvous id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        # srun: drop its own options, run the task as each of the 4 nodes would.
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                'for n in 7 8 9 10; do SLURMD_NODENAME=gpu-node-$n "$@" || exit; done\n',
        "scontrol": 'printf "gpu-head\\ngpu-node-7\\n"\n',
        # excluded: nothing excluded; store: listen on 29400; run: print what it was given.
        "nansentinel": 'case $1 in\n'
                       '  excluded) exit 0 ;;\n'
                       '  store) for a in "$@"; do case $a in --port-file=*)'
                       ' echo 29400 > "${a#--port-file=}";; esac; done; exec sleep 30 ;;\n'
                       'esac\n'
                       'echo "host=$NANSENTINEL_HOSTNAME"\n'
                       'for a in "$@"; do printf "<%s>\\n" "$a"; done\n',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "4",
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu-[head,node-7]",
           "SLURM_GPUS_PER_NODE": "8", "RDZV_HOST": "gpu-head",
           "SHARED": str(tmp_path / "shared")}
    done = subprocess.run(["bash", str(LAUNCH / "slurm" / "nansentinel.sbatch"), "train.py",
                           "--lr", "0.1"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [x for x in lines if x.startswith("host=")] == [
        f"host=gpu-node-{n}" for n in (7, 8, 9, 10)]
    args = [line[1:-1] for line in lines[1:lines.index("host=gpu-node-8")]]
    assert args[0] == "run"
    assert f"--exclusion-file={tmp_path}/shared/excluded.jsonl" in args
    assert any(a.startswith("--on-exclude=") and "{host}" in a for a in args)
    assert {"--nnodes=3:4", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-head:29400",
            "--rdzv-conf=is_host=0", "--rdzv-id=77", "--nproc-per-node=8"} <= set(args)
    assert args[-3:] == ["train.py", "--lr", "0.1"]
    # Sentinel options come before torchrun's, as `nansentinel run` requires.
    ours, theirs = split_argv(args[1:])
    assert theirs[0] == "--nnodes=3:4" and len(ours) == 4


def test_kubernetes_job_wires_node_name_metrics_ports_and_exit_codes() -> None:
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((LAUNCH / "kubernetes" / "train-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    pod = job["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert all(name in env for name in ("NANSENTINEL_HOST_STRIKES", "NANSENTINEL_POLICY"))
    nproc = int(next(a for a in args if a.startswith("--nproc-per-node=")).split("=")[1])
    base = int(next(a for a in args if a.startswith("--metrics-port=")).split("=")[1])
    metrics = {p["name"]: p["containerPort"] for p in container["ports"]
               if p["name"].startswith("metrics-")}
    assert metrics == {f"metrics-{i}": base + i for i in range(nproc)}
    assert pod["metadata"]["labels"]["nansentinel.io/metrics"] == "true"
    ours, theirs = split_argv(args)
    assert "--on-exclude=kubectl cordon {host}" in ours and theirs[0].startswith("--nnodes=")
    policy = {r["onExitCodes"]["values"][0]: r["action"]
              for r in job["spec"]["podFailurePolicy"]["rules"]}
    assert policy == {exitcodes.EXIT_CONFIG: "FailJob", exitcodes.EXIT_HOST_EXCLUDED: "Ignore"}
    assert pod["spec"]["restartPolicy"] == "Never"


def test_host_names_become_short_distinct_file_names() -> None:
    assert launcher.file_safe("node-1.cluster") == "node-1.cluster"
    long_a, long_b = "a" * 300 + "1", "a" * 300 + "2"
    assert len(launcher.file_safe(long_a)) < 80
    assert launcher.file_safe(long_a) != launcher.file_safe(long_b)
    hostile = launcher.file_safe("evil/$(x)\nnœud")
    assert "/" not in hostile and "\n" not in hostile and hostile.isascii()


def test_static_rendezvous_on_several_nodes_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--report-dir", str(tmp_path / "r"), "--nnodes=2", "--rdzv-backend=static",
                 "--node-rank=0", "--master-addr=127.0.0.1", "--master-port=29999",
                 "--nproc-per-node=1", "train.py"])
    assert code == exitcodes.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "--rdzv-backend=static with several nodes cannot keep an excluded host out" in err
    assert not list((tmp_path / "r").rglob("nansentinel-run-*"))  # nothing left behind


def test_the_store_host_is_recognised_and_its_exclusion_ends_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from nansentinel.common.exclusion import ExclusionRecord
    from nansentinel.launcher.rendezvous_guard import (
        ExclusionGuard,
        GuardedRendezvousHandler,
        serves_store,
    )

    def params(endpoint: str, **conf: object) -> RendezvousParameters:
        return RendezvousParameters("c10d", endpoint, "job", 1, 2, **conf)

    assert serves_store(params(f"{socket.gethostname()}:29400"))
    assert serves_store(params("127.0.0.1:29400"))
    assert not serves_store(params("203.0.113.9:29400"))  # another machine (TEST-NET-3)
    assert serves_store(params("203.0.113.9:29400", is_host=True))

    class Inner:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def shutdown(self) -> bool:
            self.calls.append("shutdown")
            return True

    guard = ExclusionGuard("node1", tmp_path, None, "job")
    guard.excluded = ExclusionRecord(host="node1", reason="r", step=3)
    inner = Inner()
    assert GuardedRendezvousHandler(inner, guard, store_host=True).shutdown()
    assert inner.calls == ["shutdown"]  # closed for everyone, not left quietly
    assert "runs the rendezvous store" in capsys.readouterr().err


_AGENT = """
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from nansentinel.launcher.rendezvous_guard import (
    ExclusionGuard, _create_guarded_handler, _GUARD_KEY, _INNER_BACKEND_KEY,
)
params = RendezvousParameters(
    "nansentinel", sys.argv[1], "job", 1, 2,
    **{_INNER_BACKEND_KEY: "c10d", _GUARD_KEY: ExclusionGuard("node", sys.argv[2], None, None)},
)
handler = _create_guarded_handler(params)
print("serves" if handler.store_host else "client", flush=True)
sys.stdin.readline()  # keep the store up until the test is done
"""


def test_of_two_agents_sharing_the_store_address_exactly_one_serves_it(
    tmp_path: Path, free_port  # type: ignore[no-untyped-def]
) -> None:
    """Issue 20, item 11: both agents' hostnames match the endpoint, so torch's intent says
    both host the store; only the first binds the port. The one that did serves it, and only
    its exclusion ends the job."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents: list[subprocess.Popen[str]] = []
    try:
        answers = []
        for i in range(2):  # one after the other: the first has bound when the second starts
            with (tmp_path / f"agent{i}.err").open("w") as err:
                agent = subprocess.Popen(
                    [sys.executable, "-c", _AGENT, endpoint, str(tmp_path)], text=True,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                )
            agents.append(agent)
            assert agent.stdout is not None
            answers.append(agent.stdout.readline().strip())
        errors = [(tmp_path / f"agent{i}.err").read_text() for i in range(2)]
        assert answers == ["serves", "client"], errors
    finally:
        for agent in agents:
            agent.kill()
            agent.communicate(timeout=10)


def test_the_run_directory_under_the_report_dir_is_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NANSENTINEL_RUN_DIR", raising=False)
    reports = tmp_path / "fresh" / "reports"
    made, created = launcher._make_run_dir(str(reports), "node-1")
    assert created and made.parent == reports / "runs"
    for d in (tmp_path / "fresh", reports, reports / "runs", made):
        assert d.stat().st_mode & 0o077 == 0, (d, oct(d.stat().st_mode))


def test_a_stop_a_signal_asked_for_is_128_plus_the_signal(tmp_path: Path) -> None:
    """Every rank stopped after the same step for a SIGTERM (SIGINT): the launcher's code is
    the signal's (143, 130), read back from the verdict files; a timeout beside it wins."""
    for rank in (0, 1):
        write_verdict(tmp_path, dataclasses.replace(_verdict(rank, "stopped"),
                                                    signal=int(signal.SIGTERM)))
    assert outcome_from_verdicts(read_verdicts(tmp_path), "node0").exit_code == 143
    write_verdict(tmp_path, dataclasses.replace(_verdict(0, "stopped"), signal=2))
    write_verdict(tmp_path, dataclasses.replace(_verdict(1, "stopped"), signal=2))
    assert outcome_from_verdicts(read_verdicts(tmp_path), "node0").exit_code == 130
    write_verdict(tmp_path, _verdict(1, "exchange_timeout"))
    assert outcome_from_verdicts(read_verdicts(tmp_path), "node0").exit_code == 5
    # The launchers stopped the run for a store that is gone: 5, in the ranks' own words.
    gone = dataclasses.replace(_verdict(0, "store_gone"), signal=15,
                               message="the rendezvous store at node1:29400 is gone")
    write_verdict(tmp_path, gone)
    outcome = outcome_from_verdicts(read_verdicts(tmp_path), "node0")
    assert (outcome.exit_code, outcome.explanation) == (
        5, "the rendezvous store at node1:29400 is gone")
