"""Task files and the order in which a run visits them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from agl_core.data import Task


def load_tasks(paths: list[str], split: str) -> list[Task]:
    """Read tasks from JSONL files, one JSON object per line; errors name the file and line."""
    tasks = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read task file {path}: {exc.strerror}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record.setdefault("split", split)
                tasks.append(Task.model_validate(record))
            except (json.JSONDecodeError, ValidationError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not a task: {exc}") from None
    return tasks


class TaskSampler:
    """Batches of tasks, epoch after epoch, in a seeded order that a checkpoint can resume.

    Each epoch is a permutation drawn from ``seed + epoch``; the last partial
    batch of an epoch is dropped, as verl's train dataloader does.
    """

    def __init__(self, tasks: list[Task], batch_size: int, shuffle: bool, seed: int):
        if len(tasks) < batch_size:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the {len(tasks)} training tasks"
            )
        self.tasks, self.batch_size, self.shuffle, self.seed = tasks, batch_size, shuffle, seed
        self.epoch, self.index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return len(self.tasks) // self.batch_size

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.tasks))
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.tasks))

    def next_batch(self) -> list[Task]:
        """The next batch; moves to the next epoch when this one is used up."""
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        start = self.index * self.batch_size
        picked = self._order()[start:start + self.batch_size]
        self.index += 1
        return [self.tasks[i] for i in picked]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
