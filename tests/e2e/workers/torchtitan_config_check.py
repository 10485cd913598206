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
    out.update(fault_tolerant())
    return out


def fault_tolerant() -> dict[str, Any]:
    """torchtitan's fault-tolerant trainer's config (torchtitan/experiments/torchft)."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.experiments.torchft.llama3.config_registry import (
        llama3_torchft_debugmodel,
    )

    from nansentinel.torchtitan import SentinelFTTrainer

    def synchronous() -> Any:
        config = llama3_torchft_debugmodel()
        config.fault_tolerance = dataclasses.replace(config.fault_tolerance,
                                                     semi_sync_method=None)
        return config

    out: dict[str, Any] = {}
    parsed = ConfigManager().parse_args([
        "--module", "torchtitan_registry", "--config", "sentinel_ft_debugmodel",
        "--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2",
    ])
    out["ft_type"] = type(parsed).__qualname__
    out["ft_owner"] = type(parsed)._owner.__qualname__
    out["ft_optimizer"] = type(parsed.optimizer).__qualname__
    out["ft_optimizer_owner"] = type(parsed.optimizer)._owner.__qualname__
    out["ft_param_groups"] = (parsed.optimizer.param_groups
                              == llama3_torchft_debugmodel().optimizer.param_groups)
    out["ft_replica"] = [parsed.fault_tolerance.replica_id, parsed.fault_tolerance.group_size]
    # torchft's init_sync: on by default, off with the docs' flag (torchtitan has none).
    out["ft_init_sync"] = parsed.fault_tolerance.init_sync
    out["ft_no_init_sync"] = ConfigManager().parse_args([
        "--module", "torchtitan_registry", "--config", "sentinel_ft_debugmodel",
        "--fault_tolerance.no-init-sync"]).fault_tolerance.init_sync
    out["ft_manager_owner"] = type(parsed.fault_tolerance)._owner.__qualname__
    out["ft_diloco"] = error(lambda: with_sentinel(llama3_torchft_debugmodel()))
    plain = synchronous()
    plain.optimizer = OptimizersContainer.Config(param_groups=plain.optimizer.param_groups)
    out["ft_plain_optimizer"] = error(lambda: with_sentinel(plain))
    staged = synchronous()
    staged.parallelism.pipeline_parallel_degree = 2
    out["ft_pipeline"] = error(lambda: with_sentinel(staged))
    unsharded = synchronous()
    unsharded.parallelism.data_parallel_shard_degree = 1
    out["ft_unsharded"] = error(lambda: with_sentinel(unsharded))
    off = synchronous()
    off.fault_tolerance.enable = False
    out["ft_off"] = error(lambda: with_sentinel(off))
    local_sgd = ConfigManager().parse_args([
        "--module", "torchtitan_registry", "--config", "sentinel_ft_debugmodel",
        "--fault_tolerance.semi_sync_method", "local_sgd",
    ])
    out["ft_cli_local_sgd"] = error(lambda: SentinelFTTrainer(local_sgd))
    # The shard degree as torchtitan resolved it (-1: the group's ranks), on a built trainer.
    import types

    built = SentinelFTTrainer.__new__(SentinelFTTrainer)
    built.ft_manager = types.SimpleNamespace(enabled=True)  # type: ignore[assignment]
    built.parallel_dims = types.SimpleNamespace(dp_shard=1)  # type: ignore[assignment]
    out["ft_one_rank_group"] = error(lambda: built._watch({}))
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
