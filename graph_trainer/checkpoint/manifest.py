"""Checkpoint manifests: the size and SHA-256 of every file a save wrote, checked before a load.

Contract
--------
``manifest.json`` is the last file written into a checkpoint folder. Every rank writes its files
(DCP shards, its RNG state), the ranks agree that all writes succeeded, each rank hashes the files
it wrote (``save_share``: DCP names a rank's shards ``__<rank>_<i>.distcp``; files of no known
writer are rank 0's), rank 0 gathers the hashes, checks that they cover exactly the files in the
folder and every file DCP's index refers to, and writes ``{"format", "algorithm", "files": {name:
{"size", "sha256"}}, "self_sha256"}`` (``self_sha256``: the hash of the canonical ``files`` JSON,
so a damaged manifest is told apart from a damaged shard). Only then is the folder renamed to
``step-<N>``; a folder without a manifest is never loaded: ``complete_steps(root)`` lists the
steps of the folders that are checkpoints (``unsealed_steps``: those an older graph_trainer saved
without a manifest).

``verify`` (before any load) reports the first problem as one line naming the file: the manifest
unreadable or damaged, a file missing, unexpected or not a regular file, a size or a SHA-256 that
differs. The work is split over the ranks by size (``balance``), so a resume hashes the
checkpoint once in all, in parallel.

Cost (measured: docs/performance.md): SHA-256 (OpenSSL) of every byte, one core per rank; a save
hashes what it just wrote (still in the page cache), a resume reads every byte once more before
DCP reads it (disk bound). Both grow with the checkpoint's size per rank.

What it is not: an authentication. Whoever can write the folder can write a matching manifest;
the manifest catches damage (bit rot, truncation, an interrupted copy, a file from another
checkpoint), and ``graph_trainer.checkpoint.safe_metadata`` keeps a crafted folder from running code.

By hand: ``python -m graph_trainer.cli.manifest`` (``verify`` and ``seal`` folders).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat

MANIFEST_FILE = "manifest.json"
FORMAT = 1
ALGORITHM = "sha256"
_WRITER = (re.compile(r"^__(\d+)_\d+\.distcp$"), re.compile(r"^rng-rank(\d+)\.pt$"))
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _steps_with(root: str, present: str, absent: str | None = None) -> list[int]:
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if (
            match
            and os.path.isfile(os.path.join(root, name, present))
            and not (absent and os.path.exists(os.path.join(root, name, absent)))
        ):
            steps.append(int(match.group(1)))
    return sorted(steps)


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints in ``root``, ascending (tmp / half-written folders excluded)."""
    # The exact name marks a finished save (rank 0 renames only after every rank wrote), and the
    # manifest is written last before that rename; step-N folders without one are not ours, or older.
    return _steps_with(root, MANIFEST_FILE)


def unsealed_steps(root: str) -> list[int]:
    """Steps of checkpoints without a manifest (saved by a graph_trainer before manifests existed)."""
    return _steps_with(root, "metadata.json", absent=MANIFEST_FILE)


def file_entry(path: str) -> dict:
    """``{"size", "sha256"}`` of one file."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, ALGORITHM).hexdigest()
        size = os.fstat(f.fileno()).st_size
    return {"size": size, "sha256": digest}


def folder_files(folder: str) -> list[str]:
    """Every entry of ``folder`` (recursively, relative, sorted) except the manifest itself."""
    names = []
    for parent, dirs, files in os.walk(folder):
        rel = os.path.relpath(parent, folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(parent, d))]:
            names.append(name if rel == "." else os.path.join(rel, name))
    return sorted(n for n in names if n != MANIFEST_FILE)


def writer_rank(name: str) -> int | None:
    """The rank that wrote ``name`` when its name says so (DCP shards, RNG states), else None."""
    for pattern in _WRITER:
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def save_share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files this rank hashes at save time: the ones it wrote (still in its page cache); rank 0
    takes those of no known writer (``.metadata``, the JSON files)."""

    def owner(name: str) -> int:
        writer = writer_rank(name)
        return writer if writer is not None and writer < world_size else 0

    return [n for n in names if owner(n) == rank]


def balance(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Split files over ranks so each hashes about the same number of bytes (largest first, to the
    least loaded rank; ties by name, so every rank computes the same split)."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        shares[r].append(name)
        load[r] += sizes[name]
    return shares


def _self_hash(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build(files: dict[str, dict]) -> dict:
    return {
        "format": FORMAT,
        "algorithm": ALGORITHM,
        "files": dict(sorted(files.items())),
        "self_sha256": _self_hash(files),
    }


def write(folder: str, manifest: dict) -> None:
    """Write ``manifest.json`` durably (file and folder fsynced): it is what makes the folder a checkpoint."""
    path = os.path.join(folder, MANIFEST_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(folder: str) -> tuple[dict | None, str | None]:
    """(manifest, None), or (None, one line saying why it cannot be used)."""
    path = os.path.join(folder, MANIFEST_FILE)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None, f"{MANIFEST_FILE} is missing (an interrupted save, or a checkpoint of an older graph_trainer)"
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST_FILE} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
        return None, f"{MANIFEST_FILE} is not a format-{FORMAT} {ALGORITHM} manifest"
    files = manifest.get("files")
    if not isinstance(files, dict) or manifest.get("self_sha256") != _self_hash(files):
        return None, f"{MANIFEST_FILE} is damaged (its own checksum differs)"
    return manifest, None


def check_listing(folder: str, manifest: dict) -> str | None:
    """Whether the folder holds exactly the manifest's files, each a regular file of the listed size."""
    listed = manifest["files"]
    present = folder_files(folder)
    missing = sorted(set(listed) - set(present))
    if missing:
        return f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    unexpected = sorted(set(present) - set(listed))
    if unexpected:
        return f"{unexpected[0]} is not in {MANIFEST_FILE}"
    for name in present:
        info = os.lstat(os.path.join(folder, name))
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size != listed[name]["size"]:
            return f"{name} has {info.st_size} bytes, {listed[name]['size']} were saved"
    return None


def check_files(folder: str, manifest: dict, names: list[str]) -> str | None:
    """The first of ``names`` whose size or SHA-256 differs from the manifest (one line), else None."""
    for name in names:
        want = manifest["files"][name]
        try:
            got = file_entry(os.path.join(folder, name))
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
        if got["size"] != want["size"]:
            return f"{name} has {got['size']} bytes, {want['size']} were saved"
        if got["sha256"] != want["sha256"]:
            return (
                f"{name} differs from what was saved (SHA-256 {got['sha256'][:12]}..., saved {want['sha256'][:12]}...)"
            )
    return None


def verify_folder(folder: str) -> str | None:
    """Everything ``verify`` checks, in this one process: None when the folder is as saved."""
    manifest, problem = read(folder)
    if problem:
        return problem
    return check_listing(folder, manifest) or check_files(folder, manifest, sorted(manifest["files"]))


def seal(folder: str) -> dict:
    """Write the manifest of a finished checkpoint folder as it is now (for checkpoints saved before manifests)."""
    manifest = build({name: file_entry(os.path.join(folder, name)) for name in folder_files(folder)})
    write(folder, manifest)
    return manifest
