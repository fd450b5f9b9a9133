"""The rollout store in one SQLite file (WAL mode), shared safely by every process that opens it.

Queue and attempt changes are single transactions (``BEGIN IMMEDIATE``, or
one statement), so several processes may dequeue from the same file. Within
a process, writers take turns on a lock first (SQLite's own wait for its
write lock is sleep-and-retry, unfair among many threads). Spans go through a bounded
queue to one writer thread that inserts them in batches: under load a commit
carries hundreds of spans, and when idle a span is committed at once. With
``synchronous=NORMAL`` in WAL mode a committed transaction survives the
kill -9 of any process (a power cut may lose the last few).

Span sequence ids are counted in the process that writes a rollout's spans
(seeded from the file), which is the process running the rollout's gateway
(or the store service, for its clients). With ``reserve_sequence_ids`` the
file also records how far ahead ids were handed out, so that a restarted
process never hands out an id again: the store service needs it, because its
clients may still hold spans under ids it gave before it was killed.

A span is written once: (rollout, attempt, sequence id) is unique in the
file and the same span written again is ignored, so that an upload retried
after it was written (a client of the store service that lost the answer)
duplicates nothing; another span under a key already held is a LeaseError.
Files made before that index get it when opened (their duplicate spans, if
any, are dropped first, keeping the first written).

Each attempt has a lease token (column ``lease``) that heartbeat, finish,
admit and span writes must name (:class:`~agl_core.rollout.store.LeaseError`
otherwise). Files made before leases get the column when opened (migrated in
place, nothing else changes); an attempt running in such a file has no token,
so its old worker cannot renew it and it is requeued when its lease runs out.

Spans are checked (:func:`~agl_core.http.recordable.check_span`, the attempt and
its token) when added, in the caller's thread; a batch the writer then fails
to write (a full disk: see ``max_bytes``) is lost alone and fails its
attempts at their ``finish`` (which waits for the writer), and the writer
goes on with the next batch.

Opening a store checks its file before anything runs (:meth:`SqliteStore.__init__`):
a file that is not an SQLite database, a damaged or truncated one, tables of
another layout, or a file or directory this process cannot write is a
ValueError naming the path.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from agl_core.data import Rollout, Span, Task
from agl_core.http.recordable import check_span
from agl_core.rollout.span_batcher import SpanBatcher
from agl_core.rollout.store import (FAILED, QUEUING, RUNNING, TERMINAL, Attempt, AttemptState, LeaseError, Leases,
                                    NewRollout, check_lease, conflict_error, ended_error, lease_expired_error,
                                    lost_spans_error, new_lease)

log = logging.getLogger("agl_plugin_sqlite")

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id    TEXT PRIMARY KEY,
    task          TEXT NOT NULL,              -- the Task as JSON
    sample_index  INTEGER NOT NULL,
    metadata      TEXT NOT NULL,              -- JSON object
    status        TEXT NOT NULL,              -- queuing | running | succeeded | failed | timed_out
    priority      REAL NOT NULL,              -- dequeue order: enqueue time; lowered on requeue
    attempts      INTEGER NOT NULL DEFAULT 0,
    max_attempts  INTEGER NOT NULL,
    worker_id     TEXT,
    lease_expires REAL,                       -- wall clock: shared by every process
    final_reward  REAL,
    error         TEXT,
    start_time    REAL,
    end_time      REAL,
    consumed      INTEGER NOT NULL DEFAULT 0,
    lease         TEXT                        -- the running attempt's lease token
);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, priority);
CREATE TABLE IF NOT EXISTS spans (
    rollout_id  TEXT NOT NULL,
    attempt_id  TEXT NOT NULL,
    sequence_id INTEGER NOT NULL,
    kind        TEXT NOT NULL,
    span        TEXT NOT NULL                 -- the Span as JSON
);
CREATE UNIQUE INDEX IF NOT EXISTS spans_once ON spans (rollout_id, attempt_id, sequence_id);
CREATE TABLE IF NOT EXISTS sequence_reserved (
    rollout_id  TEXT PRIMARY KEY,
    reserved    INTEGER NOT NULL              -- ids below this may have been handed out
);
"""

_COLUMNS = ("rollout_id, task, sample_index, metadata, status, attempts, final_reward, error, "
            "start_time, end_time")
MIN_SQLITE = (3, 35)
"""The oldest SQLite the store runs on: a lease, a renewal and an end are each one ``UPDATE ... RETURNING``."""
POLL_S = 0.05
"""How often a waiting caller looks at the file for changes made by other processes (this
process's own changes wake it at once)."""
QUICK_CHECK_MAX_BYTES = 64 * 2**20
"""Files up to this size get ``PRAGMA quick_check`` when opened: it reads every page (about 0.9 s per GB from
the page cache, the disk's read speed otherwise). Larger files get the checks SQLite makes on opening (the
header, the size it records against the file's, the schema), a few milliseconds whatever the size."""
_HINTS = {
    "file is not a database": "it is not an SQLite database",
    "database disk image is malformed": "it is damaged or truncated",
    "unable to open database file": "check that its directory exists and this process may write there",
    "attempt to write a readonly database": "this process may not write the file or its directory",
}


class SqliteStore:
    """The :class:`~agl_core.rollout.store.Store` protocol on the SQLite file ``path``.

    ``batch_size`` bounds the spans per insert transaction and ``max_pending``
    the spans waiting for the writer (``add_spans`` blocks beyond it, so
    memory stays bounded when the disk falls behind). ``keep_consumed``
    keeps released rollouts in the file (marked consumed) as the run's record;
    otherwise they are deleted. ``reserve_sequence_ids`` > 0 records in the
    file, that many ids at a time, how far each rollout's sequence ids were
    handed out (one small commit per block; the first block with the
    rollout's enqueue), and a process that opens the file later counts on
    from there: no id is handed out twice, at the cost
    of a gap after a restart. ``batch_spans=False`` writes the spans of each
    ``add_spans`` at once, in the caller's thread and transaction, for a
    caller whose spans come in batches already (the store service, whose
    clients upload in batches): no writer thread, nothing for ``flush`` to
    wait for. ``max_bytes`` caps the file's size (SQLite's ``max_page_count``
    on every connection): a write past it fails as on a full disk, and room
    freed in the file (released rollouts, with ``keep_consumed=False``) is
    written to again.
    """

    def __init__(self, path: str | Path, batch_size: int = 512, max_pending: int = 20_000,
                 keep_consumed: bool = True, busy_timeout_s: float = 30.0, reserve_sequence_ids: int = 0,
                 batch_spans: bool = True, max_bytes: int | None = None):
        self.path = Path(path)
        self.batch_size, self.keep_consumed = batch_size, keep_consumed
        self.reserve_sequence_ids, self.max_bytes = reserve_sequence_ids, max_bytes
        self._lost: dict[tuple[str, str], tuple[int, str]] = {}
        """Spans accepted and then not written, by attempt: how many, and why (failed at the attempt's finish)."""
        self._busy_timeout_ms = int(busy_timeout_s * 1000)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._changed = threading.Condition()  # wakes waiters of this process at once
        self._sequence: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._sequence_lock = threading.Lock()
        # This process's writers take turns here before asking SQLite for the write lock. SQLite's busy handler
        # sleeps and retries (up to 100 ms a try) and hands the lock to whoever asks at the right moment, so among
        # the 32 threads of a runner one writer could wait seconds while the others kept taking it.
        self._write_lock = threading.Lock()
        self._closed = False
        try:
            self._open()
            writer_connection = self._new_connection() if batch_spans else None
        except (OSError, sqlite3.Error, ValueError) as exc:
            self._close_connections()
            raise self._unusable(exc) from None
        self._writer: SpanBatcher | None = None
        if writer_connection is not None:  # the writer thread's own connection
            self._writer = SpanBatcher(functools.partial(self._insert_spans, connection=writer_connection),
                                       self._spans_lost, name="agl-sqlite-span-writer", refusals=(LeaseError,),
                                       batch_size=batch_size, max_pending=max_pending)
            self._writer.start()

    def _open(self) -> None:
        """Create the file and its tables, or check the existing file's; raises what it finds wrong."""
        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise ValueError(f"this Python's SQLite is {sqlite3.sqlite_version}; the store needs "
                             f"{'.'.join(map(str, MIN_SQLITE))} or newer (UPDATE ... RETURNING)")
        if self.path.is_dir():
            raise ValueError("it is a directory")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"its directory {self.path.parent} cannot be created ({exc.strerror}: "
                             f"{exc.filename})") from None
        if self.path.exists() and self.path.stat().st_size > 0:  # SQLite takes an empty file for a new database
            _check_file(self.path)
        conn = self._connection()
        _drop_duplicate_spans(conn, self._write_lock)
        _add_lease_column(conn, self._write_lock)
        conn.executescript(SCHEMA)
        # The write lock, taken and let go: a file or directory this process may not write fails here.
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")

    def _unusable(self, exc: BaseException) -> ValueError:
        """The error for a store file that cannot be used: its path, what is wrong and, for SQLite's words, why."""
        text = str(exc)
        if isinstance(exc, OSError) and exc.strerror:
            text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
        hint = _HINTS.get(text)
        return ValueError(f"the SQLite store {self.path} cannot be used: {text}" + (f" ({hint})" if hint else ""))

    # ------------------------------------------------------------ connections

    def _new_connection(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=self._busy_timeout_ms / 1000)
        with self._connections_lock:  # closed with the store, also when a PRAGMA below fails
            self._connections.append(conn)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={self._busy_timeout_ms}")
        if self.max_bytes is not None:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count={max(1, self.max_bytes // page_size)}")
        return conn

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (SQLite connections are not shared between threads here)."""
        if self._closed:
            raise RuntimeError(f"the store {self.path} is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._new_connection()
        return conn

    def _transaction(self):
        return _immediate(self._connection(), self._write_lock)

    def _write(self, sql: str, parameters: Sequence) -> list[tuple]:
        """One statement as its own transaction, in this process's writers' turn; the rows it returns.

        Each call into SQLite gives up the interpreter lock and waits to take
        it back, so a single statement holds the turn for one such wait where
        BEGIN, the statement and COMMIT would hold it for three."""
        conn = self._connection()
        with self._write_lock:
            return conn.execute(sql, parameters).fetchall()

    # ------------------------------------------------------------ queue and attempts

    def enqueue(self, rollouts: Sequence[NewRollout]) -> None:
        now = time.time()
        reserve = self.reserve_sequence_ids
        # Serialized before the write lock is taken: only the priorities of rollouts queued ahead need the file.
        fields = [(r.rollout_id, r.task.model_dump_json(), r.sample_index, json.dumps(r.metadata), QUEUING)
                  for r in rollouts]
        try:
            with self._transaction() as conn:
                # Rollouts are dequeued by priority: the time they were queued, unless queued ahead.
                front = _front(conn, len(rollouts), now) if any(r.ahead for r in rollouts) else now
                rows = [(*head, (front if r.ahead else now) + i * 1e-6, r.max_attempts)
                        for i, (head, r) in enumerate(zip(fields, rollouts))]
                conn.executemany("INSERT INTO rollouts (rollout_id, task, sample_index, metadata, status, "
                                 "priority, max_attempts) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
                if reserve:  # the first block of ids, in this commit rather than one of its own at the first id
                    conn.executemany("INSERT OR REPLACE INTO sequence_reserved (rollout_id, reserved) VALUES (?, ?)",
                                     [(r.rollout_id, reserve) for r in rollouts])
        except sqlite3.IntegrityError:
            known = {r.rollout_id for r in rollouts} & set(self._existing([r.rollout_id for r in rollouts]))
            raise ValueError(f"rollouts already in the store: {sorted(known)}") from None
        if reserve:
            with self._sequence_lock:  # a new rollout has no spans: this process counts from 0
                for r in rollouts:
                    self._sequence[r.rollout_id], self._reserved[r.rollout_id] = -1, reserve
        self._notify()

    def _existing(self, rollout_ids: list[str]) -> list[str]:
        conn = self._connection()
        return [row[0] for chunk, marks in _in_chunks(rollout_ids)
                for row in conn.execute(f"SELECT rollout_id FROM rollouts WHERE rollout_id IN ({marks})", chunk)]

    def dequeue(self, worker_id: str, lease_s: float, wait_s: float = 0.0) -> Attempt | None:
        deadline = time.monotonic() + wait_s
        while True:
            self.requeue_expired()
            row = None
            # An idle worker polls: look without the write lock, take it only when there is work.
            if self._connection().execute("SELECT 1 FROM rollouts WHERE status = ? LIMIT 1",
                                          (QUEUING,)).fetchone() is not None:
                now = time.time()
                taken = self._write("UPDATE rollouts SET status = ?, attempts = attempts + 1, worker_id = ?, "
                                    "lease_expires = ?, start_time = ?, lease = ? WHERE rollout_id = (SELECT "
                                    "rollout_id FROM rollouts WHERE status = ? ORDER BY priority LIMIT 1) "
                                    "RETURNING rollout_id, task, sample_index, metadata, attempts, lease",
                                    (RUNNING, worker_id, now + lease_s, now, new_lease(), QUEUING))
                row = taken[0] if taken else None
            if row is not None:
                rollout_id, task, sample_index, metadata, attempts, lease = row
                return Attempt(rollout_id, str(attempts), Task.model_validate_json(task), sample_index,
                               json.loads(metadata), lease)
            if not self._wait_for_change(deadline):
                return None

    def heartbeat(self, rollout_id: str, attempt_id: str, lease_s: float, *, lease: str | None = None) -> bool:
        if self._write("UPDATE rollouts SET lease_expires = ? WHERE rollout_id = ? AND status = ? AND attempts = ? "
                       "AND lease = ? RETURNING 1", (time.time() + lease_s, rollout_id, RUNNING, _number(attempt_id),
                                                     lease)):
            return True
        self._check_lease(rollout_id, attempt_id, lease)
        return False

    def finish(self, rollout_id: str, attempt_id: str, status: str,
               final_reward: float | None = None, error: str | None = None, *, lease: str | None = None) -> bool:
        if status not in TERMINAL:
            raise ValueError(f"finish needs a terminal status ({', '.join(sorted(TERMINAL))}), got {status!r}")
        self.flush()  # the writer has written (or lost) the attempt's spans: a loss fails it below
        lost = self._lost.get((rollout_id, attempt_id))
        if lost is not None:
            status, error = FAILED, lost_spans_error(*lost) + (f"; {error}" if error else "")
        done = bool(self._write("UPDATE rollouts SET status = ?, final_reward = ?, error = ?, end_time = ? "
                                "WHERE rollout_id = ? AND status = ? AND attempts = ? AND lease = ? RETURNING 1",
                                (status, final_reward, error, time.time(), rollout_id, RUNNING,
                                 _number(attempt_id), lease)))
        if done:
            self._lost.pop((rollout_id, attempt_id), None)
            self._notify()
        else:
            self._check_lease(rollout_id, attempt_id, lease)
        return done

    def _check_lease(self, rollout_id: str, attempt_id: str, lease: str | None) -> None:
        """LeaseError when the attempt runs under another token than ``lease`` (a write that named it changed
        nothing: it is not running, or the token is wrong)."""
        row = self._connection().execute("SELECT lease FROM rollouts WHERE rollout_id = ? AND status = ? "
                                         "AND attempts = ?", (rollout_id, RUNNING, _number(attempt_id))).fetchone()
        if row is not None:
            check_lease(rollout_id, attempt_id, row[0] or "", lease)

    def cancel(self, rollout_ids: Sequence[str] | None, reason: str) -> int:
        unfinished = f"status IN ('{QUEUING}', '{RUNNING}')"
        with self._transaction() as conn:
            if rollout_ids is None:
                cursor = conn.execute(f"UPDATE rollouts SET status = ?, error = ?, end_time = ? WHERE {unfinished}",
                                      (FAILED, reason, time.time()))
                count = cursor.rowcount
            else:
                count = 0
                for rollout_id in rollout_ids:
                    count += conn.execute(f"UPDATE rollouts SET status = ?, error = ?, end_time = ? "
                                          f"WHERE rollout_id = ? AND {unfinished}",
                                          (FAILED, reason, time.time(), rollout_id)).rowcount
        self._notify()
        return count

    def requeue_expired(self) -> int:
        now = time.time()
        conn = self._connection()
        # A cheap read first: most calls find nothing and need no write lock.
        if conn.execute("SELECT 1 FROM rollouts WHERE status = ? AND lease_expires < ? LIMIT 1",
                        (RUNNING, now)).fetchone() is None:
            return 0
        with self._transaction() as conn:
            expired = conn.execute("SELECT rollout_id, attempts, max_attempts, worker_id FROM rollouts "
                                   "WHERE status = ? AND lease_expires < ?", (RUNNING, now)).fetchall()
            front = _front(conn, len(expired), now)
            for i, (rollout_id, attempts, max_attempts, worker_id) in enumerate(expired):
                error = lease_expired_error(str(attempts), worker_id)
                if attempts < max_attempts:  # back to the front of the queue, in their order
                    conn.execute("UPDATE rollouts SET status = ?, error = ?, priority = ? WHERE rollout_id = ?",
                                 (QUEUING, error, front + i, rollout_id))
                else:
                    conn.execute("UPDATE rollouts SET status = ?, error = ?, end_time = ? WHERE rollout_id = ?",
                                 (FAILED, error, now, rollout_id))
        if expired:
            self._notify()
        return len(expired)

    def attempt_state(self, rollout_id: str, attempt_id: str) -> AttemptState | None:
        return self._attempt(rollout_id, attempt_id)[0]

    def _attempt(self, rollout_id: str, attempt_id: str) -> tuple[AttemptState | None, str]:
        """The attempt's state and the rollout's lease token ("" when none)."""
        row = self._connection().execute("SELECT status, attempts, metadata, lease FROM rollouts "
                                         "WHERE rollout_id = ?", (rollout_id,)).fetchone()
        if row is None:
            return None, ""
        status, attempts, metadata, lease = row
        return AttemptState(status, status == RUNNING and str(attempts) == attempt_id, json.loads(metadata)), \
            lease or ""

    def admit(self, rollout_id: str, attempt_id: str, n: int, *,
              lease: str | None = None) -> tuple[AttemptState | None, list[int]]:
        state, held = self._attempt(rollout_id, attempt_id)
        if not (state and state.current):
            return state, []
        check_lease(rollout_id, attempt_id, held, lease)
        return state, [self.next_sequence_id(rollout_id) for _ in range(n)]

    # ------------------------------------------------------------ spans

    def next_sequence_id(self, rollout_id: str) -> int:
        """The next id; KeyError for a rollout the file does not hold or that was released."""
        with self._sequence_lock:
            if rollout_id not in self._sequence:
                self._sequence[rollout_id] = self._first_sequence_id(rollout_id) - 1
            self._sequence[rollout_id] += 1
            sequence_id = self._sequence[rollout_id]
            if self.reserve_sequence_ids and sequence_id >= self._reserved.get(rollout_id, 0):
                self._reserved[rollout_id] = sequence_id + self.reserve_sequence_ids
                with self._transaction() as conn:
                    conn.execute("INSERT OR REPLACE INTO sequence_reserved (rollout_id, reserved) VALUES (?, ?)",
                                 (rollout_id, self._reserved[rollout_id]))
            return sequence_id

    def _first_sequence_id(self, rollout_id: str) -> int:
        """Where this process counts a rollout's ids from: past its spans and past what was reserved."""
        conn = self._connection()
        row = conn.execute("SELECT consumed FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
        if row is None or row[0]:
            raise KeyError(f"rollout {rollout_id!r} is not in the store {self.path}"
                           + (" (it was released)" if row else ""))
        written = conn.execute("SELECT MAX(sequence_id) FROM spans WHERE rollout_id = ?", (rollout_id,)).fetchone()[0]
        reserved = conn.execute("SELECT reserved FROM sequence_reserved WHERE rollout_id = ?",
                                (rollout_id,)).fetchone()
        return max(-1 if written is None else written + 1, reserved[0] if reserved else 0)

    def add_spans(self, spans: Sequence[Span], *, leases: Leases | None = None) -> None:
        for span in spans:
            check_span(span)
        self._check_attempts(spans, leases or {})
        if self._writer is None:
            self._insert_spans(spans, self._connection())
        else:
            self._writer.put(spans)

    def _check_attempts(self, spans: Sequence[Span], leases: Leases) -> None:
        """KeyError for a span of a rollout the file does not hold; LeaseError for one the store does not take:
        not of the latest attempt, of an ended attempt under an id this process did not hand out before the end
        (one admitted while it ran is taken), or without the attempt's token."""
        conn = self._connection()
        for rollout_id, attempt_id in dict.fromkeys((s.rollout_id, s.attempt_id) for s in spans):
            row = conn.execute("SELECT status, attempts, lease FROM rollouts WHERE rollout_id = ? AND consumed = 0",
                               (rollout_id,)).fetchone()
            if row is None:
                raise KeyError(f"span of a rollout the store {self.path} does not hold: {rollout_id!r}")
            status, attempts, held = row
            with self._sequence_lock:
                handed_out = self._sequence.get(rollout_id, -1)
            own = {span.sequence_id: span for span in spans if (span.rollout_id, span.attempt_id) == (rollout_id,
                                                                                                      attempt_id)}
            for span in own.values():
                if not (str(attempts) == attempt_id and (status == RUNNING or span.sequence_id <= handed_out)):
                    raise LeaseError(ended_error(span, status))
            check_lease(rollout_id, attempt_id, held or "", leases.get((rollout_id, attempt_id)))
            ids = list(own)
            for start in range(0, len(ids), 500):  # spans already written: the same again, or a conflict
                chunk = ids[start:start + 500]
                for sequence_id, text in conn.execute(
                        f"SELECT sequence_id, span FROM spans WHERE rollout_id = ? AND attempt_id = ? AND sequence_id "
                        f"IN ({','.join('?' * len(chunk))})", [rollout_id, attempt_id, *chunk]):
                    if text != own[sequence_id].model_dump_json():
                        raise LeaseError(conflict_error(own[sequence_id]))

    def _insert_spans(self, spans: Sequence[Span], connection: sqlite3.Connection) -> None:
        """One transaction on ``connection``; the same span already there is kept, another is a LeaseError (and
        nothing is written)."""
        rows = [(s.rollout_id, s.attempt_id, s.sequence_id, s.kind, s.model_dump_json()) for s in spans]
        with _immediate(connection, self._write_lock) as conn:
            before = conn.total_changes
            conn.executemany("INSERT OR IGNORE INTO spans (rollout_id, attempt_id, sequence_id, kind, span) "
                             "VALUES (?, ?, ?, ?, ?)", rows)
            if conn.total_changes - before < len(rows):  # some keys were there: the same spans, or a conflict
                for span, row in zip(spans, rows):
                    held = conn.execute("SELECT span FROM spans WHERE rollout_id = ? AND attempt_id = ? AND "
                                        "sequence_id = ?", row[:3]).fetchone()
                    if held[0] != row[4]:
                        raise LeaseError(conflict_error(span))

    def _spans_lost(self, spans: list[Span], error: BaseException) -> None:
        """The writer could not write ``spans``: their attempts fail at their finish; the writer goes on."""
        text = f"the SQLite store {self.path} could not write them: {type(error).__name__}: {error}"
        log.error("%d spans lost (%s); their attempts will end failed", len(spans), text)
        for span in spans:
            count = self._lost.get((span.rollout_id, span.attempt_id), (0, ""))[0]
            self._lost[span.rollout_id, span.attempt_id] = (count + 1, text)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    # ------------------------------------------------------------ reading

    def wait(self, rollout_ids: Sequence[str], timeout_s: float) -> set[str]:
        deadline = time.monotonic() + timeout_s
        wanted = list(dict.fromkeys(rollout_ids))
        while True:
            self.requeue_expired()
            done = set()
            for chunk, marks in _in_chunks(wanted):
                rows = self._connection().execute(
                    f"SELECT rollout_id FROM rollouts WHERE rollout_id IN ({marks}) AND status IN (?, ?, ?)",
                    [*chunk, *sorted(TERMINAL)])
                done.update(row[0] for row in rows)
            if len(done) == len(wanted) or not self._wait_for_change(deadline):
                return done

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return [_rollout(row, [Span.model_validate_json(text) for text in spans])
                for row, spans in self._rollout_rows(rollout_ids)]

    def get_rollouts_json(self, rollout_ids: Sequence[str]) -> bytes:
        """``{"rollouts": [...]}``, the JSON of :meth:`get_rollouts`' answer, with each span's JSON as the file
        holds it (the store service answers with it: no span is parsed here only to be written out again)."""
        parts = [_rollout(row, []).model_dump_json(exclude={"spans"}).encode()[:-1]
                 + b',"spans":[' + ",".join(spans).encode() + b"]}" for row, spans in self._rollout_rows(rollout_ids)]
        return b'{"rollouts":[' + b",".join(parts) + b"]}"

    def _rollout_rows(self, rollout_ids: Sequence[str]) -> Iterator[tuple[tuple, list[str]]]:
        """Each held rollout's row and the JSON of its last attempt's spans, by sequence id, in the order asked.

        Two statements for up to 500 rollouts, not two per rollout: each
        statement lets the interpreter lock go, and taking it back among busy
        agent threads waits up to a switch interval (a step's batch of 168
        rollouts took ~0.2 s to read while the next batch played).
        """
        self.flush()
        conn = self._connection()
        rows: dict[str, tuple] = {}
        spans: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        for chunk, marks in _in_chunks(list(dict.fromkeys(rollout_ids))):
            rows.update((row[0], row) for row in conn.execute(
                f"SELECT {_COLUMNS} FROM rollouts WHERE rollout_id IN ({marks})", chunk))
            for rollout_id, attempt_id, text in conn.execute(
                    f"SELECT rollout_id, attempt_id, span FROM spans WHERE rollout_id IN ({marks}) "
                    f"ORDER BY rollout_id, attempt_id, sequence_id", chunk):
                spans[rollout_id, attempt_id].append(text)
        for rollout_id in rollout_ids:
            row = rows.get(rollout_id)
            if row is not None:
                yield row, spans.get((rollout_id, str(row[5]) if row[5] else None), [])

    def query(self, statuses: Sequence[str] | None = None) -> list[Rollout]:
        sql = f"SELECT {_COLUMNS} FROM rollouts WHERE consumed = 0"
        params: list[str] = []
        if statuses is not None:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            params = list(statuses)
        return [_rollout(row, []) for row in self._connection().execute(sql + " ORDER BY priority", params)]

    def release(self, rollout_ids: Sequence[str]) -> None:
        self.flush()
        # A statement per 500 rollouts, not per rollout: see _rollout_rows (a step's release took ~0.08 s).
        chunks = list(_in_chunks(list(dict.fromkeys(rollout_ids))))
        with self._transaction() as conn:
            for chunk, marks in chunks:
                if self.keep_consumed:
                    conn.execute(f"UPDATE rollouts SET consumed = 1 WHERE rollout_id IN ({marks})", chunk)
                else:
                    conn.execute(f"DELETE FROM spans WHERE rollout_id IN ({marks})", chunk)
                    conn.execute(f"DELETE FROM rollouts WHERE rollout_id IN ({marks})", chunk)
                if self.reserve_sequence_ids:  # a released rollout gets no more ids
                    conn.execute(f"DELETE FROM sequence_reserved WHERE rollout_id IN ({marks})", chunk)
        with self._sequence_lock:
            for rollout_id in rollout_ids:
                self._sequence.pop(rollout_id, None)
                self._reserved.pop(rollout_id, None)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._writer is not None:
                self._writer.stop(timeout_s=30)
        finally:
            self._close_connections()
            self._sequence.clear()
            self._reserved.clear()

    def _close_connections(self) -> None:
        self._closed = True
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()

    # ------------------------------------------------------------ waiting

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_for_change(self, deadline: float) -> bool:
        """Sleep until this process changes the store or a poll interval passes; False once ``deadline`` passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with self._changed:
            self._changed.wait(min(left, POLL_S))
        return True


def _front(conn: sqlite3.Connection, n: int, now: float) -> float:
    """The priority of the first of ``n`` rollouts put ahead of every one held (each next one at most 1 more):
    the lowest priority held (``now`` when none is), less ``n``."""
    return (conn.execute("SELECT MIN(priority) FROM rollouts").fetchone()[0] or now) - n


def _drop_duplicate_spans(conn: sqlite3.Connection, lock: threading.Lock) -> None:
    """Ready a file made before spans were unique for its unique index: keep the first of each key."""
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    if "spans" in tables and "spans_once" not in tables:
        with _immediate(conn, lock):
            conn.execute("DELETE FROM spans WHERE rowid NOT IN "
                         "(SELECT MIN(rowid) FROM spans GROUP BY rollout_id, attempt_id, sequence_id)")
            conn.execute("DROP INDEX IF EXISTS spans_by_rollout")  # the unique index replaces it


def _check_file(path: Path) -> None:
    """Raise sqlite3.Error or ValueError unless the file at ``path`` is a sound SQLite database whose tables, if
    any, are a store's. Read-only: a file that is not a store is left as it was."""
    with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # the header, size and schema
        if path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                raise ValueError(f"it is damaged ({'; '.join(problems)})")
        for table, columns in _schema_columns().items():
            found = _columns(conn, table)
            missing = set(columns) - set(found) - MIGRATED_COLUMNS.get(table, set())
            if found and missing:
                raise ValueError(f"its table {table!r} is not a store's: it lacks the columns "
                                 f"{', '.join(sorted(missing))}")


def _add_lease_column(conn: sqlite3.Connection, lock: threading.Lock) -> None:
    """Migrate a file made before lease tokens: its rollouts table gets the column ``lease`` (empty)."""
    found = _columns(conn, "rollouts")
    if found and "lease" not in found:
        with _immediate(conn, lock):
            conn.execute("ALTER TABLE rollouts ADD COLUMN lease TEXT")


MIGRATED_COLUMNS = {"rollouts": {"lease"}}
"""Columns a file of an older layout may lack: they are added when it is opened."""


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


@functools.cache
def _schema_columns() -> dict[str, list[str]]:
    """The columns :data:`SCHEMA` gives each table."""
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        conn.executescript(SCHEMA)
        return {table: _columns(conn, table) for table in ("rollouts", "spans")}


def _number(attempt_id: str) -> int:
    return int(attempt_id) if attempt_id.isdigit() else -1


def _in_chunks(ids: list[str]) -> Iterator[tuple[list[str], str]]:
    """``ids`` in chunks of at most 500 (SQLite limits the parameters of one statement), each with its ``?,?,…``."""
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        yield chunk, ",".join("?" * len(chunk))


def _rollout(row: tuple, spans: list[Span]) -> Rollout:
    rollout_id, task, sample_index, metadata, status, attempts, final_reward, error, start_time, end_time = row
    return Rollout(rollout_id=rollout_id, task_id=Task.model_validate_json(task).id, sample_index=sample_index,
                   status=status, final_reward=final_reward, spans=spans, error=error,
                   metadata=json.loads(metadata), attempt_id=str(attempts) if attempts else None,
                   attempts=attempts, start_time=start_time, end_time=end_time)


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection, lock: threading.Lock) -> Iterator[sqlite3.Connection]:
    """``with _immediate(conn, lock) as conn:`` a write transaction, taken at once (BEGIN IMMEDIATE) in the turn
    ``lock`` gives (the process's writers'), committed at exit, rolled back when the block raises."""
    with lock:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:  # SQLite rolls back by itself on some errors (a full disk): its error stands
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
