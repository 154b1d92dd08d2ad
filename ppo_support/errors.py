"""The errors that `cli.main` turns into exit codes, and how their messages name a flag."""


class ConfigError(ValueError):
    """Bad user input. `cli.main` prints it as one line and exits with code 2; nothing was written."""


class WriteError(RuntimeError):
    """A checkpoint or metrics.jsonl could not be written (disk full, no permission). Raised on the
    host thread that writes them, it stops the run at its next segment; `cli.main` prints it as one
    line and exits with code 1."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped training, and the run was saved for --resume. `cli.main` prints it as
    one line and exits with exit_code (128 + the signal's number: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def flag(field_name: str) -> str:
    """The command-line flag of an Args field: num_seeds -> --num-seeds."""
    return "--" + field_name.replace("_", "-")
