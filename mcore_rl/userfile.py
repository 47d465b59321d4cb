"""Objects the user names in the config as ``path/to/file.py`` or ``path/to/file.py:name`` (reward functions,
environments, tools), loaded by file path; every problem is an error naming the config key and the file."""

from __future__ import annotations

import importlib.util
from pathlib import Path


class UserCodeError(RuntimeError):
    """The user's reward function, environment or tool cannot be loaded or misbehaved (the message names the key,
    the file and, where there is one, the sample): bad input, not a bug of the system."""


def is_user_file(spec: str) -> bool:
    """Whether ``spec`` names an existing Python file (``path/to/file.py`` or ``path/to/file.py:name``)."""
    path = Path(spec.partition(":")[0])
    return path.suffix == ".py" and path.is_file()


def absolute_spec(spec: str) -> str:
    """``spec`` with its file's absolute path: what a process with another working directory loads."""
    path, colon, name = spec.partition(":")
    return f"{Path(path).resolve()}{colon}{name}"


def load_attribute(key: str, spec: str, default_name: str, missing: str, error: type[Exception] = UserCodeError):
    """The attribute ``name`` (default ``default_name``) of the Python file ``spec`` names; problems are ``error``s
    naming ``key``, the file and the cause (``missing``: what to define, a format string of ``name``)."""
    path_text, _, name = spec.partition(":")
    path, name = Path(path_text), name or default_name
    if not is_user_file(spec):
        raise error(f"{key}={spec!r}: file {path} not found (expected a .py file)")
    module_spec = importlib.util.spec_from_file_location(f"mcore_rl_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - whatever the user's file raises on import is reported, by file
        raise error(f"{key}={spec!r}: importing {path} raised {type(err).__name__}: {err}") from None
    if not hasattr(module, name):
        raise error(f"{key}={spec!r}: {path} has no {name!r}; define {missing.format(name=name)}")
    return getattr(module, name)
