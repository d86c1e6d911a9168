"""The error every config problem becomes (its own module: reading and resolving both raise it)."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names every offending key path."""
