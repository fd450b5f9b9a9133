"""Plugin ``distill``: on-policy distillation from a teacher that scores the student's samples.

Enable it and pick its estimator::

    algorithm: {estimator: distill}
    plugins:
      distill:
        teacher: {model_path: runs/teacher_model}     # or {endpoint: http://host:8000/v1, model: big}
        reward_weight: 0.0                             # > 0: mixed with the reward's advantages

Hooks:

* ``post_process_batch`` (``AGL_ORDER = 50``, after the trace aggregator and
  its filters): the column ``teacher_log_probs``, the teacher's log-prob of
  every response token (:mod:`agl_plugin_teachers.teacher`); metrics
  ``teacher/tokens``, ``teacher/requests``, ``timing_s/teacher`` and, when the
  policy server reported its samples' log-probs, ``teacher/reverse_kl``.
* ``register_estimators``: ``distill``, advantages ``coef * (teacher -
  student)`` per token (:mod:`agl_plugin_teachers.distill_math`, the student's
  log-probs are ``old_log_probs``) plus ``reward_weight`` times the advantages
  of ``reward_estimator`` (grpo by default).
* ``on_train_start``: loads a ``model_path`` teacher into this process (scored with
  the embedded backend's forward pass, like ``old_log_prob``) or connects to an
  endpoint teacher, checks that student and teacher tokenize alike, refuses a
  run whose estimator is not ``distill``.
"""

from __future__ import annotations

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.plugins import PluginError

from agl_plugin_teachers.settings import DistillConfig

AGL_HOOK_API = HOOK_API_VERSION
AGL_ORDER = 50  # after the trace aggregator (5) and the filters: only the rows trained on are scored
NAME = "distill"
ESTIMATOR = "distill"


class DistillEstimator:
    """The estimator ``distill`` with its plugin's settings; ``reward`` (the reward's estimator) is bound at start."""

    def __init__(self, settings: DistillConfig | None):
        self.settings, self.reward = settings, None

    def __call__(self, batch, config):
        from agl_plugin_teachers.distill_math import reverse_kl_advantages

        if "teacher_log_probs" not in batch:
            raise PluginError("the estimator 'distill' needs the column teacher_log_probs: enable the plugin "
                              "distill with a teacher in its section plugins.distill")
        s = self.settings
        advantages = s.coef * reverse_kl_advantages(batch["teacher_log_probs"], batch["old_log_probs"],
                                                    batch["response_mask"], s.discount)
        if s.reward_weight > 0:
            reward_advantages, _ = self.reward(batch, config)
            advantages = advantages + s.reward_weight * reward_advantages
        return advantages, advantages


@hookimpl
def plugin_config_schema():
    return DistillConfig


@hookimpl
def register_estimators(register, settings):
    if settings is not None:
        register(ESTIMATOR, DistillEstimator(settings))


@hookimpl(trylast=True)  # after the backend's: the student's tokenizer exists then
def on_train_start(ctx):
    from agl_plugin_teachers.endpoints import Served, load_tokenizer, student_tokenizer, tokenizer_fingerprint
    from agl_plugin_teachers.teacher import LocalTeacher, TeacherScorer

    cfg: DistillConfig = ctx.plugin_config(NAME)
    if ctx.config.algorithm.estimator != ESTIMATOR:
        raise PluginError(f"plugins.distill is active but algorithm.estimator is "
                          f"{ctx.config.algorithm.estimator!r}: the teacher's log-probs would be unused; set "
                          f"algorithm.estimator={ESTIMATOR} (and plugins.distill.reward_weight to mix in the reward)")
    estimator = ctx.components.get("estimator", ESTIMATOR).obj
    if cfg.reward_weight > 0:
        if cfg.reward_estimator == ESTIMATOR:
            raise PluginError("plugins.distill.reward_estimator cannot be 'distill' itself")
        estimator.reward = ctx.components.get("estimator", cfg.reward_estimator).obj
    student = student_tokenizer(ctx)
    if cfg.teacher.model_path is not None:
        teacher = LocalTeacher(cfg.teacher, cfg.teacher.rows_per_request)
        teacher_tokenizer = teacher.tokenizer
    else:
        teacher = TeacherScorer(Served(cfg.teacher, "teacher"), cfg.teacher.rows_per_request, student)
        teacher_tokenizer = load_tokenizer(cfg.teacher.tokenizer) if cfg.teacher.tokenizer else None
    if student is not None and teacher_tokenizer is not None and \
            tokenizer_fingerprint(student) != tokenizer_fingerprint(teacher_tokenizer):
        teacher.close()
        raise PluginError(f"the teacher ({cfg.teacher.describe()}) and the student have different tokenizers "
                          f"(vocabulary hashes {tokenizer_fingerprint(teacher_tokenizer)} and "
                          f"{tokenizer_fingerprint(student)}): the teacher's log-probs of the student's token ids "
                          f"would be of other text. Distil from a teacher with the student's tokenizer")
    ctx.state[NAME] = teacher


@hookimpl
def post_process_batch(ctx, batch):
    from agl_plugin_teachers.distill_math import reverse_kl

    if len(batch) == 0 or "input_ids" not in batch:
        return batch
    batch["teacher_log_probs"], metrics = ctx.state[NAME].score_batch(batch)
    if "rollout_log_probs" in batch:
        metrics["teacher/reverse_kl"] = reverse_kl(batch["teacher_log_probs"], batch["rollout_log_probs"],
                                                   batch["response_mask"])
    ctx.step_metrics.update(metrics)
    return batch


@hookimpl
def on_train_end(ctx):
    scorer = ctx.state.pop(NAME, None)
    if scorer is not None:
        scorer.close()
