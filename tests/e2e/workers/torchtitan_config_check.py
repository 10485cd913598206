"""How ``with_sentinel`` meets torchtitan's config machinery, in one process (no ranks): the
registry function found by torchtitan's own ConfigManager from ``--module/--config``, CLI
overrides on top, and every refusal with the field it names. Prints one JSON object."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from tests.e2e import torchtitan_cpu

torchtitan_cpu.apply()

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from nansentinel.config import ConfigError  # noqa: E402
from nansentinel.result import SentinelUsageError  # noqa: E402
from nansentinel.torchtitan import SentinelTrainer, with_sentinel  # noqa: E402


class OtherTrainer(Trainer):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        extra: int = 0


def error(fn: Any) -> str:
    try:
        fn()
    except (SentinelUsageError, ConfigError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    parsed = ConfigManager().parse_args([
        "--module", "torchtitan_registry", "--config", "sentinel_debugmodel",
        "--training.steps", "7",
    ])
    out["type"] = type(parsed).__qualname__
    out["owner"] = type(parsed)._owner.__qualname__
    out["steps"] = parsed.training.steps
    out["cuda_graphs_off"] = parsed.training.disable_cuda_graphs
    out["sentinel"] = parsed.sentinel
    base = llama3_debugmodel()
    made = with_sentinel(base, policy="abort")
    out["input_untouched"] = base.training.disable_cuda_graphs is False
    out["merged"] = with_sentinel(made, max_consecutive_skips=2).sentinel
    out["rollback"] = error(lambda: with_sentinel(llama3_debugmodel(), policy="rollback"))
    out["grad_spike"] = error(
        lambda: with_sentinel(llama3_debugmodel(), grad_spike_action="rollback"))
    os.environ["NANSENTINEL_LOSS_SPIKE_ACTION"] = "rollback"
    out["env_rollback"] = error(lambda: with_sentinel(llama3_debugmodel()))
    del os.environ["NANSENTINEL_LOSS_SPIKE_ACTION"]
    out["lr_jump"] = error(lambda: with_sentinel(llama3_debugmodel(), lr_jump_ratio=4.0))
    os.environ["NANSENTINEL_LR_JUMP_RATIO"] = "4"
    out["env_lr_jump"] = error(lambda: with_sentinel(llama3_debugmodel()))
    del os.environ["NANSENTINEL_LR_JUMP_RATIO"]
    out["lr_jump_off"] = error(lambda: with_sentinel(llama3_debugmodel(), lr_jump_ratio=0.0))
    pp = llama3_debugmodel()
    pp.parallelism.pipeline_parallel_degree = 2
    out["pipeline"] = error(lambda: with_sentinel(pp))
    pp.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    out["pipeline_schedule"] = error(lambda: with_sentinel(pp))
    pp.parallelism.pipeline_parallel_schedule = "GPipe"
    pp.validator.enable = True
    out["pipeline_validator"] = error(lambda: with_sentinel(pp))
    out["typo"] = error(lambda: with_sentinel(llama3_debugmodel(), polcy="skip"))
    out["other_trainer"] = error(lambda: with_sentinel(OtherTrainer.Config()))
    graphs = ConfigManager().parse_args([
        "--module", "torchtitan_registry", "--config", "sentinel_debugmodel",
        "--training.no-disable-cuda-graphs",
    ])
    out["cuda_graphs"] = error(lambda: SentinelTrainer(graphs))
    staged = ConfigManager().parse_args([
        "--module", "torchtitan_registry", "--config", "sentinel_debugmodel",
        "--parallelism.pipeline-parallel-degree", "2",
        "--parallelism.pipeline-parallel-schedule", "DualPipeV",
    ])
    out["pipeline_cli"] = error(lambda: SentinelTrainer(staged))
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
