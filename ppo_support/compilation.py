"""JAX's persistent compilation cache: on by default, so that the next run of the same
configuration (a --resume too) loads its compiled programs instead of compiling them again; and
how a session tells whether a program came from it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

CACHE_HITS = threading.local()  # per thread: the programs JAX loaded from its compilation cache


def count_cache_hits(event: str, **unused: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        CACHE_HITS.count = getattr(CACHE_HITS, "count", 0) + 1


jax.monitoring.register_event_listener(count_cache_hits)


def cache_hits_in_this_thread() -> int:
    return getattr(CACHE_HITS, "count", 0)


DEFAULT_FOLDER = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ppo-jax" / "xla"
MAX_BYTES = 4 * 2**30  # least recently used programs go first beyond this
MIN_COMPILE_SECONDS = 0.2  # programs that compile faster are not worth a file


def use_cache(folder: str | None) -> None:
    """JAX's persistent compilation cache, so that the next run of the same configuration loads
    its programs instead of compiling them: in `folder` (--compilation-cache-dir), else in
    $JAX_COMPILATION_CACHE_DIR when set, else DEFAULT_FOLDER; "off" turns it off. Before
    anything compiles."""
    if folder == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides once per process whether it uses its cache: again, now
        return
    jax.config.update("jax_enable_compilation_cache", True)
    if folder is None and os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # the user's, with JAX's settings or theirs
        folder = os.environ["JAX_COMPILATION_CACHE_DIR"]
    else:
        folder = folder or str(DEFAULT_FOLDER)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()  # JAX opens its cache folder once per process: again, at this one
