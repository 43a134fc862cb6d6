"""Error types that are part of jaxspeed's interface.

The CLI prints these as one readable message and exits non-zero; anything else is a bug and
keeps its traceback.
"""


class JaxspeedError(Exception):
    """Base class for errors caused by user input (config, flags, data paths)."""


class ConfigError(JaxspeedError, ValueError):
    """A config value is missing, malformed or inconsistent. The message names the key path."""
