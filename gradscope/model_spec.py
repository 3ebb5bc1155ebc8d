"""A model of one's own named on the command line: ``--model pkg.module:factory``.

``pkg.module`` is imported (the current directory is on the import path, as for
``python -m``), or, when it names a ``.py`` file (``path/to/models.py:factory``), that file
is loaded as a module; ``factory`` (a dotted path inside the module is allowed:
``Builder.small``) is called with no arguments and must return a ``torch.nn.Module``. Every
failure names the part of the spec that failed: the spec's form, the module, the attribute,
the call or what it returned.

Used by ``gradscope scan --model`` and meant for every command that takes a model.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from torch import nn

FORM = "'package.module:factory' or 'path/to/file.py:factory'"


class ModelSpecError(ValueError):
    """A ``--model`` spec that does not give a model; the message names the part that failed."""


def _import(module: str, spec: str):
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise ModelSpecError(f"--model {spec!r}: no such file {module!r}")
        file_spec = importlib.util.spec_from_file_location(path.stem, path)
        loaded = importlib.util.module_from_spec(file_spec)
        try:
            file_spec.loader.exec_module(loaded)
        except Exception as err:
            raise ModelSpecError(f"--model {spec!r}: running file {module!r} raised {type(err).__name__}: {err}") from err
        return loaded
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # (as python -m does: a module beside the user's shell imports)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        missing = err.name or module
        if module == missing or module.startswith(missing + "."):
            raise ModelSpecError(f"--model {spec!r}: cannot import module {module!r}: no module named {missing!r} "
                                 f"(searched the current directory {cwd} and sys.path)") from err
        raise ModelSpecError(f"--model {spec!r}: module {module!r} was found but importing it failed: "
                             f"no module named {missing!r}") from err
    except Exception as err:
        raise ModelSpecError(f"--model {spec!r}: importing module {module!r} raised {type(err).__name__}: {err}") from err


def load_model(spec: str) -> nn.Module:
    """The model ``spec`` names: imports its module and calls its factory with no arguments.

    Args:
        spec: ``"package.module:factory"`` or ``"path/to/file.py:factory"``.

    Returns:
        The ``nn.Module`` the factory returned.

    Raises:
        ModelSpecError: (a ValueError) naming the part that failed: the spec's form, the
            module (not found, or its import raised), the factory (no such attribute, not
            callable, its call raised) or its result (no ``nn.Module``).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ModelSpecError(f"--model {spec!r}: expected {FORM} (a module to import, a colon, and a callable in it "
                             "that takes no arguments and returns a torch.nn.Module)")
    module = _import(module_name, spec)
    target, path = module, []
    for part in attr.split("."):
        path.append(part)
        if not hasattr(target, part):
            public = sorted(n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n, None)))
            raise ModelSpecError(f"--model {spec!r}: {module_name!r} has no attribute {'.'.join(path)!r}; its callables: "
                                 f"{public[:20]}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelSpecError(f"--model {spec!r}: {module_name}:{attr} is a {type(target).__name__}, not a callable")
    try:
        model = target()
    except Exception as err:
        raise ModelSpecError(f"--model {spec!r}: calling {module_name}:{attr}() raised {type(err).__name__}: {err} "
                             "(the factory is called with no arguments)") from err
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"--model {spec!r}: {module_name}:{attr}() returned a {type(model).__name__}, "
                             "not a torch.nn.Module")
    return model
