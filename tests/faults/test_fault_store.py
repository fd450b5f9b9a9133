"""Faults of the SQLite store: a span writer killed with SIGKILL mid-stream, and store files that cannot be used.

A killed writer loses no acknowledged span and duplicates none. A store file that is not an SQLite database,
is truncated, or lies where no file can be written stops ``agl train`` at start-up, before any agent runs, with
one ``agl: error:`` line naming the path (exit code 2, no traceback).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agl_plugin_sqlite import SqliteStore

from agl_core.data import Task
from agl_core.rollout.store import NewRollout

ACKNOWLEDGED = 12  # flushed batches the parent waits for before it kills the writer

WRITER = """
import sys
from agl_plugin_sqlite import SqliteStore
from agl_core.data import Span, Task
from agl_core.rollout.store import NewRollout

store = SqliteStore(sys.argv[1], batch_size=32)
store.enqueue([NewRollout("r", Task(id="t", input={}))])
attempt = store.dequeue("writer", 60)
while True:
    ids = [store.next_sequence_id("r") for _ in range(50)]
    store.add_spans([Span(rollout_id="r", attempt_id=attempt.attempt_id, sequence_id=i, kind="llm_call",
                          prompt_token_ids=list(range(40)), response_token_ids=[i], response_logprobs=[-0.5])
                     for i in ids], leases={("r", attempt.attempt_id): attempt.lease})
    store.flush()
    print(ids[-1], flush=True)  # every span up to here is acknowledged
"""


def acknowledged_ids(proc: subprocess.Popen, count: int, timeout_s: float = 60.0) -> list[int]:
    """The first ``count`` sequence ids ``proc`` prints; fails after ``timeout_s``."""
    ids: list[int] = []
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while len(ids) < count:
        left = deadline - time.monotonic()
        assert left > 0 and selector.select(left), f"the writer acknowledged {len(ids)} batches in {timeout_s} s"
        line = proc.stdout.readline()
        assert line, f"the writer exited (rc={proc.wait()}): {proc.stderr.read()}"
        ids.append(int(line))
    return ids


def test_kill_9_of_a_span_writer_keeps_every_acknowledged_span_once(tmp_path):
    path = tmp_path / "rollouts.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        highest = acknowledged_ids(proc, ACKNOWLEDGED)[-1]
        proc.send_signal(signal.SIGKILL)  # while it writes the next batches
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate(timeout=30)

    store = SqliteStore(path)  # the file a kill left (with its WAL) passes the start-up checks
    try:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            twice = conn.execute("SELECT rollout_id, attempt_id, sequence_id, COUNT(*) FROM spans "
                                 "GROUP BY rollout_id, attempt_id, sequence_id HAVING COUNT(*) > 1").fetchall()
        assert twice == []
        with contextlib.closing(sqlite3.connect(path)) as conn:  # the operator's view: the killed writer's lease
            (lease,) = conn.execute("SELECT lease FROM rollouts WHERE rollout_id = 'r'").fetchone()
        assert store.finish("r", "1", "failed", error="the writer was killed", lease=lease)
        (rollout,) = store.get_rollouts(["r"])
        ids = [s.sequence_id for s in rollout.spans]
        assert ids[: highest + 1] == list(range(highest + 1))  # every acknowledged span, in order
        assert ids == list(range(len(ids)))  # and after them only whole batches, nothing half-written
        assert all(s.response_token_ids == [s.sequence_id] for s in rollout.spans)
    finally:
        store.close()


# ---------------------------------------------------------------- store files that cannot be used


def a_store_file(path: Path) -> Path:
    store = SqliteStore(path)
    store.enqueue([NewRollout(f"r{i}", Task(id="t", input={"text": "x" * 200})) for i in range(200)])
    store.close()
    return path


def truncated(tmp_path: Path) -> Path:
    path = a_store_file(tmp_path / "rollouts.sqlite")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def not_sqlite(tmp_path: Path) -> Path:
    path = tmp_path / "rollouts.sqlite"
    path.write_bytes(b"\x00\x01garbage\xff" * 1000)
    return path


def under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path / "a_file" / "rollouts.sqlite"


MARKER_AGENT = """
from pathlib import Path

def agent(task, llm):
    Path(__file__).with_name("agent_ran").touch()
    return 1.0
"""


@pytest.mark.parametrize(("make", "reason"), [
    (not_sqlite, "file is not a database (it is not an SQLite database)"),
    (truncated, "database disk image is malformed (it is damaged or truncated)"),
    (under_a_file, "its directory {path.parent} cannot be created"),
])
def test_agl_train_on_a_store_file_that_cannot_be_used_stops_at_start_up_naming_it(agl, tmp_path, run_dir, make,
                                                                                   reason):
    path = make(tmp_path)
    agents = tmp_path / "agents"  # the recipe's agent, swapped for one that leaves a mark when it runs
    agents.mkdir()
    (agents / "marker_agent.py").write_text(MARKER_AGENT)
    pythonpath = os.pathsep.join(filter(None, [str(agents), os.environ.get("PYTHONPATH")]))
    result = agl.run("train", agl.GUESS_NUMBER, f"trainer.run_dir={run_dir}", "trainer.total_steps=1",
                     f"plugins.sqlite.path={path}", "rollout.agent=marker_agent:agent",
                     env={"PYTHONPATH": pythonpath}, timeout=180)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("agl: error:")]
    assert result.returncode == 2 and len(errors) == 1, output
    assert errors[0].startswith(f"agl: error: the SQLite store {path} cannot be used: {reason.format(path=path)}")
    assert "Traceback" not in output
    assert not (agents / "agent_ran").exists()
