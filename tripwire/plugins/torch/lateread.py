"""Small values computed on an accelerator, read on the host without waiting for the device.

A check that runs at every step (a NaN loss, a step that changed nothing) must not make the step wait: reading
a value from a GPU waits for every kernel queued before it. Here a value goes to a slot of pinned host memory by
a non-blocking copy, behind an event, and is read once the event says the device got there: at a later step,
usually the next. At most SLOTS values are in flight; one more is dropped (its put says so), so no step ever
waits and the memory stays fixed. Values computed on the CPU are ready at once.
"""

from __future__ import annotations

from collections import deque

import torch


class LateRead:
    SLOTS = 8

    def __init__(self, width: int = 1, dtype: torch.dtype = torch.bool):
        """Each value is a tensor of at most `width` elements of `dtype`."""
        self._width, self._dtype = width, dtype
        self._host = None  # pinned [SLOTS, width], made at the first put from an accelerator
        self._rows: list = []  # its rows, as views made once (indexing a tensor costs as much as a launch)
        self._in_flight = 0  # pending values put from an accelerator
        self._events: dict = {}  # (slot, device) -> its event, made once and recorded again at each put there
        self._pending: deque = deque()  # (slot, event or None, payload, value where ready at once)
        self._puts = 0

    def put(self, value, payload) -> bool:
        """Start reading `value` (a tensor, or a number or bool already on the host); `payload` comes back with
        it from `ready`. False where it was dropped: every slot is in flight, or the device has no events or
        pinned memory."""
        if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
            self._pending.append((None, None, payload, value.tolist() if isinstance(value, torch.Tensor) else value))
            return True
        if self._in_flight >= self.SLOTS:
            return False
        try:
            if self._host is None:
                self._host = torch.zeros((self.SLOTS, self._width), dtype=self._dtype, pin_memory=True)
                self._rows = list(self._host.unbind(0))
            slot, flat, backend = self._puts % self.SLOTS, value.detach().reshape(-1), getattr(torch, value.device.type)
            row = self._rows[slot]
            # the copy runs on the current stream of value's device
            (row if flat.numel() == self._width else row[:flat.numel()]).copy_(flat, non_blocking=True)
            event = self._events.get((slot, value.device)) or backend.Event()
            event.record(backend.current_stream(value.device))  # no device switch: each costs as much as a launch
            self._events[(slot, value.device)] = event
        except (AttributeError, RuntimeError):  # a device without events or pinned memory: not read
            return False
        self._puts += 1
        self._in_flight += 1
        self._pending.append((slot, event, payload, flat.numel()))
        return True

    @property
    def idle(self) -> bool:
        """Whether no value is waiting to be read."""
        return not self._pending

    def ready(self, wait: bool = False) -> list:
        """(payload, value) of each value whose copy is done, in the order they were put; a value put as a
        tensor comes back as a list of its elements (one element: the element). wait: every value put, waiting for
        the device where its copy is not done (at the end of training, where no step is held up)."""
        done = []
        while self._pending and (wait or self._pending[0][1] is None or self._pending[0][1].query()):
            slot, event, payload, value = self._pending.popleft()
            if slot is not None:
                event.synchronize()
                self._in_flight -= 1
                value = self._rows[slot][:value].tolist()
            done.append((payload, value[0] if isinstance(value, list) and len(value) == 1 else value))
        return done
