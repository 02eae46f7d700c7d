"""Orbax checkpoints of the whole training state: async save, verified restore, reshard on restore.

A checkpoint at step N is `<run_dir>/checkpoints/N/` holding two Orbax items:

- `state`: the TrainState (params, optimizer state, step, loss scale), one file set per shard;
- `meta`: JSON with the data iterator's state, the resolved config and a checksum per array.

Orbax writes each step into a temporary folder and renames it when every file is written, and it
deletes old steps only after the new one is committed: a crash or SIGKILL mid-save leaves the last
committed step intact. On restore the arrays are read straight into the target shardings (so a
checkpoint from one mesh lands on another), then their checksums (checksums.py) are recomputed
and compared; a step that fails to read or whose checksums differ is reported in one line, moved
aside to `checkpoints/corrupt-N`, and the previous step is tried. A step whose stored arrays have
other shapes than the target is not corrupt but another run's: a ConfigError, and nothing is moved.

`Checkpointer.maybe_save`, called after every step, decides whether a save is due: every
`every_steps` steps, every `every_minutes` minutes (process 0's clock), at the last step when
either is set, and always on preemption. `notify` hears `checkpoint_start` when a save starts and
`checkpoint` once it is committed: when a later step finds the background write finished, or a
wait for it returns (the loop writes both into events.jsonl).

With several processes each writes its own shards (Orbax) and process 0 the JSON; a checkpoint
restores in any process count, because arrays are read into the target shardings and the data
state holds every process's streams (loop.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lumen_jax.runtime import logs as runlog
from lumen_jax.runtime.checksums import checksum_list, nonfinite_paths
from lumen_jax.checkpoint.layout import committed_steps
from lumen_jax.checkpoint.resume import first_shape_change, shapes_by_name
from lumen_jax.config import CheckpointConfig, ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions): the run stops, state intact."""


class NonFiniteState(RuntimeError):
    """The state to be saved holds inf or NaN: it is not written; the committed checkpoints are finite."""


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    meta: dict


def _same(tree: Any) -> Any:
    return tree


@dataclasses.dataclass(frozen=True)
class StoredLayout:
    """How the state in memory differs from the state on disk (identity for most runs; uneven pipeline
    stages hold padded layer stacks in memory and store the real layers only, `train/build.py`):
    `save(state)` the state to write, `target(abstract_state)` the abstract state to read (shapes and
    shardings), `load(stored)` the state in memory from a read one; `load_model(params, model_state)`
    the same for the model alone (evaluation reads no optimizer state)."""

    save: Callable[[Any], Any] = _same
    target: Callable[[Any], Any] = _same
    load: Callable[[Any], Any] = _same
    load_model: Callable[[Any, Any], tuple] = lambda params, model_state: (params, model_state)


class Checkpointer:
    """Saves every `every_steps` steps and/or `every_minutes` minutes, at the last step and on
    preemption (`maybe_save` decides); restores the latest good step."""

    def __init__(self, directory: str, cfg: CheckpointConfig, notify: Callable[..., None] | None = None,
                 layout: StoredLayout = StoredLayout()):
        self.directory = os.path.abspath(directory)
        self.cfg = cfg
        self.layout = layout  # the state in memory <-> as written (real layers only)
        self._notify = notify or (lambda event, **fields: None)  # (event, step=N): checkpoint_start | checkpoint
        self._last_save_time = time.monotonic()
        self._in_flight: int | None = None  # the step being written in the background
        self._manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        # create=False: the folder appears with the first save, so a start-up that fails (a corrupt data
        # file at the first batch) leaves no empty checkpoints/ behind in a new run directory.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.cfg.keep, keep_period=self.cfg.keep_every or None,
            enable_async_checkpointing=self.cfg.async_save, create=False, cleanup_tmp_directories=True)
        return ocp.CheckpointManager(self.directory, options=options)

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are scheduled at all (`every_steps` or `every_minutes` set)."""
        return self.cfg.every_steps > 0 or self.cfg.every_minutes > 0

    def _due(self, step: int) -> bool:
        """Whether the schedule asks for a checkpoint after `step` (a collective with several
        processes and `every_minutes`: call it on every process at the same steps)."""
        by_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        by_time = (self.cfg.every_minutes > 0
                   and time.monotonic() - self._last_save_time >= 60 * self.cfg.every_minutes)
        if self.cfg.every_minutes > 0 and jax.process_count() > 1:  # all save at the same step: process 0's clock
            by_time = bool(multihost_utils.broadcast_one_to_all(np.int32(by_time)))
        return by_steps or by_time

    def maybe_save(self, step: int, state: Any, meta: Callable[[], dict], *, last: bool,
                   force: bool = False) -> float | None:
        """Saves after `step` if one is due; returns the seconds the caller stalled, or None if no save.

        A save is due when `force` is set (preemption: always saved), at the last step when
        checkpointing is enabled, and when `every_steps` or `every_minutes` ask for one. Call it
        after every step on every process: the time-based decision is process 0's, broadcast.

        Args:
          step: the step just taken.
          state: the state after `step`.
          meta: called only when saving (it may gather from all processes): the JSON to store.
          last: `step` is the run's final step.
          force: save whatever the schedule says (preemption), even with checkpointing off;
            only the last step with checkpointing off is never saved (the run ends there anyway).
        """
        self._poll()
        if last and not self.enabled:
            return None
        if not (force or last or self._due(step)):
            return None
        return self.save(step, state, meta())

    def save(self, step: int, state: Any, meta: dict) -> float:
        """Starts writing `state` (+ JSON `meta`) as step `step`; returns the seconds the caller stalled.

        The stall is the device-to-host copy (and, when a previous save is still being written,
        waiting for it); the files are written in the background.
        """
        t0 = time.perf_counter()
        state = self.layout.save(state)
        bad = nonfinite_paths(state)
        if bad:  # never commit a checkpoint that cannot be trained from
            raise NonFiniteState(f"the state after step {step} holds inf or NaN in {bad[0]}"
                                 + (f" (and {len(bad) - 1} more arrays)" if len(bad) > 1 else "")
                                 + f"; it was not saved; {self.last_committed()}")
        meta = {**meta, "checksums": checksum_list(state)}
        self.wait()  # Orbax waits for the previous write anyway; a failure of it is that step's
        self._notify("checkpoint_start", step=step)
        try:
            self._in_flight = step
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - disk full, permissions: name the folder and stop
            raise self._write_failed(e) from None
        self._last_save_time = time.monotonic()
        stalled = time.perf_counter() - t0
        self._poll()  # a synchronous save (checkpoint.async_save=false) is committed already
        return stalled

    def _poll(self) -> None:
        """Reports the save in flight as committed once its background write has finished (no wait)."""
        if self._in_flight is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Blocks until the last save is committed; raises CheckpointError if writing it failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_failed(e) from None
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._notify("checkpoint", step=step)

    def _write_failed(self, e: Exception) -> CheckpointError:
        """The error for the write of step `_in_flight`, after removing its temporary folder."""
        step, self._in_flight = self._in_flight, None
        if jax.process_index() == 0:
            # Orbax's writer threads can still be touching the folder when the failure reaches us (seen:
            # the folder back after one removal): remove until it stays gone, for up to 2 s.
            for _ in range(20):
                # the first save's failure may come before Orbax made the folder (create=False in _open)
                names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
                left = [n for n in names if n.startswith(f"{step}.orbax-checkpoint-tmp")]
                if not left:
                    break
                for name in left:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                time.sleep(0.1)
        committed = [s for s in committed_steps(self.directory) if s != step]
        last = f"step {committed[-1]}" if committed else "none"
        text = " ".join(str(e).split())
        reason = next((r for r in _ENVIRONMENT_REASONS if r in text), f"{type(e).__name__}: {text[:200]}")
        return CheckpointError(f"writing checkpoint step {step} to {self.directory} failed ({reason}); "
                               f"the last committed checkpoint is {last} and intact; free disk space or "
                               "fix permissions, then rerun to resume")

    def last_committed(self) -> str:
        """Names the newest committed checkpoint (waiting for a save in flight), for messages."""
        self._wait_quietly()
        steps = committed_steps(self.directory)
        if not steps:
            return f"no checkpoint was committed in {self.directory}"
        return f"the last checkpoint, step {steps[-1]} in {self.directory}, is finite and intact"

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest step that reads back intact into `abstract_state`'s shardings, or None.

        Args:
          abstract_state: a dataclass pytree (the TrainState) of `jax.ShapeDtypeStruct` with
            `sharding` set: the target layout (any mesh, any device count), as in memory (the
            stored one is `self.layout.target` of it).
        """
        unusable = []
        abstract_state = self.layout.target(abstract_state)  # what the steps hold
        for step in reversed(self.steps()):
            try:
                out = self._restore(step, abstract_state)
                meta = dict(out["meta"])
                if checksum_list(out["state"]) != meta.get("checksums"):
                    raise ValueError("array checksums differ from those recorded at save time")
                held = _held_step(out["state"])
                if held is not None and held != step:  # a folder renamed or copied over: trust the content
                    raise ValueError(f"the folder is step {step} but its state is step {held}")
                bad = nonfinite_paths(out["state"])
                if bad:  # written before saves were checked: not a state to train from
                    raise ValueError(f"{bad[0]} holds inf or NaN")
                for line in unusable:  # one line each, once a good step is found
                    print(f"warning: {line}; resumed from step {step}", file=runlog.console(), flush=True)
                stored = out["state"]
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: report and fall back
                moved = self._other_state(step, abstract_state)
                if moved:  # written by a run of another shape: a config error, not corruption
                    self.close()
                    raise ConfigError(f"checkpoint {os.path.join(self.directory, str(step))} holds a state of "
                                      f"other shapes than this config builds ({moved}); nothing was moved; "
                                      "resume with the config it was written with (its meta/metadata), or "
                                      "use a new train.run_dir") from None
                unusable.append(self._quarantine(step, e))
                continue
            return Restored(step=step, state=self.layout.load(stored), meta=meta)  # outside the try: never moves it
        if unusable:  # never start again from step 0 behind the user's back
            self.close()
            raise CheckpointError(f"every checkpoint in {self.directory} is unusable (newest: {unusable[0]}); "
                                  "inspect or delete the corrupt-* folders, then rerun: it starts from step 0")
        return None

    def _restore(self, step: int, abstract_state: Any) -> Any:
        return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                   meta=ocp.args.JsonRestore()))

    def _other_state(self, step: int, abstract_state: Any) -> str | None:
        """How the arrays stored at `step` (Orbax's metadata: names and shapes, readable once a restore
        attempt registered the item) differ from the state this config builds; None when they fit it
        (the step failed to read: corrupt) or the metadata cannot be read (corrupt too)."""
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception:  # noqa: BLE001 - unreadable metadata is the corruption case
            return None
        if stored is None:
            return None
        stored, new = shapes_by_name(stored), shapes_by_name(abstract_state)
        if stored == new:
            return None
        only = sorted(set(stored) ^ set(new), key=lambda n: (n.count("/"), n))  # params/x before opt_state/.../x
        return first_shape_change(stored, new) or (
            f"{only[0]} is in the {'checkpoint' if only[0] in stored else 'new state'} only" if only else None)

    def _quarantine(self, step: int, error: Exception) -> str:
        src = os.path.join(self.directory, str(step))
        dst = _free_name(os.path.join(self.directory, f"corrupt-{step}"))  # an earlier corrupt-N is kept too
        if jax.process_index() == 0 and os.path.isdir(src):
            os.rename(src, dst)  # kept for inspection, out of the way of the next save of `step`
        reason = " ".join(str(error).split())[:300]
        self._manager.close()
        self._manager = self._open()
        return f"checkpoint {src} is unusable ({type(error).__name__}: {reason}); moved to {dst}"

    def close(self) -> None:
        """Waits for a save in flight and reports it committed (a run stopped by an error mid-run still
        records the checkpoint its rerun resumes from), then closes. A failed write is not raised here:
        the run is already stopping with its own error, and `_write_failed` has removed the partial folder."""
        self._wait_quietly()
        self._manager.close()

    def _wait_quietly(self) -> None:
        """`wait`, a failed write left unraised (`_write_failed` has named and removed it)."""
        try:
            self.wait()
        except CheckpointError:
            pass


def _held_step(state: Any) -> int | None:
    """The step a restored state records (`TrainState.step`: the steps trained), None if it has none."""
    step = getattr(state, "step", None)
    return None if step is None else int(np.asarray(step.addressable_data(0)))


def _free_name(path: str) -> str:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist."""
    n, out = 0, path
    while os.path.exists(out):
        n += 1
        out = f"{path}.{n}"
    return out


_ENVIRONMENT_REASONS = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                        "Permission denied")
