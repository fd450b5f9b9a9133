"""agl-plugin-teachers: learning from teachers, judges and demonstrations, and measuring what was learned.

Plugins (entry points of the group ``agl_core.plugins``): ``distill``
(on-policy distillation), ``judge`` (an LLM judge or reward model scoring
rollouts), ``sft`` (SFT losses and the filter of the rows they train on),
``transcripts`` (an offline dataset of transcripts in place of agents).
``agl eval`` is :mod:`agl_plugin_teachers.evaluation`.
"""
