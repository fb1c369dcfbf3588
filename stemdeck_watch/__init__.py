"""stemdeck-watch: songs dropped into an inbox folder become separated stems in an outbox."""

__version__ = "0.1.0"
