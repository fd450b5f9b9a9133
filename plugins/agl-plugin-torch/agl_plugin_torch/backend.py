"""The backend's state for one run: models, optimizers, and the policy endpoint (engine and HTTP server).

It lives in ``ctx.state["torch"]`` and is made on first use, which is
``load_checkpoint`` when a run resumes and ``on_train_start`` otherwise.
:func:`create` is where other plugins' ``actor_transform`` components change
the actor (an adapter, …), before any weights are loaded into it and before
its optimizer is made.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from agl_core.config import AlgorithmConfig
from agl_core.data import Batch

from agl_plugin_torch import modeling, serving_process, training, update_process
from agl_plugin_torch.per_row_lora import pack_adapters
from agl_plugin_torch.policies import PolicyOptimizers, adapters_per_row, policy_adapters, update_policies
from agl_plugin_torch.forward import response_logprobs, response_values
from agl_plugin_torch.serving_process import Endpoint, RemoteEndpoint
from agl_plugin_torch.settings import NAME, TorchConfig
from agl_plugin_torch.training import PolicyLoss, make_optimizer
from agl_plugin_torch.worker_process import CONTEXT, WorkerProcess

STATE_FILE = "torch_state.pt"
ACTOR_DIR = "actor"


@dataclass
class Backend:
    """Everything the backend holds during a run.

    ``source`` is the directory of the initial model (the recipe's path, or
    the made model in the run directory); the reference policy is loaded
    from it, so a resumed run gets the same reference. ``lock`` serialises
    generation and training on the shared weights; ``served`` holds the
    version of the weights the endpoint generates with. Both are shared
    with the endpoint's process when it has one
    (:mod:`agl_plugin_torch.serving_process`).

    In asynchronous training (:meth:`serve_a_copy`) the engine generates with
    ``serving``, a copy of the actor under its own ``serving_lock``, while the
    trainer updates the actor; :meth:`sync_weights` copies the actor's weights
    into it between generation batches. With an ``update_process``
    (:meth:`train_in_a_process`) the training methods, called through
    :meth:`run`, run there on the same weights in shared memory.
    """

    config: TorchConfig
    source: Path
    actor: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    actor_optim: torch.optim.Optimizer
    actor_sched: Any
    generator: torch.Generator
    critic: modeling.ValueModel | None = None
    critic_optim: torch.optim.Optimizer | None = None
    critic_sched: Any = None
    ref: PreTrainedModel | None = None
    lock: Any = field(default_factory=CONTEXT.Lock)
    endpoint: Endpoint | RemoteEndpoint | None = None
    weight_version: int = 0
    served: Any = field(default_factory=lambda: CONTEXT.Value("q", 0, lock=False))
    busy_at_step_start: float = 0.0  # the engine's generating CPU time when the step began
    generated_at_step_start: tuple[int, float] = (0, 0.0)  # the engine's tokens and generating wall time then
    serving: PreTrainedModel | None = None
    serving_lock: Any = None
    update_process: WorkerProcess | None = None
    policy_optims: PolicyOptimizers | None = None  # several policies: one optimizer per trainable adapter

    @classmethod
    def for_training(cls, config: TorchConfig, source: Path, actor: PreTrainedModel,
                     tokenizer: PreTrainedTokenizerBase, generator: torch.Generator,
                     critic: modeling.ValueModel | None = None) -> Backend:
        """A backend over these models, with fresh optimizers for the actor's trained weights and the critic's."""
        backend = cls(config, source, actor, tokenizer, *make_optimizer(trainable(actor), config.actor), generator)
        if critic is not None:
            backend.critic = critic
            backend.critic_optim, backend.critic_sched = make_optimizer(critic.parameters(), config.critic)
        return backend

    # ------------------------------------------------------------ serving

    def start_serving(self, model_name: str) -> None:
        """Start the policy endpoint (idempotent): in a process of its own on a CPU (``serving.process``)."""
        if self.endpoint is not None:
            return
        model, lock = (self.actor, self.lock) if self.serving is None else (self.serving, self.serving_lock)
        eos = eos_token_ids(self.actor, self.tokenizer)
        if self.config.serves_in_a_process():
            model.share_memory()
            self.endpoint = serving_process.start(model, lock, self.served, self.tokenizer, eos, self.config,
                                                  model_name, self.generator.get_state())
        else:
            self.endpoint = serving_process.serve_model(model, lock, self.served_version, self.tokenizer, eos,
                                                        self.config, model_name, self.generator)

    @property
    def url(self) -> str:
        """The base URL of the policy endpoint (``http://127.0.0.1:PORT/v1``)."""
        if self.endpoint is None:
            raise RuntimeError("the policy endpoint is not serving (it starts in on_train_start)")
        return f"{self.endpoint.url}/v1"

    def served_version(self) -> int:
        """The version of the weights the engine generates with (read under the engine's lock)."""
        return self.served.value

    def serve_a_copy(self) -> None:
        """Generate with a copy of the actor from now on, so that serving and training overlap.

        Called before the engine starts; the copy holds the actor's current
        weights (a resumed run's included) and their version.
        """
        with self.lock:
            self.serving = copy.deepcopy(self.actor).eval().requires_grad_(False)
        self.serving_lock = CONTEXT.Lock()

    @torch.no_grad()
    def sync_weights(self, version: int) -> None:
        """Copy the actor's weights into the serving copy, between two generation batches; they are ``version``'s.

        A generation batch holds the serving lock, so every response is made
        by one version of the weights and reports it. Only the weights the
        optimizer updates are copied (an adapter's, when a transform froze the
        rest).
        """
        if self.serving is None:
            raise RuntimeError("sync_weights: the backend serves the actor itself (serve_a_copy was not called)")
        served = dict(self.serving.named_parameters())
        with self.lock, self.serving_lock:
            for name, param in self.actor.named_parameters():
                if param.requires_grad:
                    served[name].copy_(param)
            self.served.value = version

    def set_weight_version(self, version: int) -> None:
        """Record that the weights are now those of update ``version`` (responses report it)."""
        with self.lock:
            self.weight_version = version
            if self.serving is None:
                self.served.value = version

    def generated_cpu_s(self) -> float:
        """CPU seconds the engine has spent generating so far (0 before it serves)."""
        return 0.0 if self.endpoint is None else self.endpoint.busy_cpu_s()

    def generated(self) -> tuple[int, float]:
        """``(tokens, wall seconds)`` the engine has generated and spent generating so far."""
        return (0, 0.0) if self.endpoint is None else self.endpoint.generated()

    def stop_serving(self) -> None:
        try:
            if self.endpoint is not None:
                self.endpoint.close()
        finally:
            self.endpoint = None
            if self.update_process is not None:
                self.update_process.stop()
                self.update_process = None

    # ------------------------------------------------------------ training

    def train_in_a_process(self) -> None:
        """Run the training methods in a process of their own from now on (:mod:`agl_plugin_torch.update_process`).

        The actor's and critic's weights move to shared memory, so both
        processes see every update; the optimizers' states (a resumed run's
        included) move to the process, whose optimizers are the ones that
        step from now on.
        """
        self.actor.share_memory()
        if self.critic is not None:
            self.critic.share_memory()
        parts = {"config": self.config, "source": self.source, "actor": self.actor, "tokenizer": self.tokenizer,
                 "critic": self.critic}
        self.update_process = update_process.start(Backend.for_training, parts, self.optimizer_states())

    def run(self, method: str, *args: Any) -> Any:
        """Call the training method ``method`` here, or in the update process when there is one."""
        if self.update_process is None:
            return getattr(self, method)(*args)
        return self.update_process.call(method, *args)

    def old_logprobs(self, batch: Batch, adapters: Sequence[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's log-probs and entropy of every row's response (row i through ``adapters[i]``, when given)."""
        with self.lock:
            return self.logprobs(self.actor, batch, with_entropy=True, adapters=adapters)

    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        """The reference policy's log-probs of every row's response."""
        return self.logprobs(self.reference(), batch, with_entropy=False)[0]

    def update_actor(self, batch: Batch, algorithm: AlgorithmConfig, policy_loss: PolicyLoss) -> dict[str, float]:
        """PPO updates of the actor on ``batch`` (:func:`agl_plugin_torch.training.update_actor`); their metrics."""
        with self.lock:
            return training.update_actor(self.actor, self.actor_optim, self.actor_sched, batch, algorithm,
                                         policy_loss, self.config.actor)

    def update_policies(self, batch: Batch, policies: Any, algorithm: AlgorithmConfig,
                        policy_loss: PolicyLoss) -> dict[str, float]:
        """Each trainable policy's adapter updated on its rows (``policies``: row i's policy), with its own optimizer."""
        with self.lock:
            return update_policies(self.actor, self.policy_optims, batch, policies, algorithm, policy_loss,
                                   self.config.actor)

    def update_critic(self, batch: Batch, algorithm: AlgorithmConfig) -> dict[str, float]:
        """Value-loss updates of the critic on ``batch`` (:func:`agl_plugin_torch.training.update_critic`)."""
        return training.update_critic(self.critic, self.critic_optim, self.critic_sched, batch, algorithm,
                                      self.config.critic)

    def optimizer_states(self) -> dict[str, Any]:
        """The optimizers' and schedules' states, by field name (the critic's when there is one)."""
        names = ("actor_optim", "actor_sched") + (("critic_optim", "critic_sched") if self.critic is not None else ())
        names += ("policy_optims",) if self.policy_optims is not None else ()
        return {name: getattr(self, name).state_dict() for name in names}

    def load_optimizer_states(self, states: dict[str, Any]) -> None:
        for name, state in states.items():
            getattr(self, name).load_state_dict(state)

    # ------------------------------------------------------------ models

    def reference(self) -> PreTrainedModel:
        """The frozen reference policy: the initial weights, loaded on first use."""
        if self.ref is None:
            self.ref = modeling.frozen_copy(modeling.load(self.source, self.config.model)[0])
        return self.ref

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, batch: Batch, with_entropy: bool,
                 adapters: Sequence[str] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs (and entropy) of every row, in forward micro-batches; row i through ``adapters[i]``."""
        device = _device(model)
        parts = []
        for rows in _slices(len(batch), self.config.forward_micro_batch_size):
            with adapters_per_row(model, None if adapters is None else adapters[rows]):
                parts.append(response_logprobs(model, *_inputs(batch, rows, device),
                                               batch["responses"][rows].to(device), with_entropy=with_entropy))
        log_probs = torch.cat([p[0] for p in parts]).cpu()
        return log_probs, torch.cat([p[1] for p in parts]).cpu() if with_entropy else None

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of every row's response positions, in forward micro-batches."""
        width = batch["responses"].shape[1]
        device = _device(self.critic)
        return torch.cat([response_values(self.critic, *_inputs(batch, rows, device), width)
                          for rows in _slices(len(batch), self.config.forward_micro_batch_size)]).cpu()

    # ------------------------------------------------------------ checkpoints

    def save(self, path: Path) -> None:
        """The actor as a Hugging Face directory (``path/actor``) and the rest in ``path/torch_state.pt``.

        When an actor transform froze part of the actor (an adapter), the
        directory holds what the actor's ``save_pretrained`` writes (the
        adapter), and ``torch_state.pt`` also holds the trained parameters by
        the actor's own names (``actor_trained``): a resumed run rebuilds the
        frozen part from the initial weights and the same transforms, and
        restores these exactly, whatever the format of the directory.
        """
        self.actor.save_pretrained(path / ACTOR_DIR)
        self.tokenizer.save_pretrained(path / ACTOR_DIR)
        # The endpoint's generator, which its process (when it has one) has drawn from since it started.
        generator = self.generator.get_state() if self.endpoint is None else self.endpoint.generator_state()
        state = {**self.run("optimizer_states"), "generator": generator,
                 "weight_version": self.weight_version}
        if any(not p.requires_grad for p in self.actor.parameters()):
            state["actor_trained"] = {n: p.detach() for n, p in self.actor.named_parameters() if p.requires_grad}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        torch.save(state, path / STATE_FILE)

    def load(self, path: Path) -> None:
        state = torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
        if "actor_trained" in state:
            self._load_trained(path, state["actor_trained"])
        else:
            actor = modeling.load(path / ACTOR_DIR, self.config.model)[0]
            with self.lock:
                missing, unexpected = self.actor.load_state_dict(actor.state_dict(), strict=False)
            if missing or unexpected:
                raise RuntimeError(f"the actor of checkpoint {path} does not fit this run's actor "
                                   f"({len(missing)} weights missing, e.g. {missing[:2]}; {len(unexpected)} "
                                   f"unexpected, e.g. {unexpected[:2]}): was it saved with other actor transforms "
                                   f"(e.g. a LoRA adapter) than this run applies?")
        optimizers = ("actor_optim", "actor_sched") + (("policy_optims",) if self.policy_optims is not None else ())
        self.generator.set_state(state["generator"])
        if self.critic is not None:
            if "critic" not in state:
                raise RuntimeError(f"the checkpoint {path} has no critic, but this run's estimator needs one")
            self.critic.load_state_dict(state["critic"])  # in place: an update process shares these tensors
            optimizers += ("critic_optim", "critic_sched")
        self.run("load_optimizer_states", {name: state[name] for name in optimizers})
        self.set_weight_version(state["weight_version"])

    def _load_trained(self, path: Path, trained: dict[str, torch.Tensor]) -> None:
        """Restore the trained parameters of a transformed actor; they must be exactly this actor's."""
        params = {n: p for n, p in self.actor.named_parameters() if p.requires_grad}
        if trained.keys() != params.keys():
            missing, unexpected = sorted(params.keys() - trained.keys()), sorted(trained.keys() - params.keys())
            raise RuntimeError(f"the trained weights of checkpoint {path} do not fit this run's actor "
                               f"({len(missing)} missing, e.g. {missing[:2]}; {len(unexpected)} unexpected, "
                               f"e.g. {unexpected[:2]}): was it saved with other actor transforms than this run "
                               f"applies?")
        with self.lock, torch.no_grad():
            for name, param in params.items():
                param.copy_(trained[name])


ActorTransform = Callable[[PreTrainedModel], PreTrainedModel]
"""A transform of the freshly loaded actor: the model to train, the same object changed or another one."""


def create(config: TorchConfig, run_dir: Path, seed: int, with_critic: bool,
           transforms: Sequence[ActorTransform] = ()) -> Backend:
    """Make or load the model, transform the actor, make its optimizer and (when the estimator needs one) the critic.

    This is the actor transform point: ``transforms`` (the ``actor_transform``
    components of the active plugins, see :func:`agl_plugin_torch.plugin.actor_transforms`)
    are applied in order to the actor loaded from the initial weights, before
    anything else sees it: before a checkpoint is loaded into it, before the
    endpoint serves it, and before its optimizer is made. The optimizer is
    built over the parameters that require a gradient afterwards, so a
    transform that freezes weights (an adapter) never gets an optimizer over
    every weight. The critic is a copy of the backbone as loaded, before the
    transforms.
    """
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    hf_logging.disable_progress_bar()  # bars for loading and saving small models are noise in the training log
    source = modeling.create(config.model, run_dir / "model", seed)
    actor, tokenizer = modeling.load(source, config.model)
    critic = modeling.ValueModel(actor) if with_critic else None
    for transform in transforms:
        actor = transform(actor)
    if policy_adapters(actor) is not None:
        pack_adapters(actor)  # mixed batches' kernel: the adapters stacked in place, before any process maps them
    generator = torch.Generator(device=_device(actor)).manual_seed(seed)
    return Backend.for_training(config, source, actor, tokenizer, generator, critic)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``model`` that require a gradient: what its optimizer updates."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError(f"no parameter of the actor ({type(model).__name__}) requires a gradient; "
                           f"an actor transform froze every weight")
    return params


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The files of a whole model's weights in a Hugging Face directory (one of them)."""


def export_actor(checkpoint: Path, out: Path) -> Path | None:
    """Copy the actor of ``checkpoint`` (a whole model: config, weights, tokenizer) to ``out``; None if it is not one.

    A fully fine-tuned actor is already a plain Hugging Face model, merged or
    not. An actor saved as something else (an adapter without base weights)
    is another plugin's to export.
    """
    actor = checkpoint / ACTOR_DIR
    if not (actor / "config.json").is_file() or not any((actor / name).is_file() for name in WEIGHT_FILES):
        return None
    shutil.copytree(actor, out, dirs_exist_ok=True)
    return out


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _slices(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


def _inputs(batch: Batch, rows: slice, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(batch[key][rows].to(device) for key in ("input_ids", "attention_mask", "position_ids"))


def on_device(batch: Batch, keys: list[str], device: torch.device) -> Batch:
    """A batch of the ``keys`` columns of ``batch`` on ``device`` (no copy when already there)."""
    return Batch({key: batch[key].to(device) for key in keys})
