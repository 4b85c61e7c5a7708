"""The user's own code a run names by import path (`model.class`, `data.factory`): resolved in the directory
nestor runs in, then in the installed packages."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.errors import ConfigError

# nestor's rooms beside its own package: frames in them are nestor's, wherever nestor is installed or checked out
ROOMS = ("orchestrator", "models", "parallel", "cluster", "backend")


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
        defined = _defined_names(module, name)
        raise ConfigError([(key, f"{module_name!r} ({module.__file__}) has no {name!r}; it defines "
                                 f"{', '.join(defined) or 'no class or function'}")])
    return getattr(module, name)


def _defined_names(module: ModuleType, wanted: str) -> list[str]:
    """Returns the classes and functions `module` defines itself (not those it imports), the closest to
    `wanted` first, then the rest in order of name."""
    own = sorted(name for name, value in vars(module).items() if not name.startswith("_")
                 and (inspect.isclass(value) or inspect.isfunction(value))
                 and getattr(value, "__module__", None) == module.__name__)
    closest = difflib.get_close_matches(wanted, own, n=1, cutoff=0.0)
    return closest + [name for name in own if name not in closest]


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


@functools.cache
def _not_users_dirs() -> tuple[Path, ...]:
    """Returns the directories whose code is never the user's: each of nestor's rooms where it is imported from
    (an editable install maps `nestor.orchestrator` to the checkout's `orchestrator/`, not `nestor/orchestrator`),
    and Python's own library and the installed packages (cwd may hold them: `$HOME` with a pyenv Python), not
    all of sys.prefix, where a project may live (/usr/local/app under Python's Docker images)."""
    import sysconfig

    import nestor

    # nestor's own __path__ holds the checkout's root too (nestor/__init__.py), where a user's model may live
    rooms = [Path(nestor.__file__).parent] + [Path(place) for room in ROOMS
                                              for place in importlib.util.find_spec(f"nestor.{room}")
                                              .submodule_search_locations or ()]
    python = [Path(sysconfig.get_paths()[name]) for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    return tuple(dict.fromkeys(path.resolve() for path in [*rooms, *python]))


def _is_users(filename: str) -> bool:
    """Returns whether a frame's file is the user's: under `user_code_root()`, not nestor's, Python's or a
    package's."""
    path = Path(filename).resolve()
    return (path.is_relative_to(user_code_root()) and "site-packages" not in path.parts
            and not any(path.is_relative_to(place) for place in _not_users_dirs()))


def user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """Returns the frames of `error`'s traceback that run the user's own code (`_is_users`), outermost first."""
    return [frame for frame in traceback.extract_tb(error.__traceback__) if _is_users(frame.filename)]


def _traceback_text(error: BaseException) -> str:
    """Returns Python's traceback of `error` with the user's frames only, ending in the exception's line."""
    shown = user_frames(error)
    head = "Traceback (your code's frames; nestor's left out):\n" + "".join(traceback.format_list(shown)) if shown else ""
    said = str(error)  # without the notes libraries add (JAX's on the frames it filtered)
    return f"{head}{type(error).__name__}{': ' + said if said else ''}\n"


class UserCodeError(ConfigError):
    """The user's own code (`model.class`, `data.factory`) raised `error` while nestor ran `what`: a
    ConfigError naming `key`, whose `frames` (Python's traceback of the user's frames only, nestor's and the
    libraries' left out) the CLI shows above it."""

    def __init__(self, key: str, what: str, error: BaseException | None = None, frames: str | None = None,
                 problems: list[tuple[str, str]] | None = None):
        self.frames = frames if frames is not None else _traceback_text(error) if error is not None else ""
        super().__init__(problems or [(key, f"{what} raised {type(error).__name__}: {str(error)[:300]}")])

    def __reduce__(self):
        return UserCodeError, ("", "", None, self.frames, self.problems)
