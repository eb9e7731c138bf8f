"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find, check, resume.

Contract
--------
``Checkpointer.save(step, ...)`` writes ``<root>/step-<N>`` where ``<root>`` is ``checkpoint.folder``
(relative to ``job.dump_folder`` unless absolute; all ranks must see it). All ranks write into
``step-<N>.tmp-<token>`` (token chosen by rank 0), agree that every write succeeded, and hash what
they wrote; rank 0 writes ``manifest.json`` last (``graph_trainer.checkpoint.manifest``: size and SHA-256 of
every file of every rank) and renames the folder to ``step-<N>`` (atomically replacing an existing
one: ``atomic_files.replace_dir``). Only folders named exactly ``step-<N>`` holding ``manifest.json``
count as checkpoints, so a crashed save is never found. A state with a non-finite tensor is never
saved (``guards.check_state``). An I/O failure on any rank (full disk, read-only folder) is one
``JobError`` on every rank; the temporary folder is removed and the earlier checkpoints are untouched.
What the folder holds (DCP files, ``metadata.json``, ``train_state.json``, ``rng-rank<R>.pt``) and
how it maps onto the model, AdamW, the LR schedule, the data loader and the RNG is
``graph_trainer.checkpoint.state``.

``Checkpointer.resolve_load_step()`` runs first: rank 0 removes what interrupted saves left
(``atomic_files.clean_leftovers``), then picks what to resume (``checkpoint.load_step``: -1 the
newest checkpoint that verifies, 0 none, N exactly step-N, else ``ConfigError`` listing the
available steps). Verifying (``manifest``, split over the ranks) comes before anything is loaded:
with -1 a checkpoint that fails is reported, renamed ``step-<N>.corrupt-<token>`` and the next
older one tried; with N it is a ``ConfigError`` naming the file. A run that would leave checkpoints
of another run beside its own (load_step 0 in a folder holding checkpoints, or load_step N with
later steps there) is refused unless ``checkpoint.move_aside``. Every decision is rank 0's,
broadcast, so all ranks resume from the same step. ``load`` then restores everything in place
before the first step (``checkpoint_state``: bitwise identical to not stopping when the layout is
unchanged).

``checkpoint.async_mode async``: ``save`` copies the tensors to host memory (DCP's ``async_save``),
writes the small files and returns; writing the tensors, hashing and sealing run on a thread
(``background.BackgroundSave``) over a gloo group of their own. The next ``save`` and the end of
the job wait for it; its failure is the same ``JobError`` there. A job that ends (its last step,
a one-line error, SIGTERM) gives a save in flight ``checkpoint.finish_timeout_seconds`` to be
sealed (``finish_pending(timeout)``, called by the trainer on every way out); one not sealed by
then is never a checkpoint, and the newest complete one stays the one a restart resumes. The
files hold the state as it was when ``save`` was called (the host copy): bitwise a blocking save's.

Retention: once a save is complete, rank 0 deletes the complete checkpoints older than the newest
``checkpoint.keep_latest_k`` (``atomic_files.remove_steps``: renamed away, then deleted), never the
one just saved; other ranks do not wait for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid

import torch
import torch.distributed as dist

from graph_trainer.checkpoint import manifest
from graph_trainer.checkpoint.atomic_files import (
    clean_leftovers,
    full_disk_note,
    move_aside,
    remove_steps,
    replace_dir,
    trim_step_lines,
)
from graph_trainer.checkpoint.background import BackgroundSave
from graph_trainer.checkpoint.manifest import complete_steps, unsealed_steps
from graph_trainer.checkpoint.safe_metadata import load_dcp_metadata, metadata_path
from graph_trainer.checkpoint.state import (
    check_model,
    gathered_data_state,
    load_tensors,
    param_shapes,
    read_metadata,
    restore_rng,
    restore_train_state,
    save_rng,
    save_tensors,
    start_saving_tensors,
    tensor_state,
    write_metadata,
    write_train_state,
)
from graph_trainer.config import JobConfig
from graph_trainer.config_paths import checkpoint_root
from graph_trainer.distributed.comm import agree
from graph_trainer.errors import ConfigError, JobError
from graph_trainer.loop.guards import check_state
from graph_trainer.loop.optim import lr_plan, lr_replan
from graph_trainer.torch_compat import dcp_storage_files
from models.registry import model_record

logger = logging.getLogger("graph_trainer")


def _steps(steps: list[int]) -> str:
    return ", ".join(f"step-{s}" for s in steps)


class Checkpointer:
    """Saves and restores the training state of one job; see the module docstring."""

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, degrees: dict[str, int], device: torch.device):
        self.cfg = cfg
        self.root = checkpoint_root(cfg)
        self.rank = rank
        self.world_size = world_size
        self.degrees = dict(degrees)
        self.device = device
        self.distributed = dist.is_available() and dist.is_initialized()
        self.background = cfg.checkpoint.async_mode == "async"
        # (a group of its own: a background save's collectives run beside the training step's)
        self.async_group = dist.new_group(backend="gloo") if self.background and self.distributed else None
        self.pending: BackgroundSave | None = None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def should_save(self, step: int, last_step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return interval > 0 and (step % interval == 0 or step == last_step)

    def _on_rank0(self, fn):
        """Run ``fn`` on rank 0 only and give every rank its result (or its one-line error), so that all
        ranks take the same decision and none waits in a collective the others skipped."""
        if not self.distributed:
            try:
                return fn()
            except OSError as e:
                raise JobError(f"checkpoint folder {self.root}: {e.strerror or e}: {e.filename}") from None
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except ConfigError as e:
                box[0] = ("config", str(e))
            except (JobError, OSError) as e:
                box[0] = (
                    "job",
                    str(e)
                    if isinstance(e, JobError)
                    else f"checkpoint folder {self.root}: {e.strerror or e}: {e.filename}",
                )
            except Exception as e:  # unblock the other ranks, then fail loudly here
                dist.broadcast_object_list([("crash", repr(e))], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "config":
            raise ConfigError(value)
        if kind == "job":
            raise JobError(value)
        if kind == "crash":
            raise RuntimeError(f"rank 0 failed while reading checkpoints: {value}")
        return value

    def _gather(self, obj, group=None) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    # ------------------------------------------------------------------------------ resume

    def _scan(self) -> tuple[list[int], list[int], list[str]]:
        """(rank 0) Clean leftovers of interrupted saves; list sealed and unsealed checkpoints."""
        try:
            done = clean_leftovers(self.root)
        except OSError as e:  # a read-only folder a job only resumes from: the leftovers are never read
            done = [f"cannot remove what interrupted saves left ({e.strerror or e}); ignored"]
        return complete_steps(self.root), unsealed_steps(self.root), done

    def _check_index(self, step: int, files: dict) -> None:
        """(rank 0) DCP's index unpickles with only checkpoint classes (else ConfigError: crafted or
        foreign) and every file it refers to is in the manifest."""
        path = self.step_dir(step)
        unlisted = sorted(dcp_storage_files(load_dcp_metadata(metadata_path(path))) - set(files))
        if unlisted:
            raise ConfigError(
                f"checkpoint {path}: DCP's index refers to {unlisted[0]}, which its manifest does not list"
            )

    def _verify(self, step: int) -> str | None:
        """Check ``step-<step>`` against its manifest on all ranks (each hashes a share); None when it is
        exactly what was saved, else one line naming the first file that is not. A checkpoint of another
        model, or whose index holds anything but checkpoint classes, raises ConfigError instead."""
        path = self.step_dir(step)

        def head():  # cheap checks first, so a wrong checkpoint fails fast
            saved, problem = manifest.read(path)
            problem = problem or manifest.check_listing(path, saved)
            problem = problem or (
                manifest.check_files(path, saved, ["metadata.json"])
                if "metadata.json" in saved["files"]
                else "metadata.json is missing"
            )
            if problem:
                return None, problem
            check_model(path, self.cfg.model)  # metadata.json verified above: format and model are this run's
            return saved, None

        saved, problem = self._on_rank0(head)
        if problem:
            return problem
        sizes = {name: entry["size"] for name, entry in saved["files"].items() if name != "metadata.json"}
        mine = manifest.balance(sizes, self.world_size)[self.rank]
        problems = [p for p in self._gather(manifest.check_files(path, saved, mine)) if p]
        if problems:
            return problems[0]
        self._on_rank0(lambda: self._check_index(step, saved["files"]))
        return None

    def _writes_beside(self) -> bool:
        """Whether this run adds to the checkpoint folder, or keeps its losses.txt beside it."""
        dump = os.path.realpath(self.cfg.job.dump_folder)
        return self.cfg.checkpoint.interval > 0 or os.path.realpath(self.root).startswith(dump + os.sep)

    def _refuse_or_move_aside(self, chosen: int | None, others: list[int], unsealed: list[int]) -> None:
        """Other runs' checkpoints would stay beside this run's: refuse, or move them aside (move_aside)."""
        want = self.cfg.checkpoint.load_step
        names = _steps(others)
        if not self.cfg.checkpoint.move_aside:
            hint = (
                "pass --checkpoint.move_aside True to move them into "
                f"{os.path.normpath(self.root)}.aside-<time>/, or use another checkpoint.folder"
            )
            if want == 0:
                raise ConfigError(
                    f"checkpoint.load_step = 0 starts fresh, but {self.root} holds checkpoints ({names}) "
                    f"of an earlier run, which a later resume would mix with this one; resume them "
                    f"(checkpoint.load_step -1), or {hint} (losses.txt too)"
                )
            if want > 0:
                raise ConfigError(
                    f"checkpoint.load_step = {want} continues step-{want}, but {self.root} also holds "
                    f"later steps ({names}) of the run it abandons, which a later resume would pick "
                    f"up; {hint}"
                )
            raise ConfigError(
                f"{self.root} holds checkpoints without {manifest.MANIFEST_FILE} "
                f"({_steps(sorted(set(others) & set(unsealed)))}): saved before graph_trainer wrote "
                f"manifests, or not by graph_trainer, so they cannot be verified; seal one you trust "
                f"with `python -m graph_trainer.cli.manifest seal <folder>`, or {hint}"
            )
        losses = os.path.join(self.cfg.job.dump_folder, "losses.txt")
        aside = self._on_rank0(
            lambda: move_aside(self.root, [f"step-{s}" for s in others], losses, keep_losses=chosen is not None)
        )
        self._warn(
            "checkpoint.move_aside: moved %s%s into %s",
            names,
            " and losses.txt" if chosen is None else " and a copy of losses.txt",
            aside,
        )

    def _quarantine(self, failed: list[tuple[int, str]]) -> None:
        """(all ranks) Rename checkpoints that failed verification, so no later resume finds them."""

        def rename():
            token = uuid.uuid4().hex[:8]
            try:
                for step, _ in failed:
                    os.rename(self.step_dir(step), f"{self.step_dir(step)}.corrupt-{token}")
            except OSError as e:  # read-only: every later resume verifies (and skips) them again
                return f"cannot rename them ({e.strerror or e}); they stay, and fail verification again"
            return "renamed " + ", ".join(f"step-{s} to step-{s}.corrupt-{token}" for s, _ in failed)

        self._warn("%s (kept for inspection; never loaded)", self._on_rank0(rename))

    def _warn(self, *args) -> None:
        """A warning about a decision every rank shares: rank 0 logs it."""
        if self.rank == 0:
            logger.warning(*args)

    def resolve_load_step(self) -> int | None:
        """The step to resume from (None: start fresh), verified. Call it before building the model."""
        want = self.cfg.checkpoint.load_step
        start = time.perf_counter()
        sealed, unsealed, cleaned = self._on_rank0(self._scan)
        for line in cleaned:
            logger.info("checkpoint folder %s: %s", self.root, line)
        chosen, failed = None, []
        if want > 0:
            if want not in sealed:
                legacy = (
                    f" (step-{want} has no {manifest.MANIFEST_FILE}: saved before manifests; seal it with "
                    f"`python -m graph_trainer.cli.manifest seal` if you trust it)"
                    if want in unsealed
                    else ""
                )
                raise ConfigError(
                    f"checkpoint.load_step = {want}: no complete checkpoint step-{want} in {self.root}; "
                    f"available steps: {', '.join(map(str, sealed)) or 'none'}{legacy}"
                )
            problem = self._verify(want)
            if problem:
                raise ConfigError(f"checkpoint {self.step_dir(want)} fails verification: {problem}; nothing was loaded")
            chosen = want
        elif want == -1:
            for step in reversed(sealed):
                problem = self._verify(step)
                if problem is None:
                    chosen = step
                    break
                failed.append((step, problem))
                self._warn("checkpoint %s fails verification: %s", self.step_dir(step), problem)
            if failed and chosen is None:
                raise ConfigError(
                    f"no checkpoint in {self.root} verifies ({'; '.join(f'step-{s}: {p}' for s, p in failed)}); "
                    f"nothing was loaded. Restore them, or start fresh with checkpoint.load_step 0 and "
                    f"checkpoint.move_aside True"
                )
        others = [
            s for s in sorted(set(sealed) | set(unsealed)) if s not in dict(failed) and (chosen is None or s > chosen)
        ]
        if others and self._writes_beside():
            self._refuse_or_move_aside(chosen, others, unsealed)
        if failed:
            self._quarantine(failed)
            self._warn("resuming from %s, the newest checkpoint that verifies", self.step_dir(chosen))
        if chosen is not None:
            logger.info(
                "resuming from checkpoint %s (step %d), verified in %.2fs",
                self.step_dir(chosen),
                chosen,
                time.perf_counter() - start,
            )
        elif want == -1 and os.path.isdir(self.root):
            logger.info("no complete checkpoint in %s; starting from step 1", self.root)
        return chosen

    def load(self, step: int, model, optimizer, scheduler, dataloader) -> None:
        """Restore model, AdamW, LR schedule, data position and RNG in place from ``step-<step>``
        (verified by ``resolve_load_step``)."""
        start = time.perf_counter()
        path = self.step_dir(step)
        meta = read_metadata(path)
        load_tensors(path, meta, self.cfg.model, model, optimizer, self.distributed)
        replan = lr_replan(restore_train_state(path, step, optimizer, scheduler, dataloader), self.cfg.training, step)
        if replan and self.rank == 0:
            logger.warning("resuming step-%d: %s", step, replan)
        if int(meta.get("world_size", -1)) == self.world_size:
            restore_rng(path, self.rank, self.device)
        else:
            logger.info(
                "checkpoint was written by %s ranks, this run has %d: RNG states not restored",
                meta.get("world_size"),
                self.world_size,
            )
        if self.rank == 0:  # (lines a longer earlier run left after this step)
            trim_step_lines(os.path.join(self.cfg.job.dump_folder, "losses.txt"), step)
        logger.info("loaded checkpoint %s in %.2fs", path, time.perf_counter() - start)

    # ------------------------------------------------------------------------------ save

    def _write_state(self, tmp: str, step: int, state: dict | None, model, scheduler, data_state: dict) -> None:
        """(all ranks) Every file of the checkpoint but the manifest (and, without ``state``, but the
        tensors: a background save writes those)."""
        if state is not None:
            save_tensors(tmp, state, self.distributed)
        save_rng(tmp, self.rank, self.device)
        shapes = param_shapes(model, self.distributed)  # (every rank joins: pipeline ranks hold parts)
        if self.rank == 0:
            write_train_state(tmp, step, scheduler, data_state, lr_plan(self.cfg.training))
            write_metadata(tmp, step, model_record(self.cfg), self.degrees, self.world_size, shapes)

    def _seal(self, tmp: str, final: str, hashed: list[dict]) -> None:
        """(rank 0) Check every rank's files are there, write the manifest, make the folder ``step-<N>``.

        DCP's index is read back from the ``.metadata`` file, as a load reads it: the ``Metadata``
        that ``dcp.save`` returns lists no files in torch 2.11 (its ``storage_data`` is None)."""
        present = manifest.folder_files(tmp)
        files = {name: entry for share in hashed for name, entry in share.items()}
        for name in sorted(set(present) - set(files)):  # written by no rank we know of: hash it here
            files[name] = manifest.file_entry(os.path.join(tmp, name))
        try:
            indexed = dcp_storage_files(load_dcp_metadata(metadata_path(tmp)))
        except ConfigError as e:  # we wrote it a moment ago: an unreadable index is a failed save
            raise JobError(str(e)) from None
        missing = sorted((set(files) | indexed) - set(present))
        if missing:
            raise JobError(f"{missing[0]} is not in {tmp}: a rank's write did not reach the shared folder")
        manifest.write(tmp, manifest.build(files))
        replace_dir(tmp, final)

    def save(self, step: int, model, optimizer, scheduler, dataloader, before_first_step: bool = False) -> str:
        """Write ``step-<step>`` atomically (all ranks call this); returns its path. ``before_first_step``:
        the optimizer has not stepped (a converted ``step-0``): its state is saved as AdamW would create it.
        With ``checkpoint.async_mode`` async (not for a converted step-0) it returns once the tensors
        are copied to host memory and the small files written; the rest runs in the background
        (``finish_pending``, which the next save calls first)."""
        self.finish_pending()
        start = time.perf_counter()
        final = self.step_dir(step)
        state = tensor_state(model, optimizer, create=before_first_step)
        check_state(step, state)
        # One token for all ranks so they write into the same tmp folder; unique per attempt so a
        # leftover from a crashed save is never mixed with this one.
        token = self._on_rank0(lambda: uuid.uuid4().hex[:8])
        tmp = f"{final}.tmp-{token}"
        what = f"cannot save checkpoint {final}"
        background = self.background and not before_first_step
        data_state = gathered_data_state(dataloader, self.distributed)
        try:
            agree(lambda: os.makedirs(tmp) if self.rank == 0 else None, what)
            tensors = None if background else state
            agree(lambda: self._write_state(tmp, step, tensors, model, scheduler, data_state), what)
            if background:
                writes = agree(lambda: start_saving_tensors(tmp, state, self.distributed, self.async_group), what)
        except JobError as e:
            raise self._failed(tmp, e) from None
        if not background:
            self._complete(step, tmp, final, start, None)
            return final
        logger.info(
            "checkpoint %s: state copied in %.2fs, written in the background", final, time.perf_counter() - start
        )
        self.pending = BackgroundSave(lambda: self._complete(step, tmp, final, start, writes), final)
        return final

    def _complete(self, step: int, tmp: str, final: str, start: float, writes) -> None:
        """(all ranks) The rest of a save once the files are being written: wait for the tensors
        (``writes``: a background save's DCP future, over the save's own group), hash every rank's
        share, seal (rank 0), retention."""
        group, what = (self.async_group if writes is not None else None), f"cannot save checkpoint {final}"
        try:
            if writes is not None:
                agree(writes.result, what, group)
            written = time.perf_counter()
            # every rank's files are in tmp now (agree gathered from all): hash our own share
            mine = agree(
                lambda: {
                    n: manifest.file_entry(os.path.join(tmp, n))
                    for n in manifest.save_share(manifest.folder_files(tmp), self.rank, self.world_size)
                },
                what,
                group,
            )
            hashed = self._gather(mine, group)
            agree(lambda: self._seal(tmp, final, hashed) if self.rank == 0 else None, what, group)
        except JobError as e:
            raise self._failed(tmp, e) from None
        seconds = (time.perf_counter() - start, time.perf_counter() - written)
        logger.info("saved checkpoint %s in %.2fs (manifest: %.2fs)", final, *seconds)
        if self.rank == 0:
            self._keep_latest(step)

    def _failed(self, tmp: str, error: JobError) -> JobError:
        full = full_disk_note(self.root, str(error))  # (before the partial save's space is freed)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never a checkpoint; the earlier ones are untouched
        return JobError(f"{error}{full} (earlier checkpoints are intact)")

    def finish_pending(self, timeout: float | None = None) -> bool:
        """Wait until the background save (if one runs) is sealed (True); raise its failure (a
        ``JobError`` on every rank). With ``timeout``: a save still running after that many
        seconds is given up (False): nothing waits for it again, and what it has not sealed when
        the process ends is an unsealed folder the next start removes. An interrupted wait (a
        signal's exception) leaves it pending."""
        pending, sealed = self.pending, True
        try:
            sealed = pending is None or pending.wait(timeout)
        finally:
            if pending is not None and (pending.done or not sealed):
                self.pending = None
        return sealed

    def _keep_latest(self, saved: int) -> None:
        """(rank 0, after step ``saved`` is complete) Delete the complete checkpoints older than the
        newest ``checkpoint.keep_latest_k`` (never ``saved``). A failure is a warning: the new
        checkpoint is complete, and the next save tries again."""
        k = self.cfg.checkpoint.keep_latest_k
        old = [s for s in complete_steps(self.root)[:-k] if s != saved] if k > 0 else []
        if not old:
            return
        try:
            remove_steps(self.root, [f"step-{s}" for s in old])
        except OSError as e:
            logger.warning("checkpoint.keep_latest_k %d: cannot delete %s (%s); kept", k, _steps(old), e.strerror or e)
            return
        logger.info("checkpoint.keep_latest_k %d: deleted %s", k, _steps(old))
