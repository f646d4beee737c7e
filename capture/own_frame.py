"""Top frames of our own for Dynamo to compile, in place of the model's forward or layer call.

Every backend that hands Dynamo a forward (full_graph's whole forward and regional layer call,
breakable's segmented forward, tc_piecewise's traced forward) hands it one of these, for two
reasons, both about state Dynamo keeps on a function's code object:

- Skip marks.  A code object Dynamo could not trace in one go is marked skipped for every later
  compile in the process, whatever the backend: breakable's graph breaks do that to the frames
  they break in.  From a skipped top frame Dynamo would hand over each layer's frames separately,
  so full_graph would compile layer by layer instead of whole and tc_piecewise would get no single
  graph to split.  Inlined under a frame of our own, the model's forward is traced whatever its
  mark.
- Compiled-code caches.  Dynamo caches compiled graphs, and counts recompiles, per code object.
  Closures made by one `def` share it, so without a copy of their own every backend in the process
  would share one cache; with module guards skipped (`skip_module_guards`) one engine's graph could
  then run another engine's different modules (seen: a dequantized model replaying a quantized
  model's layer graph).
"""

from __future__ import annotations

import types
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def own_code(fn: F) -> F:
    """`fn` over a code object of its own (same globals, defaults and closure)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)  # type: ignore[return-value]


def own_forward(model: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A frame of our own calling `model(input_ids, positions)`: what a backend compiles."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)

    return own_code(forward)
