"""User-facing errors: one line that says what to change, raised before any expensive work."""


class ConfigError(ValueError):
    """A configuration or input the user must change; the CLI prints its message alone and exits with code 2."""
