"""A job's stages around separation: decode the input, write the song folder (stems, tags,
beat grid, preview), publish it into the outbox, or quarantine a failed input."""
