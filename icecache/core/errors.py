"""User-facing errors: one line that says what to change, raised before any expensive work."""


class ConfigError(ValueError):
    """A configuration or input the user must change; the CLI prints its message alone and exits with code 2."""


def dataclass_from_dict(cls, values: dict, kind: str):
    """``cls(**values)`` for a settings dataclass, refusing unknown keys with one line that lists the known ones."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"{kind} {values.get('name', cls.__name__)!r} has no setting {', '.join(unknown)}; "
            f"its settings are: {', '.join(sorted(known))}"
        )
    return cls(**values)
