"""Run `stemdeck-watch` with a crash seam: the process SIGKILLs itself at one exact point.

Used by tests/service/test_kill.py for the deterministic windows (a test seam, not a production code
path: the service's own modules are wrapped here, in the child process only).

    python tests/support/crash_seam.py WINDOW [stemdeck-watch arguments…]

WINDOW is one of `WINDOWS` below, or `none` (run normally: a restart with the same
environment). The folders it looks at come from the environment:
STEMDECK_SEAM_PROCESSED (the processed/ folder). STEMDECK_SEAM_FAKE_EXDEV=1 makes hard links
and renames into processed/ fail with EXDEV, as they do when processed/ is on another
filesystem (used where no second filesystem is at hand).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

WINDOWS = {
    "published": "the song folder is renamed into the outbox; `done` is not stored",
    "linked": "the input is hard-linked into processed/ and not yet unlinked from the inbox",
    "moved": "the input is in processed/; `done` is not stored",
    "done": "`done` is stored (the input moved before it)",
    "copying": "half the input is copied to processed/.NAME.<random>.stemdeck-tmp (across "
    "filesystems)",
    "copied": "the copy is renamed into processed/; the inbox original is not yet removed",
    "taken": "the dispatcher took the head of the queue; its state is not yet written",
}


def die() -> None:
    sys.stderr.write("crash seam: SIGKILL\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _under(path: object, folder: Path) -> bool:
    try:
        return folder in Path(os.fspath(path)).resolve().parents  # type: ignore[arg-type]
    except TypeError:
        return False


def install(window: str, processed: Path, fake_exdev: bool) -> None:
    import shutil

    from stemdeck_watch.core import paths
    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.stages import publish
    from stemdeck_watch.engine import pipeline as runner
    from stemdeck_watch.store.registry import Registry
    from stemdeck_watch.engine.scheduler import Scheduler

    if fake_exdev:
        real_link, real_rename = os.link, os.rename

        def link(src, dst, *args, **kwargs):
            if _under(dst, processed):
                raise OSError(errno.EXDEV, "Invalid cross-device link (faked)", str(dst))
            return real_link(src, dst, *args, **kwargs)

        def rename(src, dst, *args, **kwargs):
            if _under(dst, processed) and not _under(src, processed):
                raise OSError(errno.EXDEV, "Invalid cross-device link (faked)", str(dst))
            return real_rename(src, dst, *args, **kwargs)

        os.link, os.rename = link, rename

    if window == "published":
        real_publish = publish.publish_folder

        def publish_folder(*args):
            real_publish(*args)
            die()

        publish.publish_folder = publish_folder
    elif window == "linked":
        real_link_ = os.link

        def link_then_die(src, dst, *args, **kwargs):
            real_link_(src, dst, *args, **kwargs)
            if _under(dst, processed):
                die()

        os.link = link_then_die
    elif window == "moved":
        real_move = runner.move_file

        def move_file(src, dst, *args, **kwargs):
            real_move(src, dst, *args, **kwargs)
            die()

        runner.move_file = move_file
    elif window == "done":
        real_update = Registry.update

        def update(self, job_id, **fields):
            job = real_update(self, job_id, **fields)
            if fields.get("state") is JobState.DONE:
                die()
            return job

        Registry.update = update
    elif window == "copying":
        real_copy = shutil.copyfileobj

        def copyfileobj(reader, writer, length=0):
            if not _under(getattr(writer, "name", ""), processed):
                return real_copy(reader, writer, length)
            data = reader.read()
            writer.write(data[: len(data) // 2])
            writer.flush()
            os.fsync(writer.fileno())
            die()

        shutil.copyfileobj = copyfileobj
    elif window == "copied":
        real_fsync_dir = paths.fsync_dir

        def fsync_dir(path):
            real_fsync_dir(path)
            if Path(path).resolve() == processed.resolve():
                die()

        paths.fsync_dir = fsync_dir
    elif window == "taken":
        real_next = Scheduler.next_job

        def next_job(self, *args, **kwargs):
            control = real_next(self, *args, **kwargs)
            if control is not None:
                die()
            return control

        Scheduler.next_job = next_job
    elif window != "none":
        raise SystemExit(f"unknown window {window!r}; one of {', '.join(WINDOWS)} or none")


def main() -> int:
    window, argv = sys.argv[1], sys.argv[2:]
    install(
        window,
        Path(os.environ["STEMDECK_SEAM_PROCESSED"]),
        os.environ.get("STEMDECK_SEAM_FAKE_EXDEV") == "1",
    )
    from stemdeck_watch.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
