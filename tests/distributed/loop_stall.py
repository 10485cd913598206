"""Loop the kill and freeze stall scenarios (issue 11, part 0); print what the live ranks said.

Usage (repo root): PYTHONPATH=$PWD python3 tests/distributed/loop_stall.py kill|stop N
Run beside tests/distributed/cpu_load.py to keep every core busy. The harness limit is 150 s
per run (the tests use 60/90 s), because under that load starting three ranks takes long.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

from tests.distributed.harness import run_ranks
from tests.distributed.workers import stall


def once(how: str, tmp: Path) -> list[object]:
    """The live ranks' messages (or their payloads when they left none)."""
    common = {"report_dir": str(tmp / "r"), "run_dir": str(tmp / "run"),
              "exchange_timeout": 4.0, "timeout": 150, "expect_all": False}
    if how == "kill":
        res = run_ranks(stall, 3, tmp, victim=2, at_step=2, how="kill", **common)
        return [(r.get("value") or {}).get("error") or r for r in res[:2]]
    res = run_ranks(stall, 3, tmp, wait_for=[0, 2], victim=1, at_step=2, how="stop", **common)
    out: list[object] = []
    for rank in (0, 2):
        verdict = tmp / "run" / "verdicts" / f"rank-{rank}.json"
        out.append(json.loads(verdict.read_text())["message"] if verdict.exists() else res[rank])
    return out


def main() -> None:
    how, n = sys.argv[1], int(sys.argv[2])
    expected = "no answer from rank 2 (host2)" if how == "kill" else "no answer from rank 1 (host1)"
    named = 0
    for i in range(n):
        with tempfile.TemporaryDirectory() as d:
            started = time.monotonic()
            said = once(how, Path(d))
            good = all(isinstance(e, str) and expected in e for e in said)
            named += good
            print(f"run {i}: {'OK' if good else 'FAIL'} {time.monotonic() - started:.1f}s",
                  flush=True)
            for e in [] if good else said:
                print("   ", str(e)[:1500], flush=True)
    print(f"{how}: {named}/{n} named")


if __name__ == "__main__":
    main()
