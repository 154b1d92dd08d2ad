"""The two errors that `cli.main` turns into exit codes, and how their messages name a flag."""


class ConfigError(ValueError):
    """Bad user input. `cli.main` prints it as one line and exits with code 2; nothing was written."""


class WriteError(RuntimeError):
    """A checkpoint or metrics.jsonl could not be written (disk full, no permission). Raised in a
    host callback, it stops the compiled run; `cli.main` prints it as one line and exits with code 1."""


def flag(field_name: str) -> str:
    """The command-line flag of an Args field: num_seeds -> --num-seeds."""
    return "--" + field_name.replace("_", "-")
