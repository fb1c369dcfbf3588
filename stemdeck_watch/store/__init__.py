"""The queue's store: the durable registry on disk and the in-memory queue order."""
