"""A recording stand-in for ``torch.cuda`` on a CPU-only torch: streams, events, devices.

``FakeCuda(monkeypatch)`` replaces the ``torch.cuda`` entry points the cache uses (and the
ones that would create a context) with fakes that append to ``calls``; ``cuda_tensor``
makes a CPU tensor that claims to live on ``cuda:N``, so the CUDA branches of the transfer
code run for real against the fakes. Every operation on such a tensor is logged with the
stream that was current, which is how tests see *where* a copy ran.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

Call = tuple[Any, ...]
_REAL_EMPTY = torch.empty


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str, index: int) -> None:
        self._cuda, self.name, self.index = cuda, name, index

    def wait_stream(self, other: FakeStream) -> None:
        self._cuda.log("wait_stream", self.name, other.name)

    def wait_event(self, event: FakeEvent) -> None:
        self._cuda.log("wait_event", self.name, event.name)

    def synchronize(self) -> None:
        self._cuda.log("stream_synchronize", self.name)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self._cuda, self.name = cuda, name
        self.done = cuda.events_complete
        self.recorded_on: str | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on = stream.name if stream is not None else "current"
        self._cuda.log("record", self.name, self.recorded_on)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self._cuda.log("event_synchronize", self.name)
        self.done = True

    def __repr__(self) -> str:
        return f"<FakeEvent {self.name} done={self.done}>"


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:<fake_index>`` (one subclass per index)."""

    fake_index = 0
    fake: FakeCuda | None = None

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", type(self).fake_index)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        target = args[0] if args else kwargs.get("device")
        if str(target).startswith("cpu"):
            if self.fake is not None:
                self.fake.log("to_cpu_sync", type(self).fake_index)
            return self.as_subclass(torch.Tensor).clone()
        return super().to(*args, **kwargs)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fake = cls.fake
        name = getattr(func, "__name__", str(func))
        if fake is not None and name in fake.watched_ops:
            fake.log("op", name, fake.current_name(cls.fake_index), kwargs.get("non_blocking"))
            failure = fake.failures.get(name)
            if failure is not None:
                raise failure
        return super().__torch_function__(func, types, args, kwargs)


class FakeCuda:
    """Installs the fakes; ``calls`` is the log, ``failures`` maps an op name to an error."""

    watched_ops = frozenset({"copy_", "clone", "contiguous"})

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, events_complete: bool = True) -> None:
        self.calls: list[Call] = []
        self.events_complete = events_complete
        self.events: list[FakeEvent] = []
        self.failures: dict[str, BaseException] = {}
        self.pin_error: BaseException | None = None
        self._ids = itertools.count(1)
        self._current: dict[int, list[FakeStream]] = {}
        self._classes: dict[int, type[FakeCudaTensor]] = {}
        patch = monkeypatch.setattr
        patch(torch.cuda, "is_available", self._recorded("is_available", True))
        patch(torch.cuda, "is_initialized", lambda: False)
        for name in ("init", "_lazy_init", "synchronize", "set_device", "empty_cache"):
            patch(torch.cuda, name, self._recorded(name, None))
        patch(torch.cuda, "current_device", self._recorded("current_device", 0))
        patch(torch.cuda, "Stream", self._new_stream)
        patch(torch.cuda, "Event", self._new_event)
        patch(torch.cuda, "current_stream", self._current_stream)
        patch(torch.cuda, "stream", self._stream_context)
        patch(torch.cuda, "device", self._device_context)
        patch(torch.Tensor, "is_pinned", self._tensor_method("is_pinned", False))
        patch(torch.Tensor, "pin_memory", self._tensor_method("pin_memory", None))
        patch(torch.Tensor, "record_stream", self._record_stream())
        patch(torch, "empty", self._empty)

    # -- the log ---------------------------------------------------------------------------

    def log(self, *call: Any) -> None:
        self.calls.append(tuple(call))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    def current_name(self, index: int) -> str:
        return self._current_stream(index).name

    # -- tensors ---------------------------------------------------------------------------

    def cuda_tensor(self, tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
        """``tensor``'s bytes, claiming to live on ``cuda:index``."""
        return tensor.as_subclass(self._class(index))

    def _class(self, index: int) -> type[FakeCudaTensor]:
        if index not in self._classes:
            attrs = {"fake_index": index, "fake": self}
            self._classes[index] = type(f"FakeCuda{index}Tensor", (FakeCudaTensor,), attrs)
        return self._classes[index]

    def _empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.pop("device", None)
        if kwargs.pop("pin_memory", False):
            self.log("pin_memory_alloc", args)
            if self.pin_error is not None:
                raise self.pin_error
        if device is not None and torch.device(device).type == "cuda":
            index = _index(device)
            self.log("empty_cuda", index, self.current_name(index))
            return self.cuda_tensor(_REAL_EMPTY(*args, **kwargs), index)
        return _REAL_EMPTY(*args, device=device, **kwargs)

    def _record_stream(self) -> Any:
        def record_stream(tensor: torch.Tensor, stream: FakeStream) -> None:
            self.log("record_stream", stream.name)
            failure = self.failures.get("record_stream")
            if failure is not None:
                raise failure

        return record_stream

    def _tensor_method(self, name: str, result: Any) -> Any:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.log(name)
            return tensor if result is None else result

        return method

    def _recorded(self, name: str, result: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.log(name, *args)
            return result

        return call

    # -- streams, events, devices -----------------------------------------------------------

    def _new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        index = _index(device)
        stream = FakeStream(self, f"side{next(self._ids)}:{index}", index)
        self.log("Stream", stream.name)
        return stream

    def _new_event(self, *args: Any, **kwargs: Any) -> FakeEvent:
        event = FakeEvent(self, f"ev{next(self._ids)}")
        self.events.append(event)
        self.log("Event", event.name)
        return event

    def _current_stream(self, device: Any = None) -> FakeStream:
        index = _index(device)
        stack = self._current.setdefault(index, [FakeStream(self, f"current:{index}", index)])
        return stack[-1]

    @contextlib.contextmanager
    def _stream_context(self, stream: FakeStream) -> Iterator[None]:
        self.log("stream_enter", stream.name)
        self._current_stream(stream.index)
        self._current[stream.index].append(stream)
        try:
            yield
        finally:
            self._current[stream.index].pop()
            self.log("stream_exit", stream.name)

    @contextlib.contextmanager
    def _device_context(self, device: Any) -> Iterator[None]:
        index = _index(device)
        self.log("device_enter", index)
        try:
            yield
        finally:
            self.log("device_exit", index)


def _index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0
