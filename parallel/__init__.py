"""Parallel primitives (torch only): mesh, CP sharding, CP attention, distributed encoding, TP, FSDP, validator."""
