"""Where ocache keeps things outside the repository.

Everything expensive (the llama.cpp sdist, the llama-server build, generated models) and everything
private (anchors, spilled sessions, the folder journal) lives under one cache root, never in the
checkout: ``$OCACHE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ocache``, else ``~/.cache/ocache``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from pathlib import Path
from typing import Callable, Iterator


def cache_root() -> Path:
    """Return the cache root directory (created with mode 0700 if missing)."""
    env = os.environ.get("OCACHE_CACHE_DIR")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ocache"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def state_root() -> Path:
    """Root of ocache's private *state* (store records, folder journal, spill resume marker):
    ``$OCACHE_STATE_DIR`` if set, else ``cache_root()``. Kept apart from the build caches so a test
    or a second instance can isolate its state without rebuilding llama-server or the models."""
    env = os.environ.get("OCACHE_STATE_DIR")
    root = Path(env).expanduser() if env else cache_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def repo_root() -> Path:
    """The source checkout this package was imported from (holds ``patches/``); for an installed
    package (``pip install``, not editable) the ``site-packages`` folder: see :func:`checkout`."""
    return Path(__file__).resolve().parent.parent


def checkout() -> Path | None:
    """The source checkout this package runs from (``pyproject.toml`` beside the ``ocache``
    package), None for an installed package (a wheel: ``site-packages`` holds no ``pyproject.toml``)."""
    root = repo_root()
    return root if (root / "pyproject.toml").is_file() else None


#: What a wheel carries of the checkout's top-level folders (``ocache/data/<name>`` is a link to
#: ``../../<name>`` in the checkout, followed when the wheel is built; pyproject.toml package-data).
PACKAGED = Path(__file__).resolve().parent / "data"


def shipped(name: str) -> Path:
    """The checkout's top-level folder ``name`` (``patches``, ``scenarios``), else the installed
    package's copy under ``ocache/data/`` (without it, an installed ``ocache bench`` looked for its
    scenarios beside ``site-packages``). The returned folder may not exist (neither has it)."""
    root = checkout()
    if root is not None and (root / name).is_dir():
        return root / name
    return PACKAGED / name


@contextlib.contextmanager
def file_lock(path: Path, waiting: Callable[[float], None] | None = None,
              every_s: float = 30.0) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing): serializes builds,
    model generation and client installs across processes (tests, CI, a second shell).

    ``waiting(seconds_waited)``: called at once when another process holds the lock, then every
    ``every_s`` seconds until it is ours (so a user sees why nothing happens); never when the lock
    is free."""
    with open(path, "w") as fh:
        if waiting is None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        else:
            t0 = time.monotonic()
            next_note = 0.0
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = time.monotonic() - t0
                    if waited >= next_note:
                        waiting(waited)
                        next_note = waited + every_s
                    time.sleep(0.5)  # polling another process's lock; no event to wait on
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
