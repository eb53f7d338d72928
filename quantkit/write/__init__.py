"""Writing checkpoints: streamed, atomic, fsynced shards and JSON files; the output lock, journal and resume."""
