"""The CSV logger: the columns the recipe names, one line per logged step, in ``<run_dir>/<filename>``."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path


def write_row(path: Path, columns: list[str], step: int, metrics: dict) -> None:
    """Append the step's line (header first when the file is new); a metric the step lacks is left empty."""
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["step", *columns])
        writer.writerow([step, *(_cell(metrics.get(c)) for c in columns)])


def drop_steps_from(path: Path, first_step: int) -> None:
    """Keep the header and the lines of the steps before ``first_step`` (a resumed run logs the others again).

    Written aside and renamed, so a kill leaves the old file or the new one, never half of one.
    """
    if not path.exists():
        return
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(rows[0])
    writer.writerows(row for row in rows[1:] if row and row[0].isdigit() and int(row[0]) < first_step)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(out.getvalue(), encoding="utf-8")
    os.replace(partial, path)


def _cell(value) -> str:
    return "" if value is None else f"{float(value):.6g}"
