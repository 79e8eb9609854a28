"""Small file helpers: atomic writes, JSON reading with clear errors, a progress bar."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from edgespec.errors import EdgespecError, one_line


def utf8(text: str, what: str = "text") -> bytes:
    """Text as UTF-8; undecodable input (surrogates from a non-UTF-8 command line) is a clear
    error, not a traceback."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EdgespecError(f"the {what} is not valid UTF-8 (undecodable bytes at character "
                            f"{e.start}); pass UTF-8 text") from None


def describe_error(e: BaseException) -> str:
    """One line for an error from a writer: the OS's words where it has them."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def atomic_write(path: str | Path, write) -> None:
    """Write via a temp file in the same folder, then rename: readers never see half a file.

    `write` receives the temp path. An error (disk full, permissions) leaves `path` untouched.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise EdgespecError(f"{path.parent}: cannot write here ({e.strerror})") from None
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; finished files get normal modes
        os.replace(tmp, path)
    except EdgespecError:
        raise
    except Exception as e:  # disk full and friends, raised by whichever library writes
        raise EdgespecError(f"{path}: write failed ({describe_error(e)}); nothing was written "
                            "there") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_result(folder: str | Path, stem: str, doc: dict) -> Path:
    """Results are append-only: write `doc` to folder/stem.json, or to stem-run2.json, -run3 ...
    where earlier runs already stand; returns the path written."""
    folder = Path(folder)
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-run{n}.json"
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    return path


def read_json(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgespecError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgespecError(f"{path}: not valid JSON ({e})") from None


def progress(total: int, desc: str, unit: str = "it", initial: int = 0, show: bool = True):
    """A tqdm bar on stderr (tqdm comes with llama-cpp-python's dependencies); `show=False`
    (a rank other than 0) draws nothing."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                dynamic_ncols=True,
                disable=not show or os.environ.get("EDGESPEC_NO_PROGRESS") == "1")


def read_prompt_lines(path: str | Path, nonempty: bool = False) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL prompt file; every object needs
    a string field `prompt` (non-empty if asked). Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise EdgespecError(f"{path}: no such prompt file")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EdgespecError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or (
                nonempty and not obj["prompt"].strip()):
            need = "a non-empty string field 'prompt'" if nonempty else "a string field 'prompt'"
            raise EdgespecError(f"{path}:{i}: each line needs {need}")
        out.append((i, obj))
    return out


def int_at_least(v: str, low: int) -> int:
    """A command-line whole number >= low (argparse's type check: a one-line usage error)."""
    import argparse

    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{v}'") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected a number >= {low}, got {n}")
    return n
