"""Mesh construction, the logical->mesh sharding rules, and (later) collectives for CP/PP/EP."""
