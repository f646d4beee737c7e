"""Graph recorders for segmented capture, by name: what a "graph" is on each device.

  cuda_graph  torch.cuda.CUDAGraph per segment, every segment of every bucket of every backend
              captured into one shared memory pool on one side stream (Breakable CUDA Graph).
              CUDA only.  The only place graphexec touches torch.cuda.CUDAGraph.
  tape        capture/op_tape.py: the aten ops a segment issues, replayed on the same tensors.
              Device-independent and slow; it exists so the segment machinery the CUDA path
              uses (boundary buffers, fixed addresses, breaks between graphs) runs and is tested
              where there is no GPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from capture.errors import CaptureConfigError
from capture.segments import GraphRecorder, Replayable

RECORDERS = ("cuda_graph", "tape")


class _CudaGraph(Replayable):
    def __init__(self, graph: "torch.cuda.CUDAGraph"):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRecorder(GraphRecorder):
    name = "cuda_graph"

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._stream: torch.cuda.Stream | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        # Capture must not run on the default stream; warm-up work queued there must be done.
        torch.cuda.synchronize(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> Replayable:
        graph, self._graph = self._graph, None
        if graph is None:
            raise RuntimeError("end() without begin()")
        graph.capture_end()
        return _CudaGraph(graph)


class Recorders:
    """The recorders of one engine, by kind: every backend asking for a kind gets the same one, so
    all CUDA graphs share one memory pool and one capture stream."""

    def __init__(self) -> None:
        self._by_kind: dict[tuple[str, str], GraphRecorder] = {}

    def get(self, name: str, device: torch.device, option: str, traced_ops: tuple[str, ...] = ()) -> GraphRecorder:
        key = (name, str(device))
        if key not in self._by_kind:
            self._by_kind[key] = create_recorder(name, device, option, traced_ops)
        return self._by_kind[key]


def create_recorder(name: str, device: torch.device, option: str, traced_ops: tuple[str, ...] = ()) -> GraphRecorder:
    """`traced_ops`: custom ops the tape records by the aten ops they issue (capture/op_tape.py);
    a CUDA graph does that by nature."""
    if name == "cuda_graph":
        if device.type != "cuda":
            raise CaptureConfigError(f"{option}=cuda_graph needs device=cuda; this engine runs on {device.type}")
        return CudaGraphRecorder(device)
    if name == "tape":
        from capture.op_tape import TapeRecorder

        return TapeRecorder(traced_ops)
    raise CaptureConfigError(f"{option}={name!r} is not a graph recorder; choose one of {list(RECORDERS)}")
