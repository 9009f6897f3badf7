"""Worker: one process per GPU (or CPU slot) that owns a paged KV-cache pool and runs the engine."""
