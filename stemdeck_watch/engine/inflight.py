"""Songs in flight: content and settings being separated or published right now.

A duplicate is found by a done job's published folder, but a song counts from the moment a
job decides to separate it: with publish behind (or several workers) the same bytes dropped
twice back to back reach the check while the first copy is still separating or publishing,
not yet done. The first job holds its song here from that decision until its end (published,
failed or cancelled); a second job with the same song waits for it, then looks again: a
duplicate of the folder just published, or, if the first ended without one, the song is its
own to separate. Held in memory only: after a crash nothing is in flight.
"""

from __future__ import annotations

import threading

Song = tuple[str, str]  # (input sha256, settings key)


class SongsInFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Song, tuple[str, threading.Event]] = {}

    def claim(self, song: Song, job_id: str) -> tuple[str, threading.Event] | None:
        """Hold `song` for `job_id`; None once held, else the job holding it and the event
        set when that job lets go."""
        with self._lock:
            holder = self._held.get(song)
            if holder is not None and holder[0] != job_id:
                return holder
            if holder is None:
                self._held[song] = (job_id, threading.Event())
            return None

    def release(self, job_id: str) -> None:
        """`job_id` has ended (or will not separate its song): whoever waits looks again."""
        with self._lock:
            songs = [song for song, (holder, _) in self._held.items() if holder == job_id]
            ended = [self._held.pop(song)[1] for song in songs]
        for event in ended:
            event.set()
