"""The durable record of every job: SQLite on disk in the state dir.

The registry is what survives a crash, a power cut or an update: job states, the queue order,
pause state and the files held back by the capacity lanes. It is written in WAL mode with full
sync, so a state the service has reported is a state that is on disk. `status` opens the same
file read-only, which is why it works while the service is stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from stemdeck_watch.core.jobs import (
    Fault,
    FileSignature,
    Job,
    JobKind,
    JobState,
    PlaylistRef,
    made_by_json,
    made_by_of,
)
from stemdeck_watch.core.paths import private_dir, private_file, tighten

log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.sqlite3"
SCHEMA_VERSION = 6
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    source TEXT NOT NULL,
    rel_path TEXT NOT NULL,
    preset TEXT,
    progress REAL NOT NULL DEFAULT 0,
    output TEXT,
    error TEXT,
    stage TEXT,
    size INTEGER,
    mtime_ns INTEGER,
    inode INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    position INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL,
    version INTEGER NOT NULL DEFAULT 0,
    sha256 TEXT,
    settings_key TEXT,
    playlist TEXT,
    faults TEXT,
    made_by TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_source ON jobs (source);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created_at);
CREATE INDEX IF NOT EXISTS jobs_by_finished ON jobs (finished_at);
CREATE TABLE IF NOT EXISTS tombstones (
    path TEXT NOT NULL, kind TEXT NOT NULL, size INTEGER, mtime_ns INTEGER, inode INTEGER,
    job_id TEXT, removed_at REAL NOT NULL, PRIMARY KEY (path, kind)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS waiting (
    source TEXT PRIMARY KEY, kind TEXT NOT NULL, since REAL NOT NULL
);
"""
# A finished job's input that could not be reached to move it into processed/ or failed/ (its
# share was away): the move is done when the share answers again, and at start-up.
PENDING_MOVES = """
CREATE TABLE IF NOT EXISTS pending_moves (
    job_id TEXT PRIMARY KEY, kind TEXT NOT NULL, source TEXT NOT NULL, target TEXT NOT NULL,
    size INTEGER, mtime_ns INTEGER, inode INTEGER, since REAL NOT NULL
)"""
SCHEMA += PENDING_MOVES + ";\n"
# Columns and tables added after the first release: an older registry file gains them on open.
MIGRATIONS = {
    2: ("ALTER TABLE jobs ADD COLUMN sha256 TEXT", "ALTER TABLE jobs ADD COLUMN settings_key TEXT"),
    3: ("ALTER TABLE jobs ADD COLUMN playlist TEXT",),
    4: (PENDING_MOVES,),
    5: ("ALTER TABLE jobs ADD COLUMN faults TEXT",),
    6: ("ALTER TABLE jobs ADD COLUMN made_by TEXT",),
}
_JOB_COLUMNS = (
    "id, name, kind, state, source, rel_path, preset, progress, output, error, stage, size, "
    "mtime_ns, inode, attempts, created_at, updated_at, finished_at, version, sha256, "
    "settings_key, playlist, faults, made_by"
)
_UPDATABLE = {
    "name",
    "state",
    "source",
    "rel_path",
    "preset",
    "progress",
    "output",
    "error",
    "stage",
    "signature",
    "attempts",
    "finished_at",
    "sha256",
    "settings_key",
    "playlist",
    "faults",
    "made_by",
}


class Registry:
    def __init__(
        self,
        connection: sqlite3.Connection,
        clock: Callable[[], float] = time.time,
        path: Path | None = None,
    ):
        self._db = connection
        self._lock = threading.RLock()
        self._clock = clock
        self.path = path

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: Path, clock: Callable[[], float] = time.time) -> Registry:
        # for the user only: the history names every song and link (URLs may carry share
        # tokens); SQLite gives its -wal and -shm files the database file's mode
        private_dir(path.parent)
        private_file(path)
        for suffix in ("-wal", "-shm"):
            tighten(Path(str(path) + suffix))
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            has_jobs = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'jobs'").fetchone()
            if has_jobs:
                for step in range(max(version, 1) + 1, SCHEMA_VERSION + 1):
                    for statement in MIGRATIONS.get(step, ()):
                        db.execute(statement)
            db.executescript(SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("SELECT count(*) FROM jobs").fetchone()  # reads the pages: damage shows
        except sqlite3.DatabaseError:
            db.close()
            raise
        return cls(db, clock, path)

    @classmethod
    def open_or_rebuild(cls, path: Path, clock: Callable[[], float] = time.time) -> Registry:
        """Open the registry; a damaged file never stops the service for good: it is moved
        aside with a timestamp (named in the log and in `status`) and a new one starts, which
        orphan adoption and the inbox rescan fill again — only the queue order is lost."""
        try:
            return cls.open(path, clock)
        except sqlite3.DatabaseError as exc:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(clock()))
            aside = path.with_name(f"{path.name}.damaged-{stamp}")
            for suffix in ("", "-wal", "-shm"):
                part = Path(str(path) + suffix)
                if part.exists():
                    os.replace(part, Path(str(aside) + suffix))
            log.error(
                "the job registry %s is damaged (%s); moved it to %s and started a new "
                "one from the outbox and the inbox",
                path,
                exc,
                aside,
            )
            registry = cls.open(path, clock)
            registry.set_meta("rebuilt_from", f"{aside} ({exc})")
            return registry

    @classmethod
    def open_readonly(cls, path: Path) -> Registry | None:
        """For `status`: never creates or changes anything; None if there is no registry yet."""
        if not path.is_file():
            return None
        db = sqlite3.connect(
            f"file:{path}?mode=ro",
            uri=True,
            check_same_thread=False,
            isolation_level=None,
            timeout=10,
        )
        return cls(db, path=path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------ jobs

    def add(self, job: Job) -> Job:
        with self._lock:
            return self._insert(job)

    def add_all(
        self,
        jobs: list[Job],
        then: tuple[str, dict[str, Any]] | None = None,
        order: list[str] | None = None,
    ) -> list[Job]:
        """Add several jobs, (`then`) change one more and (`order`) save the queue order, all
        in one transaction: a playlist's entries exist all together with the mark on its
        link's job and their places in the queue, or not at all."""
        with self._lock, self._transaction():
            added = [self._insert(job) for job in jobs]
            if then is not None:
                self._update_row(then[0], then[1])
            if order is not None:
                self._write_order(order)
        return added

    def _insert(self, job: Job) -> Job:
        now = self._clock()
        job = dataclasses.replace(job, created_at=job.created_at or now, updated_at=now)
        sig = job.signature
        self._db.execute(
            f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES "
            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job.id,
                job.name,
                job.kind.value,
                job.state.value,
                job.source,
                job.rel_path,
                job.preset,
                job.progress,
                job.output,
                job.error,
                job.stage,
                sig.size if sig else None,
                sig.mtime_ns if sig else None,
                sig.inode if sig else None,
                job.attempts,
                job.created_at,
                job.updated_at,
                job.finished_at,
                job.version,
                job.sha256,
                job.settings_key,
                job.playlist.to_json() if job.playlist else None,
                Fault.to_json(job.faults),
                made_by_json(job.made_by),
            ),
        )
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
        return _job(row) if row else None

    def update(self, job_id: str, **fields: Any) -> Job:
        """Change some fields of a job in one transaction; bumps its version."""
        with self._lock:
            self._update_row(job_id, fields)
            job = self.get(job_id)
        assert job is not None
        return job

    def _update_row(self, job_id: str, fields: dict[str, Any]) -> None:
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise TypeError(f"cannot update {sorted(unknown)}")
        columns: dict[str, Any] = {}
        for name, value in fields.items():
            if name == "signature":
                columns.update(
                    size=value.size if value else None,
                    mtime_ns=value.mtime_ns if value else None,
                    inode=value.inode if value else None,
                )
            elif isinstance(value, (JobState, JobKind)):
                columns[name] = value.value
            elif isinstance(value, PlaylistRef):
                columns[name] = value.to_json()
            elif name == "faults":
                columns[name] = Fault.to_json(tuple(value))
            elif name == "made_by":
                columns[name] = made_by_json(value)
            else:
                columns[name] = value
        columns["updated_at"] = self._clock()
        assignments = ", ".join(f"{name} = ?" for name in columns)
        cursor = self._db.execute(
            f"UPDATE jobs SET {assignments}, version = version + 1 WHERE id = ?",
            (*columns.values(), job_id),
        )
        if cursor.rowcount != 1:
            raise KeyError(job_id)

    def jobs(self, states: Iterable[JobState] | None = None, limit: int | None = None) -> list[Job]:
        """Jobs, newest first."""
        query = f"SELECT {_JOB_COLUMNS} FROM jobs"
        params: list[Any] = []
        if states is not None:
            states = list(states)
            query += f" WHERE state IN ({', '.join('?' * len(states))})"
            params += [s.value for s in states]
        query += " ORDER BY created_at DESC, rowid DESC"
        if limit is not None:
            query += " LIMIT ?"
            params.append(limit)
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        return [_job(row) for row in rows]

    def recent(self, finished: int) -> tuple[list[Job], int]:
        """Every job not finished yet and the `finished` most recently finished ones, newest
        first, with the number of finished jobs left out: what a snapshot of the queue shows,
        whose size must not grow with the history (the indexes keep it a few lookups)."""
        final = [s.value for s in JobState if s.is_final]
        active = [s.value for s in JobState if not s.is_final]

        def marks(values: list[str]) -> str:
            return ", ".join("?" * len(values))

        with self._lock:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE rowid IN "
                f"(SELECT rowid FROM jobs WHERE state IN ({marks(active)}) UNION ALL "
                f"SELECT rowid FROM (SELECT rowid FROM jobs WHERE +state IN ({marks(final)}) "
                "ORDER BY finished_at DESC, rowid DESC LIMIT ?)) "
                "ORDER BY created_at DESC, rowid DESC",
                (*active, *final, finished),
            ).fetchall()
            total = self._db.execute(
                f"SELECT count(*) FROM jobs WHERE state IN ({marks(final)})", final
            ).fetchone()[0]
        jobs = [_job(row) for row in rows]
        return jobs, max(0, total - sum(1 for job in jobs if job.state.is_final))

    def page(
        self, before: tuple[float, int] | None, limit: int
    ) -> tuple[list[Job], tuple[float, int] | None]:
        """Up to `limit` jobs older than the cursor `before` (created_at, rowid), newest
        first, and the cursor of the next page (None after the last): every job, a page at a
        time, however long the history."""
        query = f"SELECT {_JOB_COLUMNS}, rowid FROM jobs"
        params: list[Any] = []
        if before is not None:
            query += " WHERE (created_at, rowid) < (?, ?)"
            params += before
        query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(query, (*params, limit + 1)).fetchall()
        jobs = [_job(row[:-1]) for row in rows[:limit]]
        cursor = (jobs[-1].created_at, rows[limit - 1][-1]) if len(rows) > limit else None
        return jobs, cursor

    def entries_of(self, playlist_id: str) -> list[Job]:
        """The jobs of a playlist link's entries, in playlist order."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE playlist IS NOT NULL AND id != ? "
                "AND json_extract(playlist, '$.id') = ?",
                (playlist_id, playlist_id),
            ).fetchall()
        return sorted(
            (_job(row) for row in rows), key=lambda job: job.playlist.entry if job.playlist else 0
        )

    def latest_for_source(self, source: str) -> Job | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE source = ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT 1",
                (source,),
            ).fetchone()
        return _job(row) if row else None

    def with_rel_path(self, rel_path: str, limit: int = 20) -> list[Job]:
        """Jobs whose input had this path inside the inbox, newest first (rare lookups: only
        for names that Unicode can spell two ways)."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE rel_path = ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT ?",
                (rel_path, limit),
            ).fetchall()
        return [_job(row) for row in rows]

    def find(self, ref: str, limit: int = 20) -> list[Job]:
        """Jobs whose id starts with `ref` or whose song name is `ref`, newest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE substr(id, 1, ?) = ? OR name = ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT ?",
                (len(ref), ref, ref, limit),
            ).fetchall()
        return [_job(row) for row in rows]

    def sources_under(self, prefix: str) -> list[str]:
        """Every job source inside the folder `prefix` (which ends with a separator)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT source FROM jobs WHERE substr(source, 1, ?) = ?",
                (len(prefix), prefix),
            ).fetchall()
        return [r[0] for r in rows]

    def done_with(self, sha256: str, settings_key: str) -> list[Job]:
        """Done jobs that separated this content with these settings, newest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE sha256 = ? AND settings_key = ? "
                "AND state = ? ORDER BY created_at DESC, rowid DESC",
                (sha256, settings_key, JobState.DONE.value),
            ).fetchall()
        return [_job(row) for row in rows]

    def outputs(self) -> set[str]:
        """Every outbox folder a job has published."""
        with self._lock:
            rows = self._db.execute("SELECT output FROM jobs WHERE output IS NOT NULL").fetchall()
        return {r[0] for r in rows}

    def remove(self, job_id: str, tombstones: list[tuple[str, str, FileSignature | None]]) -> None:
        """Forget a finished job, leaving tombstones (path, kind, signature) in one step."""
        now = self._clock()
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT OR REPLACE INTO tombstones (path, kind, size, mtime_ns, inode, job_id, "
                "removed_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        path,
                        kind,
                        sig.size if sig else None,
                        sig.mtime_ns if sig else None,
                        sig.inode if sig else None,
                        job_id,
                        now,
                    )
                    for path, kind, sig in tombstones
                ],
            )
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def tombstone(self, path: str, kind: str) -> FileSignature | None | bool:
        """False if `path` has no tombstone of `kind`; else its signature (None if none)."""
        with self._lock:
            row = self._db.execute(
                "SELECT size, mtime_ns, inode FROM tombstones WHERE path = ? AND kind = ?",
                (path, kind),
            ).fetchone()
        if row is None:
            return False
        return FileSignature(*row) if row[0] is not None else None

    # ------------------------------------------------------------ queue order, pause, waiting

    def save_order(self, job_ids: list[str]) -> None:
        with self._lock, self._transaction():
            self._write_order(job_ids)

    def _write_order(self, job_ids: list[str]) -> None:
        self._db.execute("UPDATE jobs SET position = NULL WHERE position IS NOT NULL")
        self._db.executemany(
            "UPDATE jobs SET position = ? WHERE id = ?",
            [(i, job_id) for i, job_id in enumerate(job_ids)],
        )

    def queued_order(self) -> list[str]:
        """Ids of queued jobs in their saved order (jobs without a position last, oldest first)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM jobs WHERE state = ? "
                "ORDER BY position IS NULL, position, created_at, rowid",
                (JobState.QUEUED.value,),
            ).fetchall()
        return [r[0] for r in rows]

    def set_meta(self, key: str, value: str | None) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def save_waiting(self, entries: list[tuple[str, JobKind, float]]) -> None:
        """Replace the whole waiting list (tests, repairs); the service changes it row by
        row with `add_waiting` and `remove_waiting`, so a library of 10,000 files dropped at
        once costs 10,000 small writes, not 10,000 rewrites of a growing list."""
        with self._lock, self._transaction():
            self._db.execute("DELETE FROM waiting")
            self._db.executemany(
                "INSERT INTO waiting (source, kind, since) VALUES (?, ?, ?)",
                [(s, k.value, t) for s, k, t in entries],
            )

    def add_waiting(self, entries: list[tuple[str, JobKind, float]]) -> None:
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT OR REPLACE INTO waiting (source, kind, since) VALUES (?, ?, ?)",
                [(s, k.value, t) for s, k, t in entries],
            )

    def remove_waiting(self, sources: list[str]) -> None:
        with self._lock, self._transaction():
            self._db.executemany("DELETE FROM waiting WHERE source = ?", [(s,) for s in sources])

    def waiting(self) -> list[tuple[str, JobKind, float]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT source, kind, since FROM waiting ORDER BY since, source"
            ).fetchall()
        return [(s, JobKind(k), t) for s, k, t in rows]

    # ------------------------------------------------------------ moves waiting for a share

    def add_pending_move(self, move: PendingMove) -> None:
        sig = move.signature
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO pending_moves (job_id, kind, source, target, size, "
                "mtime_ns, inode, since) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    move.job_id,
                    move.kind,
                    move.source,
                    move.target,
                    sig.size if sig else None,
                    sig.mtime_ns if sig else None,
                    sig.inode if sig else None,
                    move.since or self._clock(),
                ),
            )

    def pending_moves(self) -> list[PendingMove]:
        """Oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, kind, source, target, size, mtime_ns, "
                "inode, since FROM pending_moves ORDER BY since, job_id"
            ).fetchall()
        return [
            PendingMove(
                job_id,
                kind,
                source,
                target,
                FileSignature(size, mtime_ns, inode) if size is not None else None,
                since,
            )
            for job_id, kind, source, target, size, mtime_ns, inode, since in rows
        ]

    def has_pending_move(self, source: str) -> bool:
        with self._lock:
            return (
                self._db.execute(
                    "SELECT 1 FROM pending_moves WHERE source = ? LIMIT 1", (source,)
                ).fetchone()
                is not None
            )

    def remove_pending_move(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pending_moves WHERE job_id = ?", (job_id,))

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


@dataclasses.dataclass(frozen=True)
class PendingMove:
    """A done (or failed) job's input still to be moved to `target` in processed/ (failed/)."""

    job_id: str
    kind: str  # "processed" | "failed"
    source: str
    target: str
    signature: FileSignature | None
    since: float = 0.0


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _job(row: tuple[Any, ...]) -> Job:
    (
        job_id,
        name,
        kind,
        state,
        source,
        rel_path,
        preset,
        progress,
        output,
        error,
        stage,
        size,
        mtime_ns,
        inode,
        attempts,
        created_at,
        updated_at,
        finished_at,
        version,
        sha256,
        settings_key,
        playlist,
        faults,
        made_by,
    ) = row
    signature = FileSignature(size, mtime_ns, inode) if size is not None else None
    return Job(
        id=job_id,
        name=name,
        kind=JobKind(kind),
        state=JobState(state),
        source=source,
        rel_path=rel_path,
        preset=preset,
        progress=progress,
        output=output,
        error=error,
        stage=stage,
        signature=signature,
        attempts=attempts,
        created_at=created_at,
        updated_at=updated_at,
        finished_at=finished_at,
        version=version,
        sha256=sha256,
        settings_key=settings_key,
        playlist=PlaylistRef.from_json(playlist),
        faults=Fault.from_json(faults),
        made_by=made_by_of(made_by),
    )
