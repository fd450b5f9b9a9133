"""A CPU training engine for verl's engine workers: verl's worker classes, run without a GPU.

verl's ``TrainingWorker`` (the actor, reference and critic inside
``ActorRolloutRefWorker``) delegates every forward and backward pass to an
*engine* it looks up in ``EngineRegistry`` by strategy and device. verl
registers its FSDP engine for ``cuda`` and ``npu`` only. :class:`CpuEngine`
is registered under the same strategy names for ``cpu``: a plain
transformers model (``AutoModelForCausalLM``, or
``AutoModelForTokenClassification`` with one label for the critic, as
verl's value engine uses) whose gradients are averaged over the data-parallel
ranks with gloo, as FSDP averages them. With ``model.lora_rank > 0`` the
actor carries the peft LoRA adapter verl's FSDP engine would put on it (only
the adapter trains) and ``disable_adapter`` gives the base model, which is
how verl's worker computes the reference of a LoRA actor (``no_lora_adapter``).

Everything around the engine is verl's: the worker classes and their
``@register`` dispatch, the no-padding TensorDict protocol, micro-batching
(``prepare_micro_batches``), the PPO and value losses of
``verl.workers.utils.losses`` (which look the policy loss up in verl's
registry, inside the worker), the optimizer and LR schedule builders, and
``FSDPCheckpointManager`` for checkpoints (it saves a model that is not FSDP
as a plain state dict). The worker classes here differ from the GPU ones in
``workers.py`` only in starting a gloo process group and pointing verl at
this engine. The model is small enough for tests and CI; nothing here is
meant to be fast.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed

from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.base import BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from agl_plugin_verl.bridge_worker import BridgeMixin

STRATEGIES = ["fsdp", "fsdp2"]
"""verl strategy names the CPU engine answers for on a ``cpu`` device (verl's own engine has no CPU entry)."""


class CpuEngine(BaseEngine):
    """verl's engine interface over an unsharded transformers model on the CPU."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode: str | None = None
        self.module: torch.nn.Module | None = None
        self.optimizer = None
        self.lr_scheduler = None

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @property
    def is_value_model(self) -> bool:
        return self.model_config.model_type == "value_model"

    @property
    def is_lora(self) -> bool:
        """Whether the model carries a LoRA adapter: ``model.lora_rank > 0``, the test verl's FSDP engine makes."""
        return self.model_config.lora_rank > 0

    def disable_adapter(self):
        """The base model for the block (verl's worker asks for it with ``no_lora_adapter``: the reference)."""
        return self.module.disable_adapter() if self.is_lora else nullcontext()

    def initialize(self) -> None:
        """Load the model from ``model_config.local_path``; unless forward-only, verl's optimizer and a constant LR.

        With ``lora_rank > 0`` the actor gets verl's peft adapter (the one verl's
        FSDP engine makes, from the same keys) and only the adapter trains.

        The LR is verl's constant schedule with ``lr_warmup_steps`` of warm-up
        (``lr_scheduler_type`` is not read: nothing trained on a CPU runs long
        enough for a cosine schedule to matter).
        """
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        from verl.utils.torch_functional import get_constant_schedule_with_warmup
        from verl.workers.config.optimizer import build_optimizer

        path = self.model_config.local_path
        torch.manual_seed(getattr(self.engine_config, "seed", 0))  # a fresh value head is random: reproducible runs
        if self.is_value_model:
            if self.is_lora:
                raise NotImplementedError("the CPU engine puts LoRA on the actor only, not on the critic "
                                          "(critic.model.lora_rank > 0)")
            self.module = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        else:
            self.module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if self.is_lora:
            self.module = _lora_module(self, self.module)
        # Rank 0's weights everywhere (a fresh value head, a fresh adapter's A are random), as FSDP's
        # sync_module_states does.
        for param in self.module.parameters():
            torch.distributed.broadcast(param.data, src=0)
        if self.engine_config.forward_only:
            self.module.requires_grad_(False)
            return
        trainable = [param for param in self.module.parameters() if param.requires_grad]  # the adapter, with LoRA
        self.optimizer = build_optimizer(trainable, self.optimizer_config)
        warmup = max(0, self.optimizer_config.lr_warmup_steps)
        self.lr_scheduler = get_constant_schedule_with_warmup(optimizer=self.optimizer, num_warmup_steps=warmup)

    def train_mode(self, **kwargs) -> BaseEngineCtx:
        return _ModeContext(self, "train", **kwargs)

    def eval_mode(self, **kwargs) -> BaseEngineCtx:
        return _ModeContext(self, "eval", **kwargs)

    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank()

    def get_data_parallel_size(self) -> int:
        return torch.distributed.get_world_size()

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True  # no model parallelism: every rank holds its rows' outputs

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Average the gradients over the ranks, clip them, step unless the norm is not finite; return the norm."""
        world = self.get_data_parallel_size()
        for param in self.module.parameters():
            if param.grad is not None and world > 1:
                torch.distributed.all_reduce(param.grad)
                param.grad /= world
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.optimizer_config.clip_grad)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        return grad_norm.item()

    def lr_scheduler_step(self) -> float:
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    def forward_backward_batch(self, data, loss_function, forward_only=False) -> dict[str, Any]:
        """verl's micro-batch loop (token count for the loss, micro-batches, backward, reassembled outputs)."""
        batch_num_tokens = data["loss_mask"].sum()
        torch.distributed.all_reduce(batch_num_tokens)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                                       same_micro_num_in_dp=True)
        outputs = []
        for micro_batch in micro_batches:
            with torch.no_grad() if forward_only else nullcontext():
                loss, output = self.forward_step(micro_batch, loss_function, forward_only)
                if not forward_only:
                    loss.backward()
                    output.pop("model_output")
            outputs.append(output)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def forward_step(self, micro_batch, loss_function, forward_only) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch: outputs as verl's engines give them, nested ``(rows, tokens)`` tensors.

        ``log_probs[t]`` is the log-prob of token ``t + 1`` (verl's shifted
        convention), at the micro-batch's ``temperature``; ``values[t]`` is
        the critic's output at ``t``.
        """
        input_ids = micro_batch["input_ids"]
        offsets = input_ids.offsets()
        lengths = offsets.diff()
        ids = torch.nested.to_padded_tensor(input_ids, 0)
        positions = torch.nested.to_padded_tensor(micro_batch["position_ids"], 0)
        valid = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        output = self.module(input_ids=ids, attention_mask=valid.long(), position_ids=positions, use_cache=False)
        if self.is_value_model:
            model_output = {"values": _nested(output.logits.squeeze(-1)[valid], offsets)}
        else:
            logits = output.logits.float() / _temperature(micro_batch, ids.shape[0])
            log_probs = torch.log_softmax(logits, -1).gather(-1, torch.roll(ids, -1, dims=1).unsqueeze(-1)).squeeze(-1)
            model_output = {"log_probs": _nested(log_probs[valid], offsets)}
            if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
                probs = torch.softmax(logits, -1)
                entropy = torch.logsumexp(logits, -1) - (probs * logits).sum(-1)
                model_output["entropy"] = _nested(entropy[valid], offsets)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                          dp_group=self.get_data_parallel_group())
        else:
            loss, metrics = torch.tensor(1.0), {}
        detached = {key: value.detach() for key, value in model_output.items()}
        return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}

    def _checkpoint_manager(self):
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        return FSDPCheckpointManager(self.module, self.optimizer, self.lr_scheduler,
                                     processing_class=getattr(self.model_config, "tokenizer", None),
                                     checkpoint_config=self.checkpoint_config)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs) -> None:
        self._checkpoint_manager().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        torch.distributed.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs) -> None:
        self._checkpoint_manager().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        torch.distributed.barrier()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Nothing to move: the model never leaves the CPU."""

    def get_per_tensor_param(self, **kwargs):
        """The weights verl's worker syncs to its rollout servers (``update_weights``), as verl's FSDP engine
        exports them: with LoRA and ``model.lora.merge``, the adapter merged into the base weights under their
        Hugging Face names (the module itself left unmerged: it goes on training the adapter); otherwise the
        module's parameters."""
        if self.is_lora and self.model_config.lora.get("merge", False):
            return self._merged_lora_params(), None
        return ((name, param.detach()) for name, param in self.module.named_parameters()), None

    def _merged_lora_params(self) -> list[tuple[str, torch.Tensor]]:
        # verl's own merge steps (merged_lora_context without its FSDP gathering): back up the base weights,
        # merge, copy out, restore the backup (no unmerge drift).
        from verl.utils.fsdp_utils import (_clean_merged_lora_, _merge_or_unmerge_lora_, backup_base_model_weights,
                                           normalize_peft_param_name, restore_base_model_weights)

        backup = backup_base_model_weights(self.module)
        _merge_or_unmerge_lora_(self.module, merge=True)
        try:
            return [(name, param.detach().clone())
                    for name, param in normalize_peft_param_name(self.module.state_dict()).items()]
        finally:
            restore_base_model_weights(self.module, backup)
            _clean_merged_lora_(self.module)


def _lora_module(engine: CpuEngine, module: torch.nn.Module) -> torch.nn.Module:
    """``module`` wrapped in the peft LoRA model verl's FSDP engine builds from ``engine.model_config``.

    verl's own builder (``FSDPEngine._build_lora_module``: ``lora_rank``,
    ``lora_alpha``, ``target_modules``, ``exclude_modules``,
    ``target_parameters``, or a pre-trained ``lora_adapter_path``) reads
    nothing of the engine but its model config, so the CPU actor carries the
    very adapter a GPU run would.
    """
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    return FSDPEngine._build_lora_module(engine, module)


class _ModeContext(BaseEngineCtx):
    def __enter__(self):
        super().__enter__()
        self.engine.module.train(self.mode == "train")


def _nested(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _temperature(micro_batch, rows: int) -> torch.Tensor | float:
    temperature = micro_batch["temperature"] if "temperature" in micro_batch.keys() else 1.0
    if isinstance(temperature, torch.Tensor):
        return temperature.reshape(rows, 1, 1).float()
    return float(temperature)


def register_cpu_engine() -> None:
    """Register :class:`CpuEngine` for verl's FSDP strategy names on the ``cpu`` device (idempotent)."""
    for model_type in ("language_model", "value_model"):
        registered = EngineRegistry._engines.get(model_type, {})
        missing = [strategy for strategy in STRATEGIES if "cpu" not in registered.get(strategy, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device="cpu")(CpuEngine)


def prepare_cpu_process() -> None:
    """Make this Ray worker process a CPU rank: gloo process group, CPU engine lookups.

    verl starts its process group with a ``cpu:gloo,<accelerator>:nccl``
    backend, which a CPU build of torch refuses; verl only starts one if none
    exists. ``VERL_ENGINE_DEVICE`` is verl's switch for the device its
    engine lookup uses (it reports ``cuda`` on a machine without accelerators).
    """
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    register_cpu_engine()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo", rank=int(os.environ["RANK"]),
                                             world_size=int(os.environ["WORLD_SIZE"]))


class CpuTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` on the CPU engine (no FLOPs counter: a CPU has no peak figure to divide by)."""

    def __init__(self, config):
        prepare_cpu_process()
        super().__init__(config)
        self.device_name = "cpu"
        self.flops_counter = None


class CpuCriticWorker(BridgeMixin, CpuTrainingWorker):
    """The critic on the CPU, with agl_core's components installed in verl's registries."""

    def __init__(self, config, agl_registrations=None):
        self.install_bridge(agl_registrations)
        super().__init__(config)


class CpuActorRolloutRefWorker(BridgeMixin, ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` with CPU training workers; it has no rollout engine (roles ``actor``, ``ref``)."""

    actor_worker_cls = CpuTrainingWorker
    ref_worker_cls = CpuTrainingWorker

    def __init__(self, config, role, agl_registrations=None, **kwargs):
        self.install_bridge(agl_registrations)
        prepare_cpu_process()
        super().__init__(config, role, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def synced_weights(self) -> dict[str, torch.Tensor]:
        """The weights ``update_weights`` would send this worker's rollout server (the CPU path has none to send
        them to): what a vLLM server would then serve, to be checked against the actor."""
        params, _ = self.actor.engine.get_per_tensor_param()
        return dict(params)
