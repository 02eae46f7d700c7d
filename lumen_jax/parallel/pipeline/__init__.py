"""Pipeline parallelism: the schedules as static tables (schedule.py), the stages' layout of the
layer stacks (layout.py) and the pipelined step that runs them under shard_map (executor.py; the
units of work one device runs in a tick and its carry: units.py)."""
