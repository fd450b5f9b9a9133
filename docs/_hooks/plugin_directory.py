"""mkdocs hook: fills ``docs/plugins.md`` with the installed plugins, read from their entry points.

Nothing is imported: a plugin is described by the first line of its module's docstring, read from the source
(so a broken or heavy plugin neither fails nor slows the build), else by its distribution's summary.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib import metadata

MARKER = "<!-- agl-plugin-directory -->"
GROUP = "agl_core.plugins"


def plugin_table() -> str:
    """A Markdown table of every entry point of ``agl_core.plugins``: name, distribution, version, what it is."""
    rows = {}
    for ep in metadata.entry_points(group=GROUP):
        dist = ep.dist
        summary = module_summary(ep.module) or ((dist.metadata.get("Summary") or "") if dist else "")
        rows.setdefault(ep.name, (ep.name, dist.name if dist else "?", dist.version if dist else "?", ep.value,
                                  summary.replace("|", "\\|")))
    lines = ["| plugin | distribution | version | module | description |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{n}` | {d} | {v} | `{m}` | {s} |" for n, d, v, m, s in sorted(rows.values())]
    return "\n".join(lines)


def module_summary(module: str) -> str:
    """The first line of ``module``'s docstring, from its source file; "" when it cannot be read."""
    try:
        spec = importlib.util.find_spec(module)
        source = open(spec.origin, encoding="utf-8").read() if spec and spec.origin else ""
        doc = ast.get_docstring(ast.parse(source)) or ""
    except (ImportError, OSError, SyntaxError, ValueError):
        return ""
    return doc.strip().split("\n", 1)[0]


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, plugin_table())
    return markdown
