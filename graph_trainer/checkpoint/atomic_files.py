"""File-system steps that never leave a half state: atomic file and folder replacement, and the
clean-up of what an interrupted save left behind.

* ``write_text_atomic``: the new content lands in a temporary file beside the target, is fsynced
  and renamed over it; a reader (or a crash) sees the old file or the new one, never a mix.
* ``replace_dir(new, final)``: ``new`` takes the name ``final``. When ``final`` exists the two are
  swapped in one step (Linux ``renameat2(RENAME_EXCHANGE)``) and the old content, now under the
  temporary name, is deleted; at no moment is there no ``final``. Where the file system cannot swap,
  ``final`` is first renamed to ``<final>.old-<token>`` and then ``new`` to ``final``: a crash between
  the two leaves ``.old-``, which ``clean_leftovers`` renames back at the next start.
* ``clean_leftovers(root)``: removes ``step-<N>.tmp-<token>`` folders (saves that never reached
  their rename, so never checkpoints; up to a whole checkpoint each) and restores or removes
  ``.old-`` folders as above. It assumes one job per checkpoint folder: a second job started on a
  folder while the first saves would remove the first one's save in progress.
* ``remove_steps(root, names)``: deletes old checkpoints (``checkpoint.keep_latest_k``): each is first
  renamed ``<name>.removing-<token>``, so from that moment it is no checkpoint, then deleted; a crash
  in between leaves the ``.removing-`` folder, which ``clean_leftovers`` deletes.
* ``trim_step_lines``: a resumed run's ``losses.txt`` without the lines after its step, atomically.
* ``move_aside``: moves checkpoints (and a ``losses.txt``) into ``<root>.aside-<time>/``, never deleting.
* ``full_disk_note``: what to add to a failed write's error when the disk is nearly full.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import time
import uuid

_TMP = re.compile(r"^step-(\d+)\.tmp-[0-9a-f]+$")
_OLD = re.compile(r"^step-(\d+)\.old-[0-9a-f]+$")
_REMOVING = re.compile(r"^step-(\d+)\.removing-[0-9a-f]+$")
_NEARLY_FULL = 64 << 20  # bytes free below which a failed write is blamed on the disk
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_dir(path: str) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def trim_step_lines(path: str, step: int) -> None:
    """Drop the lines of ``path`` (``"<step> ..."`` lines, as ``losses.txt``) whose step is after
    ``step``, atomically (``write_text_atomic``); nothing when there are none or no file."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = [line for line in lines if not (line[:1].isdigit() and int(line.split()[0]) > step)]
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(kept))


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths atomically; False when this system cannot (not Linux, old glibc, or
    a file system without RENAME_EXCHANGE)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def replace_dir(new: str, final: str, *, exchange=_exchange) -> None:
    """Give folder ``new`` the name ``final`` atomically, deleting what ``final`` held (see module docstring)."""
    root = os.path.dirname(os.path.abspath(final))
    if not os.path.exists(final):
        os.rename(new, final)
    elif exchange(new, final):
        fsync_dir(root)
        shutil.rmtree(new)  # it now holds the old content
    else:
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(new, final)  # a crash before this line: clean_leftovers puts `old` back
        fsync_dir(root)
        shutil.rmtree(old)
    fsync_dir(root)


def clean_leftovers(root: str) -> list[str]:
    """Remove interrupted saves and finish interrupted replacements in ``root``; returns what was done."""
    if not os.path.isdir(root):
        return []
    done = []
    names = sorted(os.listdir(root))
    for name in names:
        path = os.path.join(root, name)
        old = _OLD.match(name)
        if old:
            final = os.path.join(root, f"step-{old.group(1)}")
            if os.path.exists(final):
                shutil.rmtree(path)
                done.append(f"removed {name} (replaced by step-{old.group(1)})")
            else:
                os.rename(path, final)
                done.append(f"restored step-{old.group(1)} from {name} (a replacement was interrupted)")
    for name in names:
        if _TMP.match(name) and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name))
            done.append(f"removed {name} (an interrupted save)")
        elif _REMOVING.match(name) and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name))
            done.append(f"removed {name} (an old checkpoint whose removal was interrupted)")
    if done:
        fsync_dir(root)
    return done


def remove_steps(root: str, names: list[str]) -> None:
    """Delete the checkpoint folders ``names`` of ``root`` (see module docstring)."""
    token = uuid.uuid4().hex[:8]
    renamed = []
    for name in names:
        away = os.path.join(root, f"{name}.removing-{token}")
        os.rename(os.path.join(root, name), away)
        renamed.append(away)
    fsync_dir(root)
    for path in renamed:
        shutil.rmtree(path)
    fsync_dir(root)


def aside_folder(root: str) -> str:
    """A new ``<root>.aside-<time>`` path beside ``root`` (not created)."""
    base = f"{os.path.normpath(root)}.aside-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def move_aside(root: str, names: list[str], losses: str | None, keep_losses: bool) -> str:
    """Move ``names`` (folders in ``root``) into a new aside folder, with a copy (``keep_losses``) or
    the original of ``losses``; returns the aside folder."""
    aside = aside_folder(root)
    os.makedirs(aside)
    for name in names:
        os.rename(os.path.join(root, name), os.path.join(aside, name))
    if losses and os.path.isfile(losses):
        target = os.path.join(aside, os.path.basename(losses))
        if keep_losses:
            shutil.copy2(losses, target)
        else:
            shutil.move(losses, target)
    fsync_dir(root)
    return aside


def full_disk_note(folder: str, error: str) -> str:
    """``"; the disk holding <folder> has N MiB free: it is full"`` when a write into ``folder``
    failed (``error``) on a nearly full disk without saying so: torch's zip writer reports a full
    disk only as a short file ("unexpected pos"); ``""`` otherwise."""
    if "No space left" in error:
        return ""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f"; the disk holding {folder} has {free / (1 << 20):.1f} MiB free: it is full" if free < _NEARLY_FULL else ""
