#!/usr/bin/env python
"""Make agl_core and its plugins importable and discoverable from this checkout without installing them.

    python scripts/source_dists.py SITE [DIST_DIR ...]

For the repository root and each plugin directory given (default: the root and every ``plugins/*``), writes
into ``SITE`` a ``NAME-VERSION.dist-info`` with the distribution's metadata and entry points, read from its
``pyproject.toml``, and prints the ``PYTHONPATH`` entries that make its code importable (the source
directories). With ``SITE`` and those entries on ``PYTHONPATH``, ``importlib.metadata`` finds the
distributions and their ``agl_core.plugins`` entry points as after a ``pip install -e``, but nothing is built,
so no build backend has to be fetched: what a machine without a package registry needs.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_dist_info(project_dir: Path, site: Path) -> str:
    """Write ``project_dir``'s dist-info into ``site``; return its source directory (a ``PYTHONPATH`` entry)."""
    project = tomllib.loads((project_dir / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sections = [(f"[{group}]", points) for group, points in project.get("entry-points", {}).items()]
    if scripts := project.get("scripts"):
        sections.append(("[console_scripts]", scripts))
    (info / "entry_points.txt").write_text("".join(
        header + "\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
        for header, points in sections))
    (info / "INSTALLER").write_text("scripts/source_dists.py\n")
    return str(project_dir)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    site = Path(argv[0]).resolve()
    dirs = [Path(d).resolve() for d in argv[1:]] or [REPO, *sorted(p for p in (REPO / "plugins").iterdir()
                                                                    if (p / "pyproject.toml").is_file())]
    print(":".join(write_dist_info(d, site) for d in dirs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
