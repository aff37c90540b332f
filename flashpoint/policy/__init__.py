"""Pure decision functions over frozen snapshots (no I/O, no clock reads, no asyncio/torch)."""
