"""Checkpoint I/O: validated safetensors headers, lazy tensor reads, sharded indexes, atomic writes."""
