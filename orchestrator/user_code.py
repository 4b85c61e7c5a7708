"""The user's own code a run names by import path (`model.class`, `data.factory`): resolved in the directory
nestor runs in, then in the installed packages."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.errors import ConfigError


def user_code_root() -> Path:
    """Returns the directory import paths are resolved in: the one nestor runs in, or where a launcher's
    worker was told it is (cluster.connect.USER_CODE_ENV)."""
    return Path(os.environ.get(USER_CODE_ENV) or os.getcwd()).resolve()


def import_object(path: str, key: str, example: str) -> Any:
    """Returns the object `module:name` names, importing `module` from `user_code_root()` (first) or the
    installed packages. Raises ConfigError naming `key` when it does not resolve (`example`: a path of the
    kind the key takes, for the message)."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ConfigError([(key, f"{path!r} is not an import path module:name (e.g. {example})")])
    root = str(user_code_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigError([(key, f"cannot import {module_name!r} ({error}); it is looked up in {root} (the "
                                 "directory nestor runs in) and the installed packages")]) from None
    except Exception as error:  # the user's module raised while importing: say what
        raise ConfigError([(key, f"importing {module_name!r} raised {type(error).__name__}: {error}")]) from None
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ConfigError([(key, f"{module_name!r} ({module.__file__}) has no {name!r}; it defines "
                                 f"{', '.join(public) or 'nothing public'}")])
    return getattr(module, name)


def code_paths(import_paths: list[str]) -> tuple[str, ...]:
    """Returns the files and package directories under `user_code_root()` that the import paths' top-level
    modules come from (none for installed packages): what a remote cluster or a submitted job must receive."""
    root = user_code_root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    found: list[str] = []
    for path in import_paths:
        top = path.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top) if top and top != "nestor" else None  # nestor travels anyway
        if spec is None:
            continue
        if spec.origin is None:  # a namespace package: its directory
            locations = list(spec.submodule_search_locations or [])
            if not locations:
                continue
            shipped = Path(locations[0]).resolve()
        else:
            source = Path(spec.origin).resolve()
            shipped = source.parent if spec.submodule_search_locations else source
        if shipped.is_relative_to(root) and str(shipped) not in found:
            found.append(str(shipped))
    return tuple(found)
