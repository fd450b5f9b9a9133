"""The sqlite store's own promises: a real file in WAL mode, several processes, the plugin, the checks of its file.

Crash safety (kill -9 of a writer) is in tests/faults/test_fault_store.py.
"""

import contextlib
import re
import selectors
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from agl_plugin_sqlite import SqliteStore
from agl_plugin_sqlite.store import SCHEMA

from agl_core.components import Components
from agl_core.context import TrainContext
from agl_core.data import Span, Task
from agl_core.rollout.store import NewRollout
from agl_core.rollout.store_client import Rollouts


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
                          kind="reward", reward=1.0)], leases={("a", "1"): attempt.lease})
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    reopened = SqliteStore(path)
    assert reopened.next_sequence_id("a") == 1  # counted on from what the file holds
    assert reopened.finish("a", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
    (rollout,) = reopened.get_rollouts(["a"])
    assert rollout.final_reward == 1.0 and [s.reward for s in rollout.spans] == [1.0]
    reopened.close()


def test_released_rollouts_are_deleted_unless_kept(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite", keep_consumed=False)
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    store.add_spans([Span(rollout_id="a", attempt_id="1", sequence_id=0, kind="annotation")],
                    leases={("a", "1"): attempt.lease})
    store.release(["a"])
    assert store.get_rollouts(["a"]) == []
    with contextlib.closing(sqlite3.connect(tmp_path / "r.sqlite")) as conn:
        assert conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == 0
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
            store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
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


def test_the_writers_of_one_process_take_turns_without_sqlites_busy_wait(tmp_path):
    """32 threads queue, lease, write spans and finish at once with no busy timeout at all: a writer that found
    SQLite's write lock taken would fail at once ("database is locked"); it waits for its turn instead."""
    store = SqliteStore(tmp_path / "r.sqlite", busy_timeout_s=0)
    errors = []

    def play(worker: int) -> None:
        try:
            for i in range(10):
                rollout_id = f"w{worker}-{i}"
                store.enqueue([NewRollout(rollout_id, Task(id="t", input={}))])
                attempt = store.dequeue(f"w{worker}", 30)
                store.add_spans([Span(rollout_id=attempt.rollout_id, attempt_id=attempt.attempt_id,
                                      sequence_id=store.next_sequence_id(attempt.rollout_id), kind="reward",
                                      reward=1.0)], leases={(attempt.rollout_id, attempt.attempt_id): attempt.lease})
                store.heartbeat(attempt.rollout_id, attempt.attempt_id, 30, lease=attempt.lease)
                store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's
            errors.append(f"worker {worker}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=play, args=(w,)) for w in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    ids = [f"w{w}-{i}" for w in range(32) for i in range(10)]
    rollouts = store.get_rollouts(ids)
    assert len(rollouts) == 320 and all(r.status == "succeeded" and len(r.spans) == 1 for r in rollouts)
    store.close()


def test_a_write_refused_or_failed_lets_the_next_one_in(tmp_path):
    """Another process holding the write lock past the busy timeout, or a write that fails, ends that write with
    its error and leaves the process's turn free: the next write goes through."""
    path = tmp_path / "r.sqlite"
    store = SqliteStore(path, busy_timeout_s=0.05)
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # another process writing
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            store.enqueue([NewRollout("b", Task(id="t", input={}))])
        other.execute("ROLLBACK")
    with pytest.raises(ValueError, match="already in the store"):
        store.enqueue([NewRollout("a", Task(id="t", input={}))])
    writer = threading.Thread(target=store.enqueue, args=([NewRollout("c", Task(id="t", input={}))],))
    writer.start()
    writer.join(10)
    assert not writer.is_alive()
    assert [r.rollout_id for r in store.query()] == ["a", "c"]
    store.close()


def test_a_span_written_again_is_kept_once(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    first = Span(rollout_id="a", attempt_id=attempt.attempt_id, sequence_id=0, kind="reward", reward=1.0)
    leases = {("a", attempt.attempt_id): attempt.lease}
    store.add_spans([first], leases=leases)
    store.flush()
    store.add_spans([first, first.model_copy(update={"sequence_id": 1})], leases=leases)  # retried with one more
    (rollout,) = store.get_rollouts(["a"])
    assert [(s.sequence_id, s.reward) for s in rollout.spans] == [(0, 1.0), (1, 1.0)]
    store.close()


def test_a_file_of_the_old_layout_opens_with_its_duplicate_spans_dropped_and_a_lease_column(tmp_path):
    path = tmp_path / "old.sqlite"
    old = re.sub(r",\n\s*lease\s+TEXT[^\n]*", "", SCHEMA.split("CREATE UNIQUE INDEX")[0])
    assert "lease " not in old and "lease token" not in old
    with contextlib.closing(sqlite3.connect(path)) as conn:  # the layout before spans were unique and leases
        conn.executescript(old + "CREATE INDEX spans_by_rollout ON spans (rollout_id, attempt_id, sequence_id);")
        conn.execute("INSERT INTO rollouts (rollout_id, task, sample_index, metadata, status, priority, "
                     "max_attempts) VALUES ('a', ?, 0, '{}', 'queuing', 1, 1)",
                     (Task(id="t", input={}).model_dump_json(),))
        span = Span(rollout_id="a", attempt_id="0", sequence_id=0, kind="annotation")
        conn.executemany("INSERT INTO spans VALUES ('a', '0', 0, 'annotation', ?)", [(span.model_dump_json(),)] * 2)
        conn.commit()
    store = SqliteStore(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0] == 1
        indexes = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "spans_once" in indexes and "spans_by_rollout" not in indexes
    assert store.next_sequence_id("a") == 1
    attempt = store.dequeue("w", 30)  # the migrated file takes leases
    store.add_spans([Span(rollout_id="a", attempt_id="1", sequence_id=1, kind="annotation")],
                    leases={("a", "1"): attempt.lease})
    assert store.finish("a", "1", "succeeded", lease=attempt.lease)
    assert [s.sequence_id for s in store.get_rollouts(["a"])[0].spans] == [1]
    store.close()


def test_next_sequence_id_of_a_rollout_not_held_is_a_key_error(tmp_path):
    store = SqliteStore(tmp_path / "r.sqlite")
    with pytest.raises(KeyError, match="'nope' is not in the store"):
        store.next_sequence_id("nope")
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    assert store.next_sequence_id("a") == 0
    store.release(["a"])
    with pytest.raises(KeyError, match="'a' is not in the store .* \\(it was released\\)"):
        store.next_sequence_id("a")
    store.close()


def test_reserved_sequence_ids_are_never_handed_out_again_after_a_restart(tmp_path):
    path = tmp_path / "r.sqlite"
    store = SqliteStore(path, reserve_sequence_ids=4)
    store.enqueue([NewRollout("a", Task(id="t", input={})), NewRollout("b", Task(id="t", input={}))])
    with contextlib.closing(sqlite3.connect(path)) as conn:  # the first block is reserved with the enqueue
        assert sorted(conn.execute("SELECT rollout_id, reserved FROM sequence_reserved")) == [("a", 4), ("b", 4)]
    handed = [store.next_sequence_id("a") for _ in range(6)]  # two blocks reserved; no span written yet
    assert handed == list(range(6)) and store.next_sequence_id("b") == 0
    store.close()  # as good as a kill: the reservations were committed when made

    reopened = SqliteStore(path, reserve_sequence_ids=4)
    assert reopened.next_sequence_id("a") == 8 and reopened.next_sequence_id("b") == 4
    reopened.release(["a"])
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT rollout_id FROM sequence_reserved").fetchall() == [("b",)]
    reopened.close()


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


# ---------------------------------------------------------------- the file is checked when the store opens


def a_store_file(path: Path) -> Path:
    """A real store file with a few hundred KB of spans, closed (checkpointed: no WAL beside it)."""
    store = SqliteStore(path)
    store.enqueue([NewRollout("r", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    store.add_spans([Span(rollout_id="r", attempt_id="1", sequence_id=i, kind="llm_call",
                          prompt_token_ids=list(range(100))) for i in range(500)], leases={("r", "1"): attempt.lease})
    store.close()
    return path


def write_random(path):
    path.write_bytes(bytes(range(256)) * 32)


def write_text(path):
    path.write_text("rollout_id,reward\nr0,1.0\n" * 100)


def write_truncated(path):
    data = a_store_file(path).read_bytes()
    path.write_bytes(data[: len(data) // 2])


def write_foreign(path):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE spans (id INTEGER PRIMARY KEY, text TEXT)")
        conn.commit()


@pytest.mark.parametrize(("write", "reason"), [
    (write_random, "file is not a database (it is not an SQLite database)"),
    (write_text, "file is not a database (it is not an SQLite database)"),
    (write_truncated, "database disk image is malformed (it is damaged or truncated)"),
    (write_foreign, "its table 'spans' is not a store's: it lacks the columns attempt_id, kind, rollout_id, "
                    "sequence_id, span")])
def test_a_file_that_is_not_a_sound_store_is_refused_naming_its_path(tmp_path, write, reason):
    path = tmp_path / "rollouts.sqlite"
    write(path)
    before = path.read_bytes()
    with pytest.raises(ValueError) as refused:
        SqliteStore(path)
    assert str(refused.value) == f"the SQLite store {path} cannot be used: {reason}"
    assert path.read_bytes() == before  # looked at, never repaired or overwritten


def test_a_damaged_page_that_sqlite_opens_is_found_by_the_quick_check(tmp_path):
    path = a_store_file(tmp_path / "rollouts.sqlite")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'spans_once'").fetchone()[0]
    data = bytearray(path.read_bytes())
    start = (root - 1) * page_size
    data[start:start + page_size] = b"\xff" * page_size  # the index's root page: header and schema still read
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"the SQLite store {path} cannot be used: it is damaged"):
        SqliteStore(path)


def test_an_sqlite_too_old_for_the_store_is_refused_naming_the_version(tmp_path, monkeypatch):
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 34, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.34.1")
    with pytest.raises(ValueError, match=r"r.sqlite cannot be used: this Python's SQLite is 3.34.1; .* 3.35 or newer"):
        SqliteStore(tmp_path / "r.sqlite")


def test_an_empty_file_is_a_new_store(tmp_path):
    path = tmp_path / "rollouts.sqlite"
    path.touch()
    store = SqliteStore(path)
    store.enqueue([NewRollout("a", Task(id="t", input={}))])
    assert [r.rollout_id for r in store.query()] == ["a"]
    store.close()


def test_a_path_that_cannot_be_a_file_is_refused_naming_it(tmp_path):
    (tmp_path / "a_file").touch()
    under_a_file = tmp_path / "a_file" / "run" / "rollouts.sqlite"
    with pytest.raises(ValueError, match=f"the SQLite store {under_a_file} cannot be used: its directory "
                                         f"{under_a_file.parent} cannot be created"):
        SqliteStore(under_a_file)
    with pytest.raises(ValueError, match=f"the SQLite store {tmp_path} cannot be used: it is a directory"):
        SqliteStore(tmp_path)


def test_a_directory_or_file_this_process_may_not_write_is_refused_naming_the_path():
    # Root writes anywhere whatever the mode bits, so the child drops to nobody when it is root (CI runs as
    # root); it imports first, as nobody may not read this interpreter's files. The directory is in the
    # system's temporary directory, which nobody may enter.
    directory = Path(tempfile.mkdtemp(prefix="agl-readonly-"))
    try:
        a_store_file(directory / "kept.sqlite")
        (directory / "kept.sqlite").chmod(0o444)
        directory.chmod(0o555)
        proc = child(f"""
            import os
            from agl_plugin_sqlite import SqliteStore
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            for name in ("new.sqlite", "kept.sqlite", "run/rollouts.sqlite"):
                try:
                    SqliteStore(os.path.join({str(directory)!r}, name))
                    print("opened", name)
                except ValueError as exc:
                    print(exc)
        """)
        out, err = proc.communicate(timeout=60)
    finally:
        directory.chmod(0o755)
        shutil.rmtree(directory)
    assert proc.returncode == 0 and not err, err.decode()
    assert out.decode().splitlines() == [
        f"the SQLite store {directory}/new.sqlite cannot be used: unable to open database file (check that "
        "its directory exists and this process may write there)",
        f"the SQLite store {directory}/kept.sqlite cannot be used: attempt to write a readonly database (this "
        "process may not write the file or its directory)",
        f"the SQLite store {directory}/run/rollouts.sqlite cannot be used: its directory {directory}/run cannot "
        f"be created (Permission denied: {directory}/run)"]


def fill(store: SqliteStore) -> list[str]:
    """Queue rollouts with big tasks until one does not fit in the store's ``max_bytes``; their ids."""
    ids = []
    while True:
        try:
            store.enqueue([NewRollout(f"fill{len(ids)}", Task(id="fill", input={"blob": "x" * 8000}))])
        except sqlite3.OperationalError as exc:
            assert str(exc) == "database or disk is full"
            return ids
        ids.append(f"fill{len(ids)}")


def test_a_full_file_loses_that_batch_alone_fails_its_attempt_and_is_written_again_once_room_is_freed(tmp_path,
                                                                                                       capfd):
    path = tmp_path / "rollouts.sqlite"
    store = SqliteStore(path, max_bytes=256 * 1024, keep_consumed=False)
    store.enqueue([NewRollout("r", Task(id="t", input={})), NewRollout("s", Task(id="t", input={}))])
    lost, kept = store.dequeue("w", 30), store.dequeue("w", 30)
    filler = fill(store)
    store.add_spans([Span(rollout_id="r", attempt_id="1", sequence_id=0, kind="annotation",
                          attributes={"text": "y" * 20000})], leases={("r", "1"): lost.lease})
    store.flush()  # returns: the batch is lost alone
    store.release(filler)  # room again
    store.add_spans([Span(rollout_id="s", attempt_id="1", sequence_id=0, kind="annotation",
                          attributes={"text": "y" * 20000})], leases={("s", "1"): kept.lease})
    assert store.finish("r", "1", "succeeded", 1.0, lease=lost.lease)
    assert store.finish("s", "1", "succeeded", 1.0, lease=kept.lease)
    r, s = store.get_rollouts(["r", "s"])
    assert r.status == "failed" and r.spans == []
    assert r.error == (f"spans not recorded: 1 span(s) of this attempt could not be written (the SQLite store "
                       f"{path} could not write them: OperationalError: database or disk is full)")
    assert (s.status, len(s.spans)) == ("succeeded", 1)
    store.close()
    assert capfd.readouterr().err == ""


def test_get_rollouts_json_is_the_json_of_get_rollouts(tmp_path):
    """The store service answers get_rollouts with it: the spans' JSON as the file holds it, not parsed again."""
    store = SqliteStore(tmp_path / "r.sqlite")
    store.enqueue([NewRollout("a", Task(id="t", input={"q": 1}), metadata={"spans": [], "text": '"spans":[]'}),
                   NewRollout("b", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    store.add_spans([Span(rollout_id="a", attempt_id=attempt.attempt_id, sequence_id=i, kind="llm_call",
                          prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.1])
                     for i in (2, 0, 1)], leases={("a", attempt.attempt_id): attempt.lease})
    store.finish("a", attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
    wanted = ["a", "b", "not-held"]
    assert Rollouts.model_validate_json(store.get_rollouts_json(wanted)).rollouts == store.get_rollouts(wanted)
    assert [s.sequence_id for s in store.get_rollouts(["a"])[0].spans] == [0, 1, 2]
    assert store.get_rollouts_json([]) == b'{"rollouts":[]}'
    store.close()


@pytest.mark.parametrize("keep_consumed", [True, False])
def test_more_rollouts_than_one_statement_takes_are_read_in_the_order_asked_and_released(tmp_path, keep_consumed):
    """Rollouts are read and released 500 to a statement (SQLite's parameter limit): 1,100 come back, each with
    its own spans, and are all released."""
    store = SqliteStore(tmp_path / "r.sqlite", keep_consumed=keep_consumed)
    ids = [f"r{i:04d}" for i in range(1100)]
    store.enqueue([NewRollout(rollout_id, Task(id="t", input={})) for rollout_id in ids])
    for _ in ids:
        attempt = store.dequeue("w", 30)
        store.add_spans([Span(rollout_id=attempt.rollout_id, attempt_id=attempt.attempt_id, sequence_id=i,
                              kind="llm_call", response_token_ids=[int(attempt.rollout_id[1:]), i])
                         for i in range(2)], leases={(attempt.rollout_id, attempt.attempt_id): attempt.lease})
        store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", 1.0, lease=attempt.lease)
    wanted = [*reversed(ids), "not-held", ids[7]]
    rollouts = store.get_rollouts(wanted)
    assert [r.rollout_id for r in rollouts] == [*reversed(ids), ids[7]]
    for r in rollouts:
        assert [s.response_token_ids for s in r.spans] == [[int(r.rollout_id[1:]), 0], [int(r.rollout_id[1:]), 1]]
    store.release(ids)
    assert store.query() == []
    assert len(store.get_rollouts(ids)) == (len(ids) if keep_consumed else 0)
    store.close()
