"""``agl show RUN_DIR [--step N] [-n K]``: a few trained rows of a step, as the ``samples`` plugin wrote them.

Each row is a panel titled with its step, rollout and turn: its reward, advantages and lengths, then the
prompt and the response (every token after the prompt: the environment's replies between turns too). Without ``--step``, the last step written.
"""

from __future__ import annotations

from pathlib import Path

from agl_core.builtin.samples import DIRNAME, NAME, read_step, steps_in


def pick(run_dir: Path, step: int | None) -> tuple[int, Path]:
    """The step to show (``None``: the last one written) and its file; a ValueError that says what there is."""
    folder = Path(run_dir) / DIRNAME
    steps = steps_in(folder) if folder.is_dir() else {}
    if not steps:
        raise ValueError(f"{run_dir} holds no samples ({folder} is missing or empty): train with the "
                         f"{NAME} plugin on, plugins: {{{NAME}: {{rows: 8}}}} in the recipe or -p {NAME}")
    if step is None:
        step = max(steps)
    if step not in steps:
        nearest = min(steps, key=lambda s: abs(s - step))
        raise ValueError(f"{run_dir} has no samples of step {step} (nearest: {nearest}; steps written: "
                         f"{_ranges(list(steps))})")
    return step, steps[step]


def show(run_dir: str | Path, step: int | None = None, rows: int = 3, width: int | None = None) -> None:
    """Print ``rows`` records of ``step`` of ``run_dir`` (rich panels)."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    step, path = pick(Path(run_dir), step)
    records = read_step(path)
    console = Console(width=width, highlight=False)
    console.print(f"{path}: step {step}, {min(rows, len(records))} of the {len(records)} rows written")
    for record in records[:rows]:
        title = f"step {record['step']} · rollout {record['rollout_id']} · turn {record['turn_index']}"
        body = Text(f"reward {record['reward']:.4g}")
        advantage = record.get("advantage")
        if advantage is not None:
            body.append(f" · advantage {advantage['mean']:+.3g} (min {advantage['min']:+.3g}, "
                        f"max {advantage['max']:+.3g})")
        body.append(f" · prompt {record['prompt_length']} tokens · response {record['response_length']} "
                    f"({record['trained_tokens']} trained)\n", style=None)
        if record.get("text"):
            body.append("prompt   ", style="bold")
            body.append(record["prompt"] + "\n", style="dim")
            body.append("response ", style="bold")
            body.append(record["response"])
        else:
            body.append("prompt   ", style="bold")
            body.append(f"{record['prompt_ids']}\n", style="dim")
            body.append("response ", style="bold")
            body.append(f"{record['response_ids']}\n(token ids: the backend gave no tokenizer)")
        console.print(Panel(body, title=title, title_align="left"))


def _ranges(steps: list[int]) -> str:
    """``1-5, 8, 10-12`` for sorted steps."""
    parts, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def cmd_plot(args) -> int:
    from agl_core.builtin.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def cmd_show(args) -> int:
    show(args.run_dir, args.step, args.rows)
    return 0
