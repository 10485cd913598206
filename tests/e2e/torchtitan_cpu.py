"""Run torchtitan 0.3.0's own trainer on CPU ranks (gloo), for the end-to-end test.

torchtitan has no CPU mode; what only a GPU has is patched here, at start-up, before any other
torchtitan module is imported (they copy ``device_type`` and ``device_module`` at import):

- the device: ``cpu``, with a device module that has the memory-stat calls torchtitan makes;
- ``minimal_async_ep.kernels`` (MoE expert parallel only) imports triton unconditionally: a
  stub module stands in for it (a fake ``triton`` package would break torch itself);
- compiled FlexAttention has no CPU backward: the eager op, with its CPU check lifted;
- FSDP reduces with PREMUL_SUM at torchtitan's divide factor 1.0, which gloo rejects: a plain
  sum is forced (identical at factor 1.0);
- ``torch.distributed.set_timeout`` is missing in torch 2.13: the private setter stands in;
- torchtitan hands its pipeline schedule micro-batches already split
  (``step(arg_mbs=, kwarg_mbs=, target_mbs=)``, trainer.py and validate.py), which torch 2.13's
  ``step(*args, target=, **kwargs)`` takes as one whole batch to split: those keywords are
  run as the micro-batches they are (:func:`_patch_pipeline_step`). Not a device patch: an API
  torch 2.13 lacks, needed on a GPU too.

:func:`write_assets` builds what the network would have given: a small byte-level BPE
tokenizer with Llama 3's special tokens and a c4-style JSONL dataset.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

_applied = False


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the CUDA-only calls torchtitan makes (memory stats, device index)."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        """One CPU device: nothing to select."""

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 34)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        """No peak statistics on CPU."""

    @staticmethod
    def empty_cache() -> None:
        """No caching allocator on CPU."""

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU work is synchronous."""


#: What torchtitan.distributed.minimal_async_ep.api imports from its triton kernels.
_KERNELS = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel", "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    def missing(attr: str) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name}.{attr} needs triton (MoE expert parallel on a GPU)")
        return kernel

    stub = types.ModuleType(name)
    for attr in _KERNELS:
        setattr(stub, attr, missing(attr))
    sys.modules[name] = stub


def _patch_pipeline_step() -> None:
    """torch 2.13's ``PipelineScheduleSingle.step`` and ``PipelineScheduleMulti.step``
    (schedules.py) split a whole batch into micro-batches, and put any other keyword into the
    model's kwargs: torchtitan 0.3.0's ``arg_mbs``/``kwarg_mbs``/``target_mbs`` became one
    model kwarg each ("Expecting 2 arg_mbs but got 1"). Given those keywords, the step does
    what torch's does less the split: the per-step reset of each stage, then
    ``_step_microbatches`` on the lists as given (``eval`` goes through ``step``)."""
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        split = cls.step

        def step(self: Any, *args: Any, arg_mbs: list[Any] | None = None,
                 kwarg_mbs: list[Any] | None = None, target_mbs: list[Any] | None = None,
                 losses: list[Any] | None = None, return_outputs: bool = True,
                 loss_kwargs: dict[str, Any] | None = None, _split: Any = split,
                 **kwargs: Any) -> Any:
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _split(self, *args, losses=losses, return_outputs=return_outputs,
                              loss_kwargs=loss_kwargs, **kwargs)
            if args or kwargs:
                raise TypeError("step: micro-batches (arg_mbs/kwarg_mbs/target_mbs) and a "
                                f"whole batch at once ({len(args)} args, {sorted(kwargs)})")
            if self._has_backward and not torch.is_grad_enabled():
                raise RuntimeError("step() with a backward under torch.no_grad(): use eval()")
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                    loss_kwargs=loss_kwargs)
            for stage in stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

        cls.step = step  # type: ignore[method-assign]


def apply() -> None:
    """Patch torchtitan for CPU ranks; call it before anything else of torchtitan is imported."""
    global _applied
    if _applied:
        return
    _applied = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = c10d._set_pg_timeout  # type: ignore[attr-defined]
    _patch_pipeline_step()

    from torchtitan.tools import utils

    utils.device_type, utils.device_module = "cpu", _CpuDeviceModule()
    _stub_triton_kernels()

    import torch.nn.attention.flex_attention as flex

    checked = flex._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "cpu":
            checked(query, key, value)

    flex._validate_device = validate_device
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask

    from torchtitan.distributed import fsdp

    divide = fsdp.disable_fsdp_gradient_division

    def disable_division(model: torch.nn.Module) -> None:
        divide(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division


#: Llama 3's special tokens, which torchtitan's tokenizer reads from tokenizer_config.json.
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_TEXT = ("the model trains on a small corpus of plain words so that every rank reads "
         "different lines of text and the loss goes down a little between the steps")
_WORDS = _TEXT.split(" ")


def write_assets(root: Path, *, lines: int = 400) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer (vocabulary well under the debug model's 2048) and a c4-style
    JSONL dataset (``{"text": ...}`` per line); returns (tokenizer dir, dataset dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [" ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(40 + i % 17))
             for i in range(lines)]
    data = root / "c4_tiny"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assets = root / "tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True} for t in (BOS, EOS)
        },
    }))
    return assets, data
