"""Where a capture keeps its gradient rows: one (N, d) matrix, or that matrix with the weight
columns of some Linear layers kept as their two factors.

A Linear layer that sees one input vector per step (an actor-critic's FC layer and heads) has a
per-step weight gradient δ aᵀ: its output gradient (out,) times its input (in,). For the paper
cnn that outer product is 819k of the 936k floats of a step, and writing it (LZ4 on 3.3 MB a
step) was most of the capture's time. A factored capture stores δ and a instead; reading forms
δ[:, None] * a[None, :] in float32, which is the entry autograd and the einsum rule compute (one
rounded product each, no sum), so the rows read are the same bits as the dense capture's
(tested). Layout (docs/data-format.md): attribute `factored_layers` (JSON list of weight names,
in layer-table order), dataset `gradients` with the other layers' columns in layer-table order,
and dataset `gradient_factors` (N, Σ out + in): per factored weight, its output gradient then its
input, side by side (one read a window, however many weights are factored).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import h5py
import numpy as np
import torch

from gradleak.capture.schema import FACTORED_FORMAT_VERSION, FORMAT_VERSION, GRADIENTS
from gradleak.victims.base import LayerInfo, layers_from_json, side_by_side

FACTORED_ATTR = "factored_layers"
FACTORS = "gradient_factors"


@dataclass(frozen=True)
class GradientLayout:
    """The full layer table and which weights are factored; offsets of the stored columns."""

    layers: tuple[LayerInfo, ...]
    factored: frozenset[str] = frozenset()

    @property
    def width(self) -> int:
        """Columns of a full row (the layer table's gradient_dim)."""
        return sum(layer.size for layer in self.layers)

    @property
    def stored_width(self) -> int:
        """Columns of the `gradients` dataset."""
        return sum(layer.size for layer in self.layers if layer.name not in self.factored)

    @property
    def factor_width(self) -> int:
        """Columns of the `gradient_factors` dataset."""
        return sum(sum(layer.shape) for layer in self.layers if layer.name in self.factored)

    def stored_offsets(self) -> dict[str, int]:
        """Each unfactored layer's first column in the `gradients` dataset."""
        return {layer.name: layer.offset for layer in side_by_side(
            [layer for layer in self.layers if layer.name not in self.factored])}

    def factor_columns(self) -> dict[str, tuple[slice, slice]]:
        """Each factored weight's output-gradient and input columns in `gradient_factors`."""
        spans, offset = {}, 0
        for layer in self.layers:
            if layer.name in self.factored:
                out, inputs = layer.shape
                spans[layer.name] = (slice(offset, offset + out),
                                     slice(offset + out, offset + out + inputs))
                offset += out + inputs
        return spans

    def dense_runs(self) -> list[tuple[int, int, int]]:
        """(first column of the full row, first stored column, count) of each run of
        consecutive unfactored layers: the stored columns go into a full row in these blocks."""
        runs: list[tuple[int, int, int]] = []
        stored = 0
        for layer in self.layers:
            if layer.name in self.factored:
                continue
            if runs and runs[-1][0] + runs[-1][2] == layer.offset:
                first, source, count = runs[-1]
                runs[-1] = (first, source, count + layer.size)
            else:
                runs.append((layer.offset, stored, layer.size))
            stored += layer.size
        return runs

    def expand(self, stored: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """(..., width) full rows from (..., stored_width) stored columns and (..., factor_width)
        factors, formed on their device: each factored weight's δ aᵀ in place, the one rounded
        float32 product `read_gradients` forms, so the same bits."""
        if stored.shape[-1] != self.stored_width or factors.shape[-1] != self.factor_width \
                or stored.shape[:-1] != factors.shape[:-1]:
            raise ValueError(f"stored columns {tuple(stored.shape)} and factors "
                             f"{tuple(factors.shape)}: expected (..., {self.stored_width}) and "
                             f"(..., {self.factor_width}) over the same rows")
        out = stored.new_empty((*stored.shape[:-1], self.width), dtype=torch.float32)
        for first, source, count in self.dense_runs():
            out[..., first:first + count] = stored[..., source:source + count]
        spans = self.factor_columns()
        for layer in self.layers:
            if layer.name in self.factored:
                output_grad, inputs = (factors[..., span] for span in spans[layer.name])
                target = out[..., layer.offset:layer.offset + layer.size].unflatten(-1,
                                                                                   layer.shape)
                torch.mul(output_grad[..., :, None], inputs[..., None, :], out=target)
        return out


@lru_cache(maxsize=64)
def _layout(table: str, factored: str) -> GradientLayout:
    return GradientLayout(tuple(layers_from_json(table)), frozenset(json.loads(factored)))


def layout_of(h5: h5py.File) -> GradientLayout:
    """The file's layout (its attributes are checked on open: `capture.header`)."""
    return layout_from_attrs(h5.attrs)


def layout_from_attrs(attrs: Any) -> GradientLayout:
    """The layout a capture's attributes (a mapping, as `CaptureFile.attrs`) describe."""
    return _layout(attrs["layer_table"], attrs.get(FACTORED_ATTR, "[]"))


def mark_layout(attrs: Any, factored: list[str]) -> None:
    """Sets a file's (or its attribute dict's) layout attributes: the factored weights, and
    the format version that says whether there are any (a version-1 reader reads the rest)."""
    if factored:
        attrs[FACTORED_ATTR] = json.dumps(factored)
        attrs["format_version"] = FACTORED_FORMAT_VERSION
    else:
        if FACTORED_ATTR in attrs:
            del attrs[FACTORED_ATTR]
        attrs["format_version"] = FORMAT_VERSION


def read_gradients(h5: h5py.File, rows: Any = slice(None), columns: slice = slice(None),
                   out: np.ndarray | None = None) -> np.ndarray:
    """Rows (a slice, an index, increasing indices) of the full gradient matrix, columns
    `columns` (a slice without step), in the stored dtype, whatever the layout; or written into
    `out` (a C-contiguous array of their shape, any float dtype) and returned. Raises OSError on
    a chunk that does not decode, as h5py does."""
    if FACTORS not in h5:
        if out is not None:
            count, width = h5[GRADIENTS].shape
            picked = (len(range(count)[rows]),) if isinstance(rows, slice) \
                else np.arange(count)[rows].shape
            _check_out(out, (*picked, len(range(width)[columns])))
            h5[GRADIENTS].read_direct(out, np.s_[rows, columns])
            return out
        return h5[GRADIENTS][rows, columns] if columns != slice(None) else h5[GRADIENTS][rows]
    if isinstance(rows, (int, np.integer)):
        row = slice(int(rows), int(rows) + 1)
        return read_gradients(h5, row, columns, None if out is None else out[None])[0]
    layout = layout_of(h5)
    first, last, step = columns.indices(layout.width)
    if step != 1:
        raise ValueError(f"gradient columns {columns}: a slice without step is expected")
    pieces = [(layer, max(first, layer.offset), min(last, layer.offset + layer.size))
              for layer in layout.layers]
    pieces = [(layer, lo, hi) for layer, lo, hi in pieces if lo < hi]
    stored = layout.stored_offsets()
    kept = [(stored[layer.name] + lo - layer.offset, lo, hi) for layer, lo, hi in pieces
            if layer.name not in layout.factored]
    # one read of each dataset: a chunk decodes once, however many layers it holds
    dense = h5[GRADIENTS][rows, kept[0][0]:kept[-1][0] + kept[-1][2] - kept[-1][1]] \
        if kept else None
    factors = h5[FACTORS][rows] if len(kept) < len(pieces) else None
    count = len(np.arange(h5[GRADIENTS].shape[0])[rows]) if dense is None and factors is None \
        else len(dense if dense is not None else factors)
    if out is None:
        out = np.empty((count, max(0, last - first)), h5[GRADIENTS].dtype)
    else:
        _check_out(out, (count, max(0, last - first)))
    for start, lo, hi in kept:
        out[:, lo - first:hi - first] = dense[:, start - kept[0][0]:start - kept[0][0] + hi - lo]
    spans = layout.factor_columns()
    for layer, lo, hi in pieces:
        if layer.name in layout.factored:
            output_grad, inputs = (factors[:, span] for span in spans[layer.name])
            target = out[:, lo - first:hi - first]
            if (lo, hi) == (layer.offset, layer.offset + layer.size):
                # formed in place: a dense window of the paper cnn is 30 MB, and a temporary
                # for its FC weight alone 26 MB more to fill, copy and free
                np.multiply(output_grad[:, :, None], inputs[:, None, :],
                            out=target.reshape(count, output_grad.shape[1], inputs.shape[1]))
            else:
                full = (output_grad[:, :, None] * inputs[:, None, :]).reshape(count, layer.size)
                target[:] = full[:, lo - layer.offset:hi - layer.offset]
    return out


def read_stored(h5: h5py.File, rows: slice, stored: np.ndarray, factors: np.ndarray) -> None:
    """Rows `rows` of a factored capture as stored, into C-contiguous arrays of their shape:
    the unfactored columns and the factors (`GradientLayout.expand` forms the full rows)."""
    count = len(range(h5[GRADIENTS].shape[0])[rows])
    _check_out(stored, (count, h5[GRADIENTS].shape[1]))
    _check_out(factors, (count, h5[FACTORS].shape[1]))
    h5[GRADIENTS].read_direct(stored, np.s_[rows])
    h5[FACTORS].read_direct(factors, np.s_[rows])


def _check_out(out: np.ndarray, shape: tuple[int, ...]) -> None:
    """Before any read: h5py's own refusal of a mismatched buffer is a broadcast TypeError."""
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")


def factor_datasets(h5: h5py.File) -> list[str]:
    """The per-step datasets beside `gradients` that hold gradient rows."""
    return [FACTORS] if FACTORS in h5 else []
