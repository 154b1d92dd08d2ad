"""Runs a tool as `python tests/support/no_backend.py TOOL ARGS...` would run `python TOOL ARGS...`, and
fails it (exit code 3, one line on stderr) the moment its own process starts a JAX backend. On a
TPU only one process may hold the chip, so a tool whose runs are processes of their own must never
take it itself. The processes it starts are not watched."""

import os
import runpy
import sys

from jax._src import xla_bridge


def refuse(*unused, **unused_keywords):
    print(f"error: {sys.argv[0]} started a JAX backend in its own process", file=sys.stderr, flush=True)
    os._exit(3)


xla_bridge.backends = refuse  # every path to a device goes through it
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
