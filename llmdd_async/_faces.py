"""One signature per API method: the other faces are made from its definition.

The async :class:`._cache_manager.CacheManager` and :class:`._kv_cache_manager.KvCacheManager`
define each method once (names, defaults, annotations, docstring). A *face* of it (the
blocking facade's method, a legacy delegate with a role check) is built by :func:`face_of`:
a thin function whose ``inspect.signature`` is the definition's, so the parameters cannot
drift apart; ``tests/compat/test_api_faces.py`` checks every face against upstream's names and
defaults and against each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["face_of"]

#: ``returns`` default of :func:`face_of`: keep the definition's return annotation
_KEEP: Any = object()


def face_of(
    definition: Callable[..., Any],
    call: Callable[..., Any],
    *,
    returns: Any = _KEEP,
    doc: str | None = None,
) -> Callable[..., Any]:
    """A method with ``definition``'s name and signature whose body is
    ``call(self, name, *args, **kwargs)``.

    ``returns`` replaces the return annotation (a blocking face returns what the awaited task
    gives); ``doc`` is put before the definition's docstring.

    Raises:
        nothing itself; the face raises what ``call`` raises. Arguments reach ``call`` as
        given, so a wrong call fails where the definition would (TypeError for an unknown
        keyword, by the definition's own checks).
    """
    name = definition.__name__
    signature = inspect.signature(definition)
    if returns is not _KEEP:
        signature = signature.replace(return_annotation=returns)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return call(self, name, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = name
    method.__doc__ = "\n\n".join(d for d in (doc, inspect.getdoc(definition)) if d)
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__wrapped__ = definition  # type: ignore[attr-defined]
    return method
