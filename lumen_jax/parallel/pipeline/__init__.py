"""Pipeline parallelism: the schedules as static tables (schedule.py) and the pipelined step that
runs them under shard_map (executor.py)."""
