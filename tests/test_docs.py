"""The docs site builds with ``mkdocs build --strict``, and every Python block of the docs runs.

How the blocks of a page run (the rule the pages are written to):

- Every block fenced as ```` ```python ```` runs, in page order, in one namespace per page (a page reads as
  one session: a later block uses what an earlier one defined), in a fresh working directory.
- A block whose first line is a comment naming a module file (``# reward_csv.py``) is also written as that
  module, importable by the blocks after it (a page shows a plugin module, then uses it).
- A block not meant to run (a signature, a fragment of a larger file, code for services this machine does not
  have) is marked in its page by the line ``<!-- docs: no-run (why) -->`` right above the fence (no page needs
  one today). Any other block that fails fails the test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
NO_RUN_MARK = re.compile(r"<!--\s*docs:\s*no-run\b[^>]*-->\s*$")
MODULE_LINE = re.compile(r"^# ([A-Za-z_][A-Za-z0-9_]*)\.py\s*$")


def blocks(page: Path) -> list[tuple[str, str | None]]:
    """(code, why it does not run, or None) of each ```` ```python ```` block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    out = []
    for match in FENCE.finditer(text):
        code = match.group(1)
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((code, "marked no-run in the page" if NO_RUN_MARK.search(before) else None))
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md") if any(why is None for _, why in blocks(p)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    modules = tmp_path / "modules"
    modules.mkdir()
    monkeypatch.syspath_prepend(str(modules))
    written: list[str] = []
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    try:
        for index, (code, why) in enumerate(blocks(page), 1):
            if why is not None:
                continue
            first = code.lstrip("\n").split("\n", 1)[0]
            if match := MODULE_LINE.match(first):
                (modules / f"{match.group(1)}.py").write_text(code, encoding="utf-8")
                written.append(match.group(1))
            try:
                exec(compile(code, f"{page.relative_to(REPO)} (python block {index})", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{page.relative_to(REPO)}: python block {index} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
    finally:
        for name in written:
            sys.modules.pop(name, None)


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page or a reference that does not resolve fails it."""
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    site = tmp_path / "site"
    hooks = (site / "reference/hooks/index.html").read_text()
    assert "post_process_batch" in hooks and "Kind: pipeline" in hooks
    directory = (site / "plugins/index.html").read_text()
    assert "agl-plugin-instant" in directory and "agl-plugin-stepadv" in directory
    for page in ("logger", "filter-stage", "slot-override", "estimator-settings", "checkpoint-state"):
        assert (site / "examples" / page / "index.html").is_file(), page
