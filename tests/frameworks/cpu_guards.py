"""The two frameworks' CPU refusals, lifted for the seam tests, and nothing else.

Two cells of the framework table do not run on CPU as the frameworks ship (docs/frameworks.md):

- **Accelerate (and the HF Trainer) × FSDP**: ``AcceleratorState`` turns an FSDP plugin into
  ``DistributedType.FSDP`` only for GPU-like distributed types; on CPU ranks (``MULTI_CPU``) it
  drops the plugin without a word and trains with DDP. :func:`accelerate_fsdp_on_cpu` sets the
  two fields that branch would have set (``distributed_type``, ``fsdp_plugin``) after
  Accelerate's own ``__init__``; from there on everything is Accelerate's and the Trainer's
  real FSDP2 path (``fully_shard`` on the layers and the root, its optimizer, clipping,
  ``no_sync``), on gloo.
- **Lightning × DeepSpeed**: ``DeepSpeedStrategy.setup_environment`` raises unless the
  accelerator is CUDA. :func:`lightning_deepspeed_on_cpu` skips that one check; the strategy
  is then given indexed CPU devices (``cpu:0``, ``cpu:1``: :func:`indexed_cpus`), because it
  reads each rank's device index, as a CUDA device has one, to check it against the local rank
  and to hand it to ``deepspeed.initialize``. The strategy, its precision plugin,
  ``deepspeed.initialize`` and the engine are Lightning's and DeepSpeed's own, on DeepSpeed's
  CPU accelerator (``DS_ACCELERATOR=cpu``).

- **Lightning × FSDP1** (``strategy="fsdp"``): the accelerator connector refuses ``"fsdp"``
  (and an ``FSDPStrategy`` of exactly that type) unless the accelerator is CUDA, and the
  strategy wraps with ``device_id=root_device.index`` (None on CPU, which FSDP1 refuses: "FSDP
  needs a non-CPU accelerator device"). :func:`lightning_fsdp_on_cpu` hands the connector an
  instance of a subclass, which that one check does not match, whose ``_setup_model`` wraps
  the model as Lightning's does but with ``device_id=torch.device("cpu")`` and then hands it to
  Lightning's own (which keeps a wrapped model as it is); the rest of ``FSDPStrategy`` (its
  optimizer setup, ``clip_gradients``, precision plugin, ``no_sync``) runs unchanged, on gloo.

The GPU script (bench/gpu_frameworks.py) runs the same workers without these patches.
"""

from __future__ import annotations

from typing import Any


def accelerate_fsdp_on_cpu() -> None:
    """Accelerate keeps an FSDP plugin on CPU ranks (see the module docstring)."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    if getattr(init, "nansentinel_cpu_guard", False):
        return

    def patched(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    patched.nansentinel_cpu_guard = True  # type: ignore[attr-defined]
    state.AcceleratorState.__init__ = patched  # type: ignore[method-assign]


def lightning_deepspeed_on_cpu() -> None:
    """Lightning's DeepSpeedStrategy sets up its environment on CPU (see the docstring)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    def setup_environment(self: Any) -> None:
        # What DeepSpeedStrategy's own does after its CUDA check: its parent's.
        super(DeepSpeedStrategy, self).setup_environment()

    DeepSpeedStrategy.setup_environment = setup_environment  # type: ignore[method-assign]


def lightning_fsdp_on_cpu(**kwargs: Any) -> Any:
    """Lightning's ``FSDPStrategy(**kwargs)``, past the connector's CUDA check (see the module
    docstring)."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        """``FSDPStrategy``, wrapping on the CPU device (see the module docstring)."""

        def _setup_model(self, model: Any) -> Any:
            wrapped = FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                **self.kwargs)
            return super()._setup_model(wrapped)

    return CPUFSDPStrategy(**kwargs)


def indexed_cpus(count: int) -> list[Any]:
    """``cpu:0 .. cpu:count-1``: CPU devices with the index DeepSpeedStrategy reads."""
    import torch

    return [torch.device("cpu", i) for i in range(count)]


def deepspeed_without_toolchain() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at init (used only by its
    inference all-reduce): marked not compatible, as in tests/distributed/workers_deepspeed.py,
    so that no C++ toolchain is needed."""
    import deepspeed.ops

    vars(deepspeed.ops)["__compatible_ops__"] = {"deepspeed_shm_comm": False}
