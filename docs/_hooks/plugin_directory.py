"""mkdocs hook: fills ``docs/plugins.md`` with the installed plugins, read from their entry points (no import)."""

from __future__ import annotations

from importlib import metadata

MARKER = "<!-- agl-plugin-directory -->"
GROUP = "agl_core.plugins"


def plugin_table() -> str:
    """A Markdown table of every entry point of ``agl_core.plugins``: name, distribution, version, what it is."""
    rows = {}
    for ep in metadata.entry_points(group=GROUP):
        dist = ep.dist
        summary = (dist.metadata.get("Summary") or "") if dist else ""
        rows.setdefault(ep.name, (ep.name, dist.name if dist else "?", dist.version if dist else "?", ep.value,
                                  summary.replace("|", "\\|")))
    lines = ["| plugin | distribution | version | module | description |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{n}` | {d} | {v} | `{m}` | {s} |" for n, d, v, m, s in sorted(rows.values())]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, plugin_table())
    return markdown
