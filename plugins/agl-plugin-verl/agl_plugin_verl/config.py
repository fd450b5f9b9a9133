"""verl's configuration for a run: verl's own defaults, the recipe's shared keys translated, then ``plugins.verl``.

Four layers, in this order:

1. verl's ``ppo_trainer`` defaults, composed from the YAML files verl ships
   with Hydra, exactly as ``python -m verl.trainer.main_ppo`` composes them.
2. :data:`TRANSLATION`: every agl_core recipe key that has a verl
   counterpart (estimator, KL, clipping, batch sizes, lengths, LoRA, ...)
   written onto verl's key. This table is the only place the two vocabularies
   meet; a test checks each row.
3. :data:`DEFAULTS`: the few verl defaults this plugin changes because
   agl_core's batches differ from verl's, and :data:`CPU_DEFAULTS` for the
   CPU workers (overridable).
4. The recipe's ``plugins.verl`` section: verl's own keys, nested or dotted,
   applied one by one like verl's command line (``actor_rollout_ref.actor.optim.lr:
   1e-6``). A key verl does not have is an error unless written ``+key`` (verl's
   CLI convention for adding a key). Setting a key the translation sets is an
   error naming both keys: the recipe says it once, in agl_core's words.

Finally :func:`check_lora` refuses the LoRA settings (``plugins.lora``) that
verl cannot honour, naming each key: none is silently dropped.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from pydantic import Field, RootModel

from agl_core.config import ConfigError, Recipe

from agl_plugin_verl.compat import is_verl_0_7, verl_version


class VerlSection(RootModel[dict[str, Any]]):
    """The recipe section ``plugins.verl``: verl ``ppo_trainer`` keys (nested or dotted) and their values."""

    root: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class Translation:
    """One agl_core key and the verl key it sets; ``value(recipe)`` is the verl value (None: leave verl's)."""

    agl_key: str
    verl_key: str
    value: Callable[[Recipe], Any]


def _recipe_value(path: str) -> Callable[[Recipe], Any]:
    def read(recipe: Recipe) -> Any:
        node: Any = recipe
        for part in path.split("."):
            node = getattr(node, part)
        return node

    return read


def _same(agl_key: str, verl_key: str) -> Translation:
    return Translation(agl_key, verl_key, _recipe_value(agl_key))


def _clip_bound(bound: str) -> Callable[[Recipe], float]:
    # agl_core leaves clip_ratio_low/high unset to mean clip_ratio; verl's defaults are 0.2 whatever clip_ratio is.
    def value(recipe: Recipe) -> float:
        loss = recipe.algorithm.policy_loss
        own = getattr(loss, bound)
        return loss.clip_ratio if own is None else own

    return value


def _mini_batch_prompts(recipe: Recipe) -> int:
    # verl counts its PPO mini-batch in prompts (rows / rollout.n); agl_core counts rows. The driver hands
    # the workers agl_core's row count; this keeps verl's own checks and the critic's default consistent.
    return max(1, recipe.algorithm.ppo_mini_batch_size // recipe.rollout.n)


def _sampling(field: str) -> Callable[[Recipe], float]:
    # Unset (None) means the serving engine's default, which is 1.0 for both in vLLM; log-probs are
    # recomputed at the temperature the responses were sampled with.
    def value(recipe: Recipe) -> float:
        own = getattr(recipe.rollout.sampling, field)
        return 1.0 if own is None else own

    return value


LORA = "lora"
"""The plugin (agl-plugin-lora) whose recipe section ``plugins.lora`` drives verl's LoRA options."""


def lora_section(recipe: Recipe) -> dict[str, Any] | None:
    """The recipe's LoRA settings, or None without LoRA.

    When plugin ``lora`` is active its validated section, every key with its
    default included (``plugins: [verl, lora]`` alone means rank 8, not verl's
    rank 0); a recipe not validated against its plugins has only the keys it
    writes under ``plugins.lora``.
    """
    validated = recipe.plugin_config.get(LORA)
    if validated is not None:
        return validated.model_dump()
    section = recipe.plugins.sections.get(LORA)
    return None if section is None else dict(section)


def _lora(key: str) -> Callable[[Recipe], Any]:
    def value(recipe: Recipe) -> Any:
        return (lora_section(recipe) or {}).get(key)

    return value


def _lora_alpha(recipe: Recipe) -> Any:
    # verl's lora_alpha is an integer (its dataclass, its checkpoint metadata); 16.0 is 16. A fractional alpha
    # is refused by check_lora.
    alpha = _lora("alpha")(recipe)
    return int(alpha) if isinstance(alpha, float) and alpha.is_integer() else alpha


FSDP_STRATEGIES = ("fsdp", "fsdp2")
"""verl actor strategies whose engine reads the LoRA keys the translation sets (``model.lora_rank``, ...)."""

LORA_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "dropout": (lambda value: bool(value),
                "verl's FSDP engine builds its peft LoraConfig without lora_dropout, so the adapter trains "
                "without dropout; set plugins.lora.dropout=0"),
    "modules_to_save": (lambda value: bool(value),
                        "verl's FSDP engine builds its peft LoraConfig without modules_to_save (it has no key for "
                        "them): only the adapter on target_modules trains; leave plugins.lora.modules_to_save empty"),
    "alpha": (lambda value: value is not None and not float(value).is_integer(),
              "verl's lora_alpha is an integer; use a whole number"),
}
"""``plugins.lora`` keys (and the values) verl cannot honour, and why; :func:`check_lora` refuses them.

Every key of the lora section is either translated (:data:`TRANSLATION`) or
listed here, so none is silently ignored on this backend (a test checks it).
"""


TRANSLATION: tuple[Translation, ...] = (
    _same("algorithm.estimator", "algorithm.adv_estimator"),
    _same("algorithm.gamma", "algorithm.gamma"),
    _same("algorithm.lam", "algorithm.lam"),
    _same("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
    _same("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    _same("algorithm.kl_penalty", "algorithm.kl_penalty"),
    _same("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type"),
    _same("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    _same("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl"),
    _same("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon"),
    _same("algorithm.policy_loss.name", "actor_rollout_ref.actor.policy_loss.loss_mode"),
    _same("algorithm.policy_loss.clip_ratio", "actor_rollout_ref.actor.clip_ratio"),
    Translation("algorithm.policy_loss.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_low",
                _clip_bound("clip_ratio_low")),
    Translation("algorithm.policy_loss.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio_high",
                _clip_bound("clip_ratio_high")),
    _same("algorithm.policy_loss.clip_ratio_c", "actor_rollout_ref.actor.clip_ratio_c"),
    _same("algorithm.policy_loss.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode"),
    _same("algorithm.policy_loss.entropy_coeff", "actor_rollout_ref.actor.entropy_coeff"),
    _same("algorithm.policy_loss.use_kl_loss", "actor_rollout_ref.actor.use_kl_loss"),
    _same("algorithm.policy_loss.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_coef"),
    _same("algorithm.policy_loss.kl_loss_type", "actor_rollout_ref.actor.kl_loss_type"),
    Translation("algorithm.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size", _mini_batch_prompts),
    _same("algorithm.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    _same("data.train_batch_size", "data.train_batch_size"),
    _same("data.max_prompt_length", "data.max_prompt_length"),
    _same("data.max_response_length", "data.max_response_length"),
    _same("rollout.n", "actor_rollout_ref.rollout.n"),
    Translation("rollout.sampling.temperature", "actor_rollout_ref.rollout.temperature", _sampling("temperature")),
    Translation("rollout.sampling.top_p", "actor_rollout_ref.rollout.top_p", _sampling("top_p")),
    _same("trainer.project_name", "trainer.project_name"),
    _same("trainer.experiment_name", "trainer.experiment_name"),
    _same("trainer.critic_warmup", "trainer.critic_warmup"),
    # LoRA keys come from the recipe section of agl-plugin-lora, when the recipe has one.
    Translation("plugins.lora.rank", "actor_rollout_ref.model.lora_rank", _lora("rank")),
    Translation("plugins.lora.alpha", "actor_rollout_ref.model.lora_alpha", _lora_alpha),
    Translation("plugins.lora.target_modules", "actor_rollout_ref.model.target_modules", _lora("target_modules")),
)
"""agl_core key → verl key, for every recipe key the two share."""


def translate(recipe: Recipe) -> dict[str, tuple[Any, str]]:
    """``{verl_key: (value, agl_key)}`` for every translation that applies to ``recipe``.

    A LoRA row applies only with LoRA settings (:func:`lora_section`) that
    hold the key.
    """
    out = {}
    for row in TRANSLATION:
        value = row.value(recipe)
        if value is None and row.agl_key.startswith("plugins."):
            continue
        out[row.verl_key] = (value, row.agl_key)
    return out


def flatten(section: Mapping[str, Any], prefix: str = "", add: bool = False) -> Iterator[tuple[str, Any]]:
    """``(dotted_key, value)`` for every leaf of a nested mapping whose keys may themselves be dotted.

    Lists and scalars are leaves; an empty mapping is a leaf (it sets the key
    to ``{}``). A ``+`` on any part of a path (``+override_config:`` inside
    ``model:``) marks the whole leaf key as added: ``+actor_rollout_ref.model...``.
    """
    for key, value in section.items():
        if not isinstance(key, str):
            raise ConfigError(f"plugins.verl: keys are verl config paths (strings), got {key!r}")
        adds = add or key.startswith("+")
        path = f"{prefix}{key.lstrip('+')}"
        if isinstance(value, Mapping) and value:
            yield from flatten(value, path + ".", adds)
        else:
            yield ("+" if adds else "") + path, value


def _overlaps(a: str, b: str) -> bool:
    """The keys are the same, or one is a section holding the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


DEFAULTS: dict[str, Any] = {
    # agl_core's row count varies from step to step (rows per rollout, dropped rows), so a fixed
    # micro-batch size need not divide a worker's share; verl's token-budget micro-batches always do.
    # The reference, rollout log-prob and critic settings follow this key in verl's own defaults.
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    # verl's critic default is a placeholder path; the critic starts from the policy, as in verl's examples.
    "critic.model.path": "${actor_rollout_ref.model.path}",
}
"""verl defaults this plugin changes; ``plugins.verl`` may set them back."""

CPU_DEFAULTS: dict[str, Any] = {
    # verl 0.9 reports a `cuda` device on a machine without accelerators, and its token-budget
    # micro-batching puts a tensor there; fixed micro-batches of one row run anywhere and divide any share.
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
    "critic.ppo_micro_batch_size_per_gpu": 1,
    # The critic's engine reads its own copies, which verl's YAML does not list (verl's critic always
    # micro-batches by tokens).
    "+critic.fsdp.use_dynamic_bsz": False,
    "+critic.fsdp.micro_batch_size_per_gpu": 1,
    "+critic.fsdp.infer_micro_batch_size_per_gpu": 1,
}
"""Further defaults when ``plugins.verl`` sets ``trainer.device: cpu`` (the CPU workers of ``cpu.py``)."""


LORA_MERGE = "actor_rollout_ref.model.lora.merge"
"""verl's switch that merges the trained adapter into the base weights it syncs to the rollout servers."""


def required_settings(version, recipe: Recipe | None = None) -> dict[str, Any]:
    """verl keys this plugin must set to drive verl's engine workers (not overridable).

    With LoRA (plugin ``lora``), the adapter is merged into the weights synced
    to the rollout servers (``model.lora.merge``): vLLM's OpenAI routes apply
    an unmerged adapter only to a request whose ``model`` names it, and the
    agents' calls name ``rollout.model``, so without the merge the gateway's
    calls would be served by the base model while the actor trains the
    adapter (samples off-policy, log-probs not the actor's).
    """
    required: dict[str, Any] = {"trainer.use_legacy_worker_impl": "disable"} if is_verl_0_7(version) else {}
    if recipe is not None and lora_section(recipe) is not None:
        required[LORA_MERGE] = True
    return required


def check_overrides(overrides: dict[str, Any], translated: dict[str, tuple[Any, str]],
                    required: Mapping[str, Any] | None = None) -> None:
    """Refuse a ``plugins.verl`` key that the translation (or this plugin) sets; the error names both keys."""
    clashes = []
    for key in overrides:
        bare = key.lstrip("+")
        clashes += [f"plugins.verl.{bare} is set by agl_core's {agl_key} (verl key {verl_key}); set {agl_key} instead"
                    for verl_key, (_, agl_key) in translated.items() if _overlaps(bare, verl_key)]
        clashes += [f"plugins.verl.{bare}: agl-plugin-verl sets verl key {verl_key}={value!r} to drive verl's "
                    "engine workers" for verl_key, value in (required or {}).items() if _overlaps(bare, verl_key)]
    if clashes:
        raise ConfigError("the recipe sets a verl key twice:\n  " + "\n  ".join(clashes))


@functools.lru_cache(maxsize=1)
def _composed_defaults() -> DictConfig:
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer")


def verl_defaults() -> DictConfig:
    """A fresh copy of verl's ``ppo_trainer`` defaults (composed once per process: ~3 s with verl's import)."""
    return _composed_defaults().copy()


def _has_key(cfg: DictConfig, key: str) -> bool:
    """Whether verl's config defines ``key``, set or not (``???`` values count: verl leaves some for the user)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node.keys()


def _set(cfg: DictConfig, key: str, value: Any, source: str) -> None:
    add = key.startswith("+")
    key = key.lstrip("+")
    if not add and not _has_key(cfg, key):
        raise ConfigError(f"{source}: verl {verl_version()} has no config key {key!r} "
                          f"(write +{key} to add a key verl does not define)")
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False, force_add=add)


def build_verl_config(recipe: Recipe, section: VerlSection | Mapping[str, Any] | None) -> DictConfig:
    """verl's full, resolved configuration for ``recipe`` (defaults ← translation ← plugin defaults ← ``plugins.verl``).

    Raises :class:`~agl_core.config.ConfigError` for a ``plugins.verl`` key
    verl does not have, or one the translation sets, and
    :class:`~agl_plugin_verl.compat.UnsupportedVerlError` for an unsupported verl.
    """
    version = verl_version()
    raw = section.root if isinstance(section, VerlSection) else dict(section or {})
    overrides = dict(flatten(raw))
    translated = translate(recipe)
    required = required_settings(version, recipe)
    check_overrides(overrides, translated, required)
    cfg = verl_defaults()
    for verl_key, (value, agl_key) in translated.items():
        _set(cfg, verl_key, value, agl_key)
    cpu = CPU_DEFAULTS if overrides.get("trainer.device") == "cpu" else {}
    for key, value in {**DEFAULTS, **cpu, **required}.items():
        _set(cfg, key, value, "agl-plugin-verl")
    for key, value in overrides.items():
        _set(cfg, key, value, f"plugins.verl.{key.lstrip('+')}")
    OmegaConf.resolve(cfg)
    default_critic_attention(cfg)
    check_lora(recipe, cfg)
    return cfg


def default_critic_attention(cfg: DictConfig) -> None:
    """The critic's attention kernel, when the recipe sets none: the actor's, unless flash-attn is importable.

    verl loads a model whose ``override_config`` names no ``attn_implementation``
    with ``flash_attention_2``, which fails without the flash-attn package (not
    part of verl's documented install). The actor's is set by the recipe
    (``sdpa`` in examples/calc_verl); the critic's, a separate section, is
    not, so GAE would fail on a GPU that trains the actor fine. With flash-attn
    importable verl's own default stands.
    """
    critic = cfg.get("critic")
    if critic is None or "attn_implementation" in (critic.model.get("override_config") or {}):
        return
    if importlib.util.find_spec("flash_attn") is not None:
        return
    actor = cfg.actor_rollout_ref.model.get("override_config") or {}
    with open_dict(cfg):
        OmegaConf.update(cfg, "critic.model.override_config.attn_implementation",
                         actor.get("attn_implementation", "sdpa"), merge=True, force_add=True)


def check_lora(recipe: Recipe, cfg: DictConfig) -> None:
    """Refuse LoRA settings of plugin ``lora`` that verl cannot honour; the error names each key and the backend.

    The keys of :data:`LORA_REFUSED`, and an actor engine other than FSDP
    (``actor.strategy``: Megatron's reads ``model.lora.*``, which the
    translation does not set; it would train without the adapter while verl
    takes the reference from the actor).
    """
    section = lora_section(recipe)
    if section is None:
        return
    problems = [f"plugins.{LORA}.{key}={section[key]!r}: {why}"
                for key, (refused, why) in LORA_REFUSED.items() if key in section and refused(section[key])]
    strategy = cfg.actor_rollout_ref.actor.strategy
    if strategy not in FSDP_STRATEGIES:
        problems.append(f"plugins.{LORA} with actor_rollout_ref.actor.strategy={strategy}: the LoRA keys are "
                        f"translated onto verl's FSDP options (actor_rollout_ref.model.lora_rank, lora_alpha, "
                        f"target_modules), which only verl's FSDP engine reads (Megatron's reads "
                        f"actor_rollout_ref.model.lora.*)")
    if problems:
        raise ConfigError(f"the verl backend (plugin 'verl', verl {verl_version()}) cannot honour these LoRA "
                          f"settings of plugin {LORA!r}:\n  " + "\n  ".join(problems))
