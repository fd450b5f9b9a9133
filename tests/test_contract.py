"""The hook contract documents itself: every hook states its kind, and docs/hooks.md lists it."""

import inspect
import re
from pathlib import Path

from agl_core import hookspecs
from agl_core.plugins import HOOK_KINDS

DOCS = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()


def test_every_hook_has_a_kind_and_a_docstring_naming_it():
    assert {"collect_rollouts", "post_process_batch", "compute_ref_logprob", "advantage", "log_metrics"} <= set(HOOK_KINDS)
    for name, kind in HOOK_KINDS.items():
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert doc and f"Kind: {kind}" in doc, name


def test_the_five_named_hooks_have_the_kinds_of_the_design():
    assert HOOK_KINDS["collect_rollouts"] == "slot"
    assert HOOK_KINDS["post_process_batch"] == "pipeline"
    assert HOOK_KINDS["compute_ref_logprob"] == "slot"
    assert HOOK_KINDS["advantage"] == "slot"
    assert HOOK_KINDS["log_metrics"] == "broadcast"


def test_docs_list_every_hook_with_its_kind():
    rows = dict(re.findall(r"^\| `(\w+)\(.*?\)` \| (\w+) \|", DOCS, flags=re.M))
    assert rows == HOOK_KINDS
