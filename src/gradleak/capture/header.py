"""The checks a capture file passes on open: its attributes (format, version, victim, layer
table, roles) and its datasets' layout. Each names the file and the field, so a truncated,
foreign or inconsistent file is reported as such rather than as an h5py traceback."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py

from gradleak.capture.layout import FACTORED_ATTR, FACTORS, GradientLayout
from gradleak.capture.schema import (
    FORMAT,
    FACTORED_FORMAT_VERSION,
    READABLE_VERSIONS,
    GRADIENTS,
    REQUIRED_ATTRS,
    layers_from_json,
    step_columns,
)
from gradleak.errors import CaptureFileError, ConfigError
from gradleak.victims.base import VICTIMS, LayerInfo, VictimConfig, create_victim
from gradleak.victims.roles import Roles


@dataclass(frozen=True)
class Header:
    """What a capture declares about itself, checked."""

    victim: VictimConfig
    layers: list[LayerInfo]
    roles: Roles
    hidden_size: int  # a recurrent victim's pre-step states are a column too (0: none)


def read_header(h5: h5py.File, path: Path) -> Header:
    attrs = h5.attrs
    if attrs.get("format") != FORMAT:
        raise CaptureFileError(f"{path} is not a gradleak capture: attribute 'format' is "
                               f"{attrs.get('format')!r}, expected {FORMAT!r}")
    version = int_attr(h5, path, "format_version")
    if version not in READABLE_VERSIONS:
        raise CaptureFileError(f"{path}: format_version {attrs.get('format_version')}, this "
                               "gradleak reads versions "
                               f"{', '.join(map(str, READABLE_VERSIONS))}")
    if FACTORED_ATTR in attrs and version < FACTORED_FORMAT_VERSION:
        raise CaptureFileError(f"{path}: attribute '{FACTORED_ATTR}' needs format_version "
                               f"{FACTORED_FORMAT_VERSION}, the file says {version}")
    missing = [key for key in REQUIRED_ATTRS if key not in attrs]
    if missing:
        raise CaptureFileError(f"{path}: missing attribute(s) {', '.join(missing)}")
    if not bool(attrs["complete"]):
        raise CaptureFileError(f"{path}: attribute 'complete' is false (the capture did not "
                               "finish)")
    hidden_size = int_attr(h5, path, "hidden_size") if "hidden_size" in attrs else 0
    for name in ("num_rows", "num_episodes", "gradient_dim", "hidden_size"):
        if name in attrs and int_attr(h5, path, name) < 0:
            raise CaptureFileError(f"{path}: attribute '{name}' is negative")
    victim = VictimConfig.from_dict(json_attr(h5, path, "victim_config", dict),
                                    f"{path} attribute 'victim_config'")
    try:
        layers = layers_from_json(attrs["layer_table"])
    except (ValueError, TypeError, KeyError) as err:
        raise CaptureFileError(f"{path}: attribute 'layer_table' is not a list of "
                               f"{{name, shape, offset, component}} objects ({err})") from None
    for name in ("scenes", "components"):
        values = json_attr(h5, path, name, list)
        if not all(isinstance(v, str) for v in values):
            raise CaptureFileError(f"{path}: attribute '{name}' is not a list of names")
    json_attr(h5, path, "loss", dict)
    return Header(victim, layers, read_roles(h5, path, victim, layers), hidden_size)


def read_roles(h5: h5py.File, path: Path, victim: VictimConfig, layers: list[LayerInfo]
               ) -> Roles:
    """The attribute `roles`, checked against the layer table; a capture written before roles
    were stored gets its registered victim's."""
    source = f"{path} attribute 'roles'"
    try:
        if "roles" in h5.attrs:
            roles = Roles.from_json(h5.attrs["roles"], source)
        elif victim.name in VICTIMS:
            roles = create_victim(victim).roles()
        else:
            raise CaptureFileError(f"{path}: attribute 'roles' is missing, and victim "
                                   f"{victim.name!r} is not registered here to derive it")
        roles.check_layers({layer.name: layer.shape for layer in layers}, victim.num_actions,
                           source)
    except ConfigError as error:
        raise CaptureFileError(str(error)) from None
    return roles


def int_attr(h5: h5py.File, path: Path, name: str) -> int:
    value = h5.attrs.get(name, -1)
    try:
        if isinstance(value, (bytes, str)):
            raise ValueError(value)
        return int(value)
    except (TypeError, ValueError):
        raise CaptureFileError(f"{path}: attribute '{name}' is {value!r}, expected an "
                               "integer") from None


def json_attr(h5: h5py.File, path: Path, name: str, kind: type) -> Any:
    try:
        value = json.loads(h5.attrs.get(name))
    except (TypeError, ValueError):
        raise CaptureFileError(f"{path}: attribute '{name}' is not valid JSON") from None
    if not isinstance(value, kind):
        raise CaptureFileError(f"{path}: attribute '{name}' holds a {type(value).__name__}, "
                               f"expected a JSON {'object' if kind is dict else 'list'}")
    return value


def _checked_layout(h5: h5py.File, path: Path, header: Header) -> GradientLayout:
    factored = json_attr(h5, path, FACTORED_ATTR, list) if FACTORED_ATTR in h5.attrs else []
    shapes = {layer.name: layer.shape for layer in header.layers}
    wrong = [name for name in factored if len(shapes.get(name, ())) != 2]
    if wrong:
        raise CaptureFileError(f"{path}: attribute '{FACTORED_ATTR}' names {wrong[0]!r}, which "
                               "is not a 2-D weight of the layer_table")
    return GradientLayout(tuple(header.layers), frozenset(factored))


def check_layout(h5: h5py.File, path: Path, header: Header) -> None:
    """The gradient matrix matches the layer table, and every step column has num_rows rows of
    its declared shape."""
    rows, offset = int(h5.attrs["num_rows"]), 0
    for layer in header.layers:
        if layer.offset != offset:
            raise CaptureFileError(f"{path}: layer_table entry {layer.name} starts at "
                                   f"{layer.offset}, expected {offset}")
        offset += layer.size
    if GRADIENTS not in h5:
        raise CaptureFileError(f"{path}: dataset '{GRADIENTS}' is missing")
    if h5[GRADIENTS].ndim != 2:
        raise CaptureFileError(f"{path}: dataset 'gradients' has shape {h5[GRADIENTS].shape}, "
                               "expected (N, d)")
    layout = _checked_layout(h5, path, header)
    width = h5[GRADIENTS].shape[1]
    if width != layout.stored_width or offset != int(h5.attrs["gradient_dim"]):
        factored = f" ({len(layout.factored)} weight(s) factored)" if layout.factored else ""
        raise CaptureFileError(f"{path}: dataset 'gradients' has {width} columns but the "
                               f"layer_table describes {layout.stored_width}{factored} "
                               f"(gradient_dim {int(h5.attrs['gradient_dim'])})")
    wanted = (rows, layout.factor_width) if layout.factored else None
    found = h5[FACTORS].shape if FACTORS in h5 else None
    if found != wanted:
        raise CaptureFileError(f"{path}: dataset '{FACTORS}' is {found or 'missing'}, expected "
                               f"{wanted or 'none'}: the output gradients and inputs of the "
                               f"weights in attribute '{FACTORED_ATTR}' "
                               f"({', '.join(sorted(layout.factored)) or 'none'})")
    columns = step_columns(header.roles.transform.frame_shape, header.victim.num_actions,
                           header.hidden_size)
    for column in columns + (None,):
        name = GRADIENTS if column is None else column.name
        if name not in h5:
            raise CaptureFileError(f"{path}: dataset '{name}' is missing")
        data = h5[name]
        if data.shape[0] != rows:
            raise CaptureFileError(f"{path}: dataset '{name}' has {data.shape[0]} rows, "
                                   f"attribute num_rows says {rows} (truncated file?)")
        if column is not None and tuple(data.shape[1:]) != column.shape:
            raise CaptureFileError(f"{path}: dataset '{name}' has shape {data.shape}, "
                                   f"expected (N, *{column.shape})")
