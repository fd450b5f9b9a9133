"""The sqlite store's own promises: a real file in WAL mode, crash safety, several processes, the plugin."""

import contextlib
import selectors
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from agl_plugin_sqlite import SqliteStore

from agl_core.components import Components
from agl_core.context import TrainContext
from agl_core.data import Span, Task
from agl_core.store import NewRollout


def read_lines(proc, until, timeout_s=60.0):
    """Lines of ``proc``'s stdout until ``until(lines)`` holds; fails after ``timeout_s``."""
    lines = []
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while not until(lines):
        left = deadline - time.monotonic()
        assert left > 0, f"child did not get there in {timeout_s} s; stderr: {proc.stderr.read1().decode()}"
        if selector.select(left):
            line = proc.stdout.readline()
            assert line, f"child exited early (rc={proc.poll()}): {proc.stderr.read().decode()}"
            lines.append(line.decode().strip())
    return lines


def child(code):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_file_is_wal_and_survives_reopening(tmp_path):
    path = tmp_path / "run" / "rollouts.sqlite"
    store = SqliteStore(path)
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    store.add_spans([Span(rollout_id="a", attempt_id="1", sequence_id=store.next_sequence_id("a"),
                          kind="reward", reward=1.0)])
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    reopened = SqliteStore(path)
    assert reopened.next_sequence_id("a") == 1  # counted on from what the file holds
    assert reopened.finish("a", attempt.attempt_id, "succeeded", 1.0)
    (rollout,) = reopened.get_rollouts(["a"])
    assert rollout.final_reward == 1.0 and [s.reward for s in rollout.spans] == [1.0]
    reopened.close()


def test_released_rollouts_are_deleted_unless_kept(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite", keep_consumed=False)
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    store.add_spans([Span(rollout_id="a", sequence_id=0, kind="annotation")])
    store.release(["a"])
    assert store.get_rollouts(["a"]) == []
    with contextlib.closing(sqlite3.connect(tmp_path / "r.sqlite")) as conn:
        assert conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == 0
    store.close()


def test_kill_9_of_a_writing_process_keeps_every_committed_span(tmp_path):
    path = tmp_path / "rollouts.sqlite"
    proc = child(f"""
        from agl_plugin_sqlite import SqliteStore
        from agl_core.data import Span, Task
        from agl_core.store import NewRollout
        store = SqliteStore({str(path)!r}, batch_size=64)
        store.enqueue([NewRollout("r", Task(id="t", input={{}}))])
        attempt = store.dequeue("w", 30)
        def spans(n):
            return [Span(rollout_id="r", attempt_id=attempt.attempt_id, sequence_id=store.next_sequence_id("r"),
                         kind="llm_call", prompt_token_ids=list(range(50)), response_token_ids=[1, 2, 3],
                         response_logprobs=[-0.5, -0.25, -0.125]) for _ in range(n)]
        committed = 0
        while True:
            store.add_spans(spans(100))
            store.flush()
            committed += 100
            print(committed, flush=True)
            store.add_spans(spans(10))  # more in flight, unflushed, when the kill lands
    """)
    try:
        lines = read_lines(proc, lambda lines: len(lines) >= 20)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=10)  # reaps it and closes the pipes
    committed = int(lines[-1])

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    store = SqliteStore(path)
    assert store.finish("r", "1", "failed", error="writer was killed")
    (rollout,) = store.get_rollouts(["r"])
    assert len(rollout.spans) >= committed
    ids = [s.sequence_id for s in rollout.spans]
    assert ids == list(range(len(ids)))  # no committed span missing, none half-written
    assert all(s.response_logprobs == [-0.5, -0.25, -0.125] for s in rollout.spans)
    store.close()


def test_two_processes_dequeue_each_rollout_exactly_once(tmp_path):
    path = tmp_path / "rollouts.sqlite"
    store = SqliteStore(path)
    store.enqueue([NewRollout(f"r{i}", Task(id=f"t{i}", input={})) for i in range(40)])
    code = f"""
        from agl_plugin_sqlite import SqliteStore
        store = SqliteStore({str(path)!r})
        print("ready", flush=True)
        input()
        while (attempt := store.dequeue("w", 30)) is not None:
            store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", 1.0)
            print(attempt.rollout_id, flush=True)
        print("done", flush=True)
        store.close()
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        for proc in procs:
            read_lines(proc, lambda lines: lines == ["ready"])
        for proc in procs:  # start both at once
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        taken = []
        for proc in procs:
            taken += read_lines(proc, lambda lines: lines[-1:] == ["done"])[:-1]
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=10)
    assert sorted(taken) == sorted(f"r{i}" for i in range(40))
    assert store.wait([f"r{i}" for i in range(40)], timeout_s=1) == {f"r{i}" for i in range(40)}
    store.close()


def test_the_plugin_puts_the_store_in_the_run_directory(make_recipe, tmp_path):
    recipe, plugins = make_recipe(["rollout.store=sqlite", "plugins.sqlite.batch_size=8"], flags=["sqlite"])
    components = Components.collect(plugins)
    ctx = TrainContext(recipe, plugins, components, Path(recipe.trainer.run_dir))
    store = components.get("store", "sqlite").obj(ctx)
    try:
        assert store.path == tmp_path / "run" / "rollouts.sqlite" and store.batch_size == 8
    finally:
        store.close()


def test_unknown_plugin_setting_is_refused(make_recipe):
    from agl_core.config import ConfigError

    with pytest.raises(ConfigError, match="plugins.sqlite.batchsize: unknown key"):
        make_recipe(["plugins.sqlite.batchsize=8"], flags=["sqlite"])
