"""``python -m torchtitan.train`` on CPU ranks: the test's launcher, run by torchrun.

Applies the CPU patches (tests/e2e/torchtitan_cpu.py) first, then runs torchtitan's own
``torchtitan.train`` module with the arguments as given (``--module REGISTRY --config FN ...``).

With ``TITAN_ARMS="FN:STEPS FN:STEPS"`` the same ranks train once per registry function, one
after the other, as ``torchtitan.train.main`` does (``ConfigManager`` -> ``config.build()`` ->
``train()`` -> ``close()``), each with its own ``--config`` and ``--training.steps``: the
torchft test's arms share these processes, their start-up, and the process group, which is
destroyed after the last. Each arm's torchft manager is shut down before the next (torchtitan
never shuts it down: its process ends); ``FT_START`` gets a folder per arm, ``FT_ARM`` names
it, and a line ``ARM FN`` (rank 0, once the ranks finished the arm before) starts its
output.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from tests.e2e import torchtitan_cpu


def arms(spec: str, argv: list[str]) -> None:
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan_registry import say  # the registry the arms train (--module)

    init_logger()
    start = Path(os.environ["FT_START"])
    for arm in spec.split():
        name, steps = arm.split(":")
        os.environ["FT_ARM"], os.environ["FT_START"] = name, str(start / name)
        Path(os.environ["FT_START"]).mkdir(parents=True, exist_ok=True)
        if torch.distributed.is_initialized():  # the last arm's lines all came before
            torch.distributed.barrier()
        if os.environ["RANK"] == "0":
            say(f"ARM {name}")  # one write: the other rank's output cannot split it
        at = argv.index("--config") + 1
        config = ConfigManager().parse_args(
            [*argv[:at], name, *argv[at + 1:], "--training.steps", steps])
        trainer = None
        try:
            trainer = config.build()  # type: ignore[attr-defined]
            trainer.train()
        except Exception:
            if trainer is not None:
                trainer.close()
            raise
        trainer.close()
        if trainer.ft_manager.enabled:
            trainer.ft_manager.manager.shutdown()
            forget_manager()
    torch.distributed.destroy_process_group()


def forget_manager() -> None:
    """torchft's manager publishes its address in torchrun's store, where the next arm's
    group rank 1 would read the address of the one shut down: rank 0 removes it once both
    ranks shut theirs down (the next arm's barrier orders the rest)."""
    import torch
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    torch.distributed.barrier()
    if os.environ["RANK"] == "0":
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"],
                                           int(os.environ["MASTER_PORT"]), is_master=False)
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)


if __name__ == "__main__":
    torchtitan_cpu.apply()
    if os.environ.get("TITAN_ARMS"):
        arms(os.environ["TITAN_ARMS"], sys.argv[1:])
    else:
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
