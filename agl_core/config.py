"""Recipes: YAML read with OmegaConf, overridden from the command line, validated by pydantic.

A recipe has five core sections (``data``, ``algorithm``, ``trainer``,
``rollout``, ``plugins``). ``plugins`` activates plugins and holds their own
sections, each validated by the model the plugin returns from
``plugin_config_schema``::

    plugins:
      lora: {rank: 8}            # enables the plugin "lora" with its settings
      disable: [console]         # keeps built-ins out
      slots: {compute_ref_logprob: lora}
      order: {post_process_batch: [traces, filters]}

``plugins: [lora, sqlite]`` is a shorthand for plugins with default settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from agl_core.http.rules import temperature_problem
from agl_core.policies import PolicyConfig, check_agent_match, check_names
from agl_core.plugins import HOOK_KINDS, RESERVED_NAMES, PluginError, PluginSet, did_you_mean, parse_plugin_flags

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class ConfigError(ValueError):
    """A recipe that cannot run: names the key path, what is wrong and what is allowed."""


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list, description="JSONL files of tasks to train on")
    val_files: list[str] = Field(default_factory=list, description="JSONL files of validation tasks")
    train_batch_size: int = Field(8, ge=1, description="tasks per training step")
    val_batch_size: int | None = Field(None, ge=1, description="validation tasks per run (None: all)")
    max_prompt_length: int = Field(512, ge=1)
    max_response_length: int = Field(512, ge=1)
    shuffle: bool = True


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


class PolicyLossConfig(Section):
    name: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip bound for negative advantages")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"  # type: ignore[valid-type]
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"


class RolloutCorrectionConfig(Section):
    """Importance weights between the policy that served the rollouts and the trainer's old policy (verl's names)."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="truncated importance sampling (TIS): token: a weight per response token; sequence: one "
                          "per response (the product of its tokens' ratios); None: off")
    rollout_is_threshold: float = Field(2.0, gt=0, description="the cap of a TIS weight")


class AlgorithmConfig(Section):
    estimator: str = Field("grpo", description="a registered advantage estimator")
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    ppo_mini_batch_size: int = Field(8, ge=1, description="rows per PPO mini-batch")
    ppo_epochs: int = Field(1, ge=1)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)

    @field_validator("estimator")
    @classmethod
    def canonical_estimator(cls, name: str) -> str:
        """``reinforce++-baseline`` and ``grpo-passk`` mean verl's ``reinforce_plus_plus_baseline``, ``grpo_passk``."""
        return name.replace("++", "_plus_plus").replace("-", "_")


class AsyncConfig(Section):
    """``trainer.async``: the next steps' rollouts are collected while the backend computes and updates."""

    max_staleness: int = Field(0, ge=0, description="k: a step trains on rollouts served by weights at most k "
                                                    "updates older than the trainer's (0: synchronous, no overlap)")
    drain_timeout_s: float = Field(60.0, gt=0, description="at a weight sync, how long the gateway waits for the "
                                                           "calls in flight to finish before the weights change")
    prefetch_share: float = Field(1.0, gt=0, le=1, description="share of a later step's groups queued before the "
                                                               "weight syncs that precede it; the rest are queued "
                                                               "when that step starts, served by fresh weights")


class TrainerConfig(Section):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              serialize_by_alias=True)

    project_name: str = "agl"
    experiment_name: str = "default"
    run_dir: str = Field("runs/default", description="metrics, config and checkpoints of the run")
    seed: int = 0
    total_epochs: int = Field(1, ge=1)
    total_steps: int | None = Field(None, ge=1, description="stop after this many steps (None: epochs)")
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = Field(0, description="validate every N steps and at the end (<=0: never)")
    save_freq: int = Field(0, description="checkpoint every N steps and at the end (<=0: never)")
    resume: str = Field("auto", description="auto: the run directory's latest checkpoint of this run, if any | "
                                            "never: a new run (the run directory must be empty, see overwrite) | "
                                            "path of a checkpoint or run directory (also of another run)")
    overwrite: bool = Field(False, description="with resume: never, delete what the run directory holds (only if "
                                               "it is a run directory: it has run.json or config.yaml) and start "
                                               "over; ignored when resuming")
    critic_warmup: int = Field(0, ge=0, description="steps that update only the critic")
    balance_batch: bool = True
    progress: bool = True
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    agent_match: str | list[str] | None = Field(
        None, description="which policies' calls become training rows: a list of policy names, or a regex a name "
                          "must match whole (None: every policy); the others are served and recorded, never trained")


class SamplingConfig(Section):
    """Sampling parameters the gateway adds to a model call that does not set them (the agent's own win)."""

    temperature: float | None = Field(1.0, ge=0, description="sampling temperature (1.0: on-policy samples; "
                                                             "0: greedy)")
    top_p: float | None = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    max_tokens: int | None = Field(None, ge=1, description="response token limit (None: data.max_response_length)")

    @field_validator("temperature")
    @classmethod
    def _greedy_or_not_overflowing(cls, value: float | None) -> float | None:
        if value is not None and (problem := temperature_problem(value)) is not None:
            raise ValueError(problem)
        return value


class GatewayConfig(Section):
    """The HTTP gateway agents call; it records every model call with its token ids."""

    host: str = Field("127.0.0.1", description="address to bind; anything but loopback requires a token")
    port: int = Field(0, ge=0, le=65535, description="port to bind (0: a free port chosen by the OS)")
    token: str | None = Field(None, description="bearer token agents must send (default: $AGL_GATEWAY_TOKEN); "
                                                "required when host is not a loopback address")
    admin_token: str | None = Field(None, description="bearer token of the admin routes (PUT /v1/admin/policy; "
                                                      "default: $AGL_GATEWAY_ADMIN_TOKEN); never given to agents. "
                                                      "Unset with a token set: the admin routes are refused")
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="larger request bodies are refused with 413")
    body_timeout_s: float = Field(30.0, gt=0, description="time a client may take to send a request body; "
                                                          "a slower one is answered 408 and disconnected")
    max_n: int = Field(64, ge=1, description="most choices one call may ask for (n); more is refused with 400")
    upstream_token: str | None = Field(None, description="bearer token sent to the policy servers (default: "
                                                         "$AGL_POLICY_TOKEN); needed when they serve off loopback")
    max_retries: int = Field(3, ge=0, description="retries of a policy call answered 429/5xx or refused")
    retry_backoff_s: float = Field(0.1, ge=0, description="first retry delay; doubles with each retry")
    upstream_timeout_s: float = Field(600.0, gt=0, description="time allowed for one policy call")
    max_upstream_bytes: int = Field(64 * 2**20, ge=1024,
                                    description="most bytes of one policy server's answer (whole or streamed); a "
                                                "longer one is cut there and the call fails with 502")
    max_connections: int = Field(1024, ge=1, description="connections the gateway holds at once; one more is "
                                                         "answered 503 and closed")
    exact_contexts: bool = Field(True, description="send a chat call that continues an earlier call of the attempt "
                                                   "(its messages, its reply unchanged, new messages) upstream as "
                                                   "that call's exact token ids plus the new messages' ids, so the "
                                                   "tokens trained are the tokens sampled (docs/gateway.md)")
    tokenizer: str | None = Field(None, description="local directory of the policy's tokenizer, whose chat template "
                                                    "renders the new messages of exact contexts (default: the "
                                                    "directory the policy server lists as its model's root)")


class RolloutConfig(Section):
    n: int = Field(1, ge=1, description="samples per task (the group size of grpo/rloo)")
    agent: str | None = Field(None, description="the agent: 'package.module:function', or a name an installed "
                                                "distribution registers in the entry-point group agl_core.agents")
    model: str = Field("policy", description="model name agents are given (llm.model)")
    store: str = Field("memory", description="rollout store: 'memory' (built-in) or one a plugin registers "
                                             "('sqlite' from agl-plugin-sqlite)")
    n_workers: int = Field(8, ge=1, description="agent workers of the local runner (threads)")
    timeout_s: float = Field(600.0, gt=0, description="time an attempt may take before it ends timed_out")
    max_attempts: int = Field(2, ge=1, description="attempts per rollout, counting the first; a rollout is "
                                                   "requeued only when its worker is lost (lease expired)")
    lease_s: float = Field(30.0, gt=0, description="a running attempt not renewed for this long is lost")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    seed_calls: bool = Field(True, description="give every model call that sets no seed its own, derived from "
                                               "trainer.seed and the call's place (mode, step, task, sample, "
                                               "attempt, call): samples then do not depend on how concurrent calls "
                                               "were batched, and a resumed run repeats an uninterrupted one")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)


class PluginsConfig(Section):
    """The normalised ``plugins`` section."""

    enable: list[str] = Field(default_factory=list)
    disable: list[str] = Field(default_factory=list)
    slots: dict[str, str] = Field(default_factory=dict)
    order: dict[str, list[str]] = Field(default_factory=dict)
    sections: dict[str, Any] = Field(default_factory=dict)


class Recipe(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    policies: dict[str, PolicyConfig] = Field(
        default_factory=dict, description="several policies on one base model, by name (agl_core.policies); "
                                          "empty: the run's one policy")
    _plugin_config: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_policies(self) -> Recipe:
        check_names(self.policies)
        check_agent_match(self.trainer.agent_match, list(self.policies))
        return self

    @property
    def plugin_config(self) -> dict[str, BaseModel]:
        """Validated plugin sections by plugin name, filled by :func:`validate_plugin_sections`."""
        return self._plugin_config


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


def read_recipe(path: str | Path | None, overrides: list[str] = ()) -> dict[str, Any]:
    """Read a YAML recipe (or none) and apply ``key=value`` overrides; return plain data."""
    try:
        cfg = OmegaConf.load(path) if path else OmegaConf.create({})
    except FileNotFoundError:
        raise ConfigError(f"recipe file {path} does not exist") from None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"recipe file {path} is not valid YAML: {exc}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"recipe file {path} must hold a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot apply overrides {list(overrides)}: {exc}") from None


def normalise_plugins(raw: Any) -> dict[str, Any]:
    """``plugins`` as a list or a mapping → the fields of :class:`PluginsConfig`."""
    if raw is None:
        return {}
    if isinstance(raw, (list, ListConfig)):
        return {"enable": [str(name) for name in raw]}
    if not isinstance(raw, dict):
        raise ConfigError(f"plugins: expected a list of plugin names or a mapping, got {raw!r}")
    out: dict[str, Any] = {k: raw[k] for k in RESERVED_NAMES if k in raw}
    sections = {k: v for k, v in raw.items() if k not in RESERVED_NAMES}
    out["enable"] = list(sections)
    out["sections"] = {k: (v or {}) for k, v in sections.items()}
    return out


def validate_recipe(data: dict[str, Any]) -> Recipe:
    """Validate the core sections; raise :class:`ConfigError` naming every bad key."""
    data = dict(data)
    data["plugins"] = normalise_plugins(data.get("plugins"))
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc, Recipe)) from None
    for hook in recipe.plugins.slots:
        if HOOK_KINDS.get(hook) != "slot":
            raise ConfigError(f"plugins.slots.{hook}: not a slot hook{did_you_mean(hook, _hooks('slot'))}; "
                              f"slots: {', '.join(_hooks('slot'))}")
    for hook in recipe.plugins.order:
        if HOOK_KINDS.get(hook) != "pipeline":
            raise ConfigError(
                f"plugins.order.{hook}: not a pipeline hook{did_you_mean(hook, _hooks('pipeline'))}; "
                f"pipelines: {', '.join(_hooks('pipeline'))}"
            )
    return recipe


def validate_plugin_sections(recipe: Recipe, plugins: PluginSet) -> None:
    """Validate each ``plugins.<name>`` section with the model that plugin supplies.

    An active plugin the recipe gives no section (a built-in, or one enabled
    with ``-p NAME``) is validated as an empty section, so a required setting
    it lacks is named ``plugins.<name>.<key>``. The results are also the
    ``settings`` the plugin set hands to the ``register_*`` hooks.
    """
    schemas = plugins.broadcast("plugin_config_schema")
    for name, section in recipe.plugins.sections.items():
        schema = schemas.get(name)
        if schema is None:
            if section:
                raise ConfigError(f"plugins.{name}: plugin {name!r} takes no settings, got {section!r}")
            continue
        recipe.plugin_config[name] = _validate_section(name, schema, section)
    for name, schema in schemas.items():
        if schema is not None and name not in recipe.plugin_config:
            recipe.plugin_config[name] = _validate_section(name, schema, {})
    plugins.settings = recipe.plugin_config


def _validate_section(name: str, schema: type[BaseModel], section: Any) -> BaseModel:
    try:
        return schema.model_validate(section)
    except ValidationError as exc:
        hint = (f"\n  (plugin {name!r} has no section in the recipe: set its keys under plugins.{name} "
                f"or with overrides plugins.{name}.KEY=VALUE)" if not section else "")
        raise ConfigError(explain(exc, schema, prefix=f"plugins.{name}") + hint) from None


def load(
    path: str | Path | None,
    overrides: list[str] = (),
    plugin_flags: list[str] = (),
    extra_plugins: list[tuple[str, Any]] = (),
) -> tuple[Recipe, PluginSet]:
    """Read and validate a recipe and load the plugin set it asks for.

    ``plugin_flags`` are the CLI's ``-p NAME`` / ``-p no:NAME``;
    ``extra_plugins`` are ``(name, object)`` plugins that are not installed;
    one the plugin manager refuses (no ``AGL_HOOK_API``, an unknown hook, …)
    is a :class:`ConfigError` with the reason, as an enabled plugin that
    failed is.
    """
    recipe = validate_recipe(read_recipe(path, list(overrides)))
    enable, disable = parse_plugin_flags(plugin_flags)
    # The command line wins over the recipe, as in pytest: -p no:NAME switches off a plugin the recipe
    # enables (its section goes with it), -p NAME one the recipe disables.
    recipe.plugins.enable = [n for n in dict.fromkeys(recipe.plugins.enable + enable) if n not in disable]
    recipe.plugins.disable = [n for n in dict.fromkeys(recipe.plugins.disable + disable) if n not in enable]
    recipe.plugins.sections = {k: v for k, v in recipe.plugins.sections.items() if k not in disable}
    extra_names = {name for name, _ in extra_plugins}
    try:
        plugins = PluginSet.load(
            enable=[n for n in recipe.plugins.enable if n not in extra_names],
            disable=recipe.plugins.disable,
            extra=extra_plugins,
        )
    except PluginError as exc:
        raise ConfigError(str(exc)) from None
    for name in extra_names:  # asked for by object, as -p NAME asks for an installed one: refused is fatal
        plugin = plugins.plugins[name]
        if plugin.status == "failed":
            raise ConfigError(f"plugin {name!r} ({type(plugin.obj).__name__} object) was refused: {plugin.reason}")
    validate_plugin_sections(recipe, plugins)
    return recipe, plugins


def resolved(recipe: Recipe) -> dict[str, Any]:
    """The full recipe with defaults, plugin sections included, as plain data."""
    out = recipe.model_dump(mode="json")
    plugins = out.pop("plugins")
    sections = {name: {} for name in plugins["enable"]}
    sections.update({name: m.model_dump(mode="json") for name, m in recipe.plugin_config.items()})
    out["plugins"] = {**sections, "disable": plugins["disable"], "slots": plugins["slots"],
                      "order": plugins["order"]}
    return out


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False)


# --------------------------------------------------------------------------
# Error messages
# --------------------------------------------------------------------------


def explain(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per pydantic error: full key path, what is wrong, what is allowed."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(([prefix] if prefix else []) + loc)
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(_fields_at(model, err["loc"][:-1])) or "none"
            lines.append(f"{path}: unknown key (allowed keys: {allowed})"
                         f"{did_you_mean(loc[-1], _fields_at(model, err['loc'][:-1]))}")
        elif err["type"] == "missing":
            lines.append(f"{path}: required setting is missing")
        else:
            got = err.get("input")
            # a validator's own ValueError: its message, without pydantic's "Value error, " before it
            message = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
            lines.append(f"{path}: {message} (got {got!r})")
    return "invalid recipe:\n  " + "\n  ".join(lines)


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Names of the fields of the (nested) model reached by ``loc``."""
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == str(part)), None)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or n for n, f in model.model_fields.items()]  # a key the recipe writes (trainer.async)


def _hooks(kind: str) -> list[str]:
    return sorted(h for h, k in HOOK_KINDS.items() if k == kind)
