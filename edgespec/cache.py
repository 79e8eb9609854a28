"""edgespec's one cache: derived files that are slow to make and safe to delete (the runtime
and the targets use it; tests point it at a temporary folder).

Root: $EDGESPEC_CACHE, else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec. Entries are keyed
by the content of the files they derive from (`file_identity`), so one target opened by name
and by path shares them; files are written through unique temp files and renamed into place;
built folders are evicted least recently used first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write_text

IDS_FILE = "file-ids.json"


def cache_root() -> Path:
    env = os.environ.get("EDGESPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "edgespec"


def read_json(name: str) -> dict:
    """A JSON file of the cache ({} when absent or unreadable: a cache may always be lost)."""
    try:
        d = json.loads((cache_root() / name).read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def write_json(name: str, data: dict) -> bool:
    """Write atomically (unique temp file + rename); False where the cache is not writable."""
    path = cache_root() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data))
        return True
    except (OSError, EdgespecError):
        return False


def put_json(name: str, key: str, value, keep: int = 32) -> bool:
    """Set one entry of a JSON file of the cache, keeping the `keep` most recently set."""
    data = read_json(name)
    data.pop(key, None)
    data[key] = value
    return write_json(name, dict(list(data.items())[-keep:]))


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_identity(path: str | Path) -> str:
    """The sha256 of a file's content (first 16 hex digits). Hashed once per (path, size,
    mtime, inode) and remembered in the cache, so a 250 MB target costs a read once."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    entry = read_json(IDS_FILE).get(str(path))
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return str(entry["sha256"])
    digest = sha256_file(path)[:16]
    put_json(IDS_FILE, str(path), {"stamp": stamp, "sha256": digest}, keep=256)
    return digest


def built_folder(kind: str, key: str, build: Callable[[Path], None], need_bytes: int = 0,
                 keep: int = 4, log: Callable[[str], None] | None = None) -> Path:
    """cache_root()/kind/key, made by `build(tmp_folder)` if absent: built in a private temp
    folder and renamed into place, so readers (and a second process building the same entry)
    never see half of it. At most `keep` entries of a kind stay (least recently used go)."""
    folder = cache_root() / kind / key
    if folder.is_dir():
        _touch(folder)
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder.parent).free
    except OSError as e:
        raise EdgespecError(f"{folder.parent}: cannot write the cache ({e.strerror}); set "
                            "EDGESPEC_CACHE to a writable folder") from None
    if need_bytes and free < need_bytes + (64 << 20):
        raise EdgespecError(f"{folder.parent}: {free >> 20} MB free, {need_bytes >> 20} MB needed; "
                            "free some space or set EDGESPEC_CACHE elsewhere")
    if log:
        log(f"building {kind} cache entry {key} (once; in {folder})")
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():  # not another process's finished build
                raise
    except OSError as e:
        raise EdgespecError(f"{folder}: cannot write the cache ({e.strerror})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _touch(folder)
    evict(kind, keep, spare=folder)
    return folder


def _touch(folder: Path) -> None:
    try:
        os.utime(folder, None)
    except OSError:
        pass


def evict(kind: str, keep: int, spare: Path | None = None) -> list[Path]:
    """Remove all but the `keep` most recently used entries of a kind (and stale temp folders
    of builds that died more than a day ago); returns what was removed."""
    root = cache_root() / kind
    if not root.is_dir():
        return []
    now, removed = time.time(), []
    entries = []
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if p.name.startswith("."):
            if now - p.stat().st_mtime > 86400:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
            continue
        entries.append(p)
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for p in entries[keep:]:
        if p != spare:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
