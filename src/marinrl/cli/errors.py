"""What the console script tells a user who gave it something wrong: one line, exit status 2."""

from __future__ import annotations

from typing import Sequence

EXIT_CODES = ("Exit status: 0 done; 2 an input error (a config field, a path, a flag: one line naming it, "
              "before Ray starts where it can be known; --debug adds the traceback); 1 a run that failed "
              "(its last line says why and what to do).")


class InputError(Exception):
    """A config, path or flag the user can fix: reported as one line, exit status 2."""


class InputExit(SystemExit):
    """What `main` raises for an InputError once it is printed: exit status 2, the message as its text."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def config_input_error(config: str, overrides: Sequence[str], e: Exception) -> InputError:
    """A config mistake as the one line `marinrl train` prints: a ConfigError located in the file or flags."""
    from marinrl.config.errors import ConfigError, ConfigInputError, compose_yaml, locate

    if isinstance(e, ConfigError):
        return InputError(f"{locate(config, compose_yaml(config), overrides, e.field)}: {e}")
    if isinstance(e, ConfigInputError):
        return InputError(str(e))
    return InputError(f"{config}: {e}")  # a config class's own check, raised outside draccus
