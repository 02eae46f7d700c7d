"""Checkpoints: the Orbax manager and the layouts older versions wrote (manager.py), the on-disk
layout of a checkpoint folder (layout.py), a run's weights in and out (weights.py) and whether a
run directory resumes under a new config (resume.py)."""
