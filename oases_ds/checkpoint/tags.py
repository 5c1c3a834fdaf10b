"""What names a checkpoint, and how it becomes visible: tags, ``latest``,
publishing and pruning.

Why this protocol:

* **``latest`` is data, not a path.**  It must name a plain tag (no separator, no ``..``)
  whose directory exists and was completed by :func:`publish`.
* **Crash-safe publication.**  A checkpoint is written under ``<tag>.partial``, renamed to
  a directory ``latest`` does not name, then ``latest`` is switched atomically, then the
  superseded copy is removed.  Re-saving tag ``T`` while ``latest`` names ``T`` publishes
  ``T.resaved`` (and the next re-save ``T`` again), so at every instant ``latest`` names a
  complete checkpoint.

All functions are filesystem logic for one process; the engine calls the writers on
rank 0 between barriers.  Several nodes need a shared filesystem.
"""
from __future__ import annotations

import json
import os
import shutil

from oases_ds.checkpoint.meta import META_FILE, CheckpointError
from oases_ds.utils.io import write_text_atomic

LATEST = "latest"
STAGING_SUFFIX = ".partial"
RESAVE_SUFFIX = ".resaved"


def check_tag(tag: str, source: str = "tag") -> str:
    """A tag is one plain directory name under the checkpoint directory, never a path."""
    if (not tag or tag in (".", "..") or "/" in tag or "\\" in tag or os.sep in tag
            or (os.altsep and os.altsep in tag) or "\0" in tag or tag != tag.strip()):
        raise CheckpointError(f"{source} names {tag!r}, which is not a plain checkpoint tag (a directory name with no "
                              "path separator); refusing to read outside the checkpoint directory")
    return tag


def read_latest(directory: str) -> str | None:
    """The tag ``directory/latest`` names, checked to be a completed checkpoint; ``None``
    when there is no ``latest`` file."""
    latest = os.path.join(directory, LATEST)
    if not os.path.isfile(latest):
        return None
    try:
        with open(latest) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read {latest}: {err}") from None
    return check_complete(directory, check_tag(tag, source=latest), source=latest)


def check_complete(directory: str, tag: str, source: str = "tag") -> str:
    """``tag`` exists under ``directory`` as a checkpoint :func:`publish` completed."""
    check_tag(tag, source)
    tag_dir = os.path.join(directory, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"{source} names tag {tag!r}, but {tag_dir} does not exist")
    if not os.path.isfile(os.path.join(tag_dir, META_FILE)):
        raise CheckpointError(f"{source} names tag {tag!r}, but {tag_dir} has no {META_FILE} (not saved by oases_ds, "
                              "or not completed)")
    return tag


def check_save_tag(tag: str) -> str:
    """Save tags are plain and do not end with the suffixes :func:`publish` reserves."""
    check_tag(tag)
    for suffix in (STAGING_SUFFIX, RESAVE_SUFFIX, ".tmp"):
        if tag.endswith(suffix):
            raise CheckpointError(f"checkpoint tag {tag!r} ends with {suffix!r}, which oases_ds reserves; pick another tag")
    if tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} would overwrite the {LATEST} file; pick another tag")
    return tag


def _latest_or_none(directory: str) -> str | None:
    """What ``latest`` names now, whether or not it is usable (a save replaces a bad one)."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def write_latest(directory: str, tag: str) -> None:
    """Atomic switch: readers see the old tag or the new one, never a torn file."""
    write_text_atomic(os.path.join(directory, LATEST), tag)


def publish(directory: str, tag: str, staged: str, save_latest: bool = True) -> str:
    """Make the complete checkpoint in ``staged`` the tag ``tag``; returns its directory name.

    Each step leaves ``latest`` naming a complete checkpoint::

        staged ---rename---> target  (a name latest does not name: T, or T.resaved if latest names T)
        latest ---replace--> target  (atomic)
        other copy of T ---> removed (unless latest still names it)
    """
    current = _latest_or_none(directory)
    resaved = f"{tag}{RESAVE_SUFFIX}"
    target, other = (resaved, tag) if current == tag else (tag, resaved)
    target_dir = os.path.join(directory, target)
    if os.path.exists(target_dir):  # not named by latest: a leftover, or an older copy this save supersedes
        shutil.rmtree(target_dir)
    os.replace(staged, target_dir)
    if save_latest:
        write_latest(directory, target)
    if other != (target if save_latest else current):
        shutil.rmtree(os.path.join(directory, other), ignore_errors=True)
    return target


def saved_tags(directory: str) -> list[str]:
    """Completed checkpoints under ``directory``, oldest first (by their save time)."""
    found = []
    for name in os.listdir(directory):
        meta = os.path.join(directory, name, META_FILE)
        if name.endswith(STAGING_SUFFIX) or not os.path.isfile(meta):
            continue
        try:
            with open(meta) as f:
                saved_at = float(json.load(f).get("saved_at", 0.0))
        except (OSError, ValueError, TypeError):
            saved_at = 0.0
        found.append((saved_at, name))
    return [name for _, name in sorted(found)]


def prune(directory: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` checkpoints (0: all), and always the one ``latest`` names;
    returns the tags removed."""
    if keep < 0:
        raise CheckpointError(f"checkpoint.keep must be >= 0 (0 keeps all), got {keep}")
    if keep == 0:
        return []
    tags = saved_tags(directory)
    protected = set(tags[-keep:]) | {_latest_or_none(directory)}
    removed = [t for t in tags if t not in protected]
    for tag in removed:
        shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
    return removed


def resolve_tag(directory: str, tag: str | None) -> str:
    """The completed tag to read from ``directory``: ``tag``, or the one ``latest`` names; one
    line otherwise, naming oases-ckpt's ``--tag`` (its only caller: a run reads ``latest``)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a directory; give the checkpoint.dir a run saved into")
    if tag is not None:
        return check_complete(directory, tag, source="--tag")
    latest = read_latest(directory)
    if latest is None:
        tags = saved_tags(directory)
        raise CheckpointError(f"{directory} has no `latest` file" + (
            f"; give one of its saved tags with --tag ({', '.join(tags)})" if tags
            else ", and no saved checkpoint: give the checkpoint.dir a run saved into"))
    return latest


def check_new_directory(path: str) -> None:
    """An output of a conversion is a new or empty directory: never written over what is there."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"{path} exists and is not an empty directory; give a new or empty directory to write into")
