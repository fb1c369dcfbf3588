"""Running the queue: the scheduler (the one door into the registry and the queue), the
dispatcher that takes one job at a time per worker, the pipeline that sees one job through its
stages, work prepared ahead, playlists, the disk check and the restore at start-up."""
