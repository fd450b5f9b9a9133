"""mkdocs hook: links from a page to files of the repository outside ``docs/`` (``../agl_core/hookspecs.py``).

They work when the Markdown is read in the repository; on the site there is no such page. A link to a module
that has a reference page goes there; any other link to an existing file or folder becomes its path in code
(``agl_core/loop.py``). A link to something that does not exist is left alone, so ``--strict`` still fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

REFERENCE_PAGES = {
    "agl_core/hookspecs.py": "reference/hooks.md",
    "agl_core/context.py": "reference/context.md",
    "agl_core/data.py": "reference/batch.md",
    "agl_core/rollout/store.py": "reference/store.md",
    "agl_core/testing/contracts.py": "reference/testing.md",
    "agl_core/testing/__init__.py": "reference/testing.md",
}
LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo = docs_dir.parent
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        path = posixpath.normpath(posixpath.join(page_dir, target))  # relative to docs/
        if not path.startswith("../"):
            return match.group(0)  # inside docs/: mkdocs checks it
        in_repo = posixpath.normpath(path.removeprefix("../"))
        if not (repo / in_repo).exists():
            return match.group(0)
        if in_repo in REFERENCE_PAGES:
            return f"[{text}]({posixpath.relpath(REFERENCE_PAGES[in_repo], page_dir or '.')})"
        return text if text.strip("`") == in_repo else f"{text} (`{in_repo}`)"

    return LINK.sub(rewrite, markdown)
