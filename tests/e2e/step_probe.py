"""Records the EC connector metadata vLLM's scheduler ships to the workers each step (named by
a spec's ``"patch"``; runs in the engine process before the engine starts, which must hold
the scheduler: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``run_engine`` sets).

One JSON line per step that loads something, to ``spec["step_log"]``: the metadata's pickled
size (vLLM's multiprocess executor pickles the whole scheduler output to every rank), how
many tensors that pickle carries, and what its loads name.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import torch


class _TensorSpotter(pickle.Pickler):
    """A pickler that counts the tensors in what it pickles (``persistent_id`` sees every
    object on the way; returning None pickles it as usual)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = 0

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensors += 1


def shipped(metadata: Any) -> tuple[int, int]:
    """``(pickled bytes, tensors inside)`` of what vLLM would send for ``metadata``."""
    buffer = io.BytesIO()
    spotter = _TensorSpotter(buffer)
    spotter.dump(metadata)
    return len(buffer.getvalue()), spotter.tensors


def record_step_metadata(spec: dict[str, Any]) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    path = spec["step_log"]
    original = Scheduler.schedule

    def schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        meta = output.ec_connector_metadata
        loads = getattr(meta, "loads", None)
        if loads:
            nbytes, tensors = shipped(meta)
            line = {
                "step": meta.step,
                "metadata_bytes": nbytes,
                "tensors": tensors,
                "loads": [
                    {
                        "mm_hash": load.mm_hash,
                        "path": load.path,
                        "inline": load.tensor is not None,
                        "item_bytes": _numel(load.shape) * getattr(torch, load.dtype).itemsize,
                    }
                    for load in loads
                ],
            }
            with open(path, "a") as log:
                log.write(json.dumps(line) + "\n")
        return output

    Scheduler.schedule = schedule  # type: ignore[method-assign]


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel
