"""Model factories and forward functions that a file may name: registered, never resolved.

Captures and update files come from clients, so what they hold is untrusted input. The model
they name is looked up in these two registries, never imported or resolved as an arbitrary
'module:function', and its keyword arguments are checked against the function's signature
before it is called. A plugin registers its own (a module loaded by `--plugin MODULE` or a
`gradleak.plugins` entry point):

    from gradleak import register_model_factory

    @register_model_factory("my-policy")
    def build(actions: int = 4) -> nn.Module:
        return MyPolicy(actions)

A name a file holds is looked up first as a registered name, then as the 'module:function' of a
registered function (files written before the registry named their factory that way).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gradleak.errors import ConfigError
from gradleak.plugins import load_plugins
from gradleak.registry import Registry

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Named:
    """A registered function and the name files know it by."""

    name: str
    function: Callable[..., Any]
    kind: str

    @property
    def reference(self) -> str:
        return f"{self.function.__module__}:{self.function.__qualname__}"

    def arguments(self, kwargs: Any, field: str) -> dict[str, Any]:
        """`kwargs` as the function declares them: known names, every required one, and values
        of the annotated plain types (int, float, bool, str, list, dict, None)."""
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigError(f"{field}: expected an object of keyword arguments, found "
                              f"{type(kwargs).__name__}")
        signature = inspect.signature(self.function)
        try:
            signature.bind(**kwargs)
        except TypeError as error:
            raise ConfigError(f"{field}: {self.kind} {self.name!r} takes ({_declared(signature)})"
                              f": {error}") from None
        hints = _hints(self.function)
        for key, value in kwargs.items():
            if key in hints and not _matches(value, hints[key]):
                raise ConfigError(f"{field}[{key!r}] = {value!r:.60}: {self.kind} {self.name!r} "
                                  f"declares {_type_name(hints[key])}")
        return dict(kwargs)


MODEL_FACTORIES: Registry[Named] = Registry("model factory")
FORWARDS: Registry[Named] = Registry("forward function")


def _register(registry: Registry[Named], name: str) -> Callable[[F], F]:
    def decorate(function: F) -> F:
        if not callable(function):
            raise ConfigError(f"{registry.kind} {name!r}: {function!r} is not callable")
        entry = Named(name, function, registry.kind)
        if name in registry and registry.get(name).reference == entry.reference:
            registry.drop(name)  # the same function, its module imported again (a reload)
        registry.register(name)(entry)
        return function

    return decorate


def register_model_factory(name: str) -> Callable[[F], F]:
    """Registers a function that builds an `nn.Module` from JSON keyword arguments."""
    return _register(MODEL_FACTORIES, name)


def register_forward(name: str) -> Callable[[F], F]:
    """Registers `forward(model, observation) -> (logits, value)` for wrapped models."""
    return _register(FORWARDS, name)


def find(registry: Registry[Named], reference: Any, field: str) -> Named:
    """The registered entry a file names, or a ConfigError naming the field; nothing is called
    or imported but the installed plugins' entry points."""
    if not isinstance(reference, str) or not reference:
        raise ConfigError(f"{field} = {reference!r}: expected the name of a registered "
                          f"{registry.kind}")
    found = _lookup(registry, reference)
    if found is None:
        load_plugins()  # the installed entry points, gradleak's own integrations among them
        found = _lookup(registry, reference)
    if found is None:
        known = ", ".join(registry.names()) or "none"
        decorator = "register_model_factory" if registry is MODEL_FACTORIES else \
            "register_forward"
        raise ConfigError(f"{field} = {reference[:120]!r} is not a registered {registry.kind} "
                          f"(registered here: {known}); a file may name only one registered "
                          f"with @gradleak.{decorator}(NAME) in a module loaded by --plugin "
                          "MODULE or an entry point")
    return found


def name_of(registry: Registry[Named], function: Callable[..., Any]) -> str | None:
    """The name `function` is registered under, if it is."""
    return next((name for name in registry.names() if registry.get(name).function is function),
                None)


def _lookup(registry: Registry[Named], reference: str) -> Named | None:
    if reference in registry:
        return registry.get(reference)
    return next((registry.get(name) for name in registry.names()
                 if registry.get(name).reference == reference), None)


def _declared(signature: inspect.Signature) -> str:
    return ", ".join(str(p).split(":")[0].split("=")[0].strip()
                     for p in signature.parameters.values()) or "no arguments"


def _hints(function: Callable[..., Any]) -> dict[str, Any]:
    target = function.__init__ if isinstance(function, type) else function
    try:
        return typing.get_type_hints(target)
    except (NameError, TypeError):  # an annotation that names what this module cannot see
        return {}


def _matches(value: Any, hint: Any) -> bool:
    """Does a JSON value fit a plain annotation? Annotations of other types are the function's
    own to check."""
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    base = origin or hint
    if base in (list, tuple, Sequence):
        return isinstance(value, (list, tuple))
    if base in (dict, Mapping):
        return isinstance(value, Mapping)
    return True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
