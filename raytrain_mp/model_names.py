"""The names ``--model`` accepts from torchvision, known without importing torch or torchvision.

Job: an unknown ``--model`` name is an argument error, and an argument error is to be said at once;
importing torchvision (and torch with it) takes seconds. torchvision registers each classifier with
a ``@register_model()`` decorator on a function of a module directly in ``torchvision/models/``
(``torchvision.models.list_models(module=torchvision.models)`` is the set of those), so the names
are read from those modules' source with ``ast``, a fraction of a second.

Invariants:
- ``torchvision_names()`` equals ``list_models(module=torchvision.models)`` (sorted);
  ``tests/test_models.py`` checks it against the installed torchvision. Should a torchvision lay
  its models out otherwise (no name found), the list comes from torchvision itself, slow but right.
- ``unknown_model`` is the one wording of an unknown name, with the closest names as a hint.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path

from raytrain_mp.errors import UsageError


@functools.cache
def torchvision_names() -> tuple[str, ...]:
    """The torchvision classifiers' names, sorted (see the module doc)."""
    spec = importlib.util.find_spec("torchvision")  # finds the package without importing it
    names = set()
    for file in sorted(Path(spec.origin).parent.joinpath("models").glob("*.py")) if spec and spec.origin else []:
        source = file.read_text()
        if "register_model" in source:
            names |= set(_registered(ast.parse(source)))
    if not names:
        from torchvision import models

        return tuple(models.list_models(module=models))
    return tuple(sorted(names))


def _registered(tree: ast.Module):
    """The names a module's ``@register_model()`` / ``@register_model(name="...")`` give its functions."""
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "register_model":
                given = [a.value for a in decorator.args]
                given += [k.value.value for k in decorator.keywords if k.arg == "name"]
                yield given[0] if given else node.name


def unknown_model(name: str) -> UsageError:
    """The error for a torchvision name that is not one, naming the closest ones."""
    close = difflib.get_close_matches(name, torchvision_names(), n=3, cutoff=0.6)
    hint = f"; closest: {', '.join(close)}" if close else ""
    return UsageError(
        f"--model: unknown model {name!r}{hint}; accepted: a torchvision.models classifier "
        f"(torchvision.models.list_models()) or package.module:callable"
    )


def check_torchvision_name(name: str) -> None:
    """Raise ``unknown_model`` unless ``name`` is one of torchvision's classifiers."""
    if name not in torchvision_names():
        raise unknown_model(name)
