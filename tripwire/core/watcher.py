"""Both ends of the link between a training process and `tripwire watch` (evaluation.where: side_process).

The watcher keeps `watcher/heartbeat.json` in the run (`Heartbeat`): written when it attaches, every
`every_s` after, `state: exited` when it ends. The training process (`WatcherLink`, worker 0) starts the
watcher with `spawn: true` and ends it at teardown, and says once, on its writer thread, when no watcher
attached within `evaluation.watcher_timeout_s`, or when the attached one exited or stopped beating. It
judges liveness by the heartbeat changing, by its own clock: the watcher's clock does not matter.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

log = logging.getLogger("tripwire")
HEARTBEAT = "watcher/heartbeat.json"
STORAGE_OPTIONS_ENV = "TRIPWIRE_STORAGE_OPTIONS"  # how a spawned watcher gets the training's storage options


class Heartbeat:
    """The watcher's end: `watcher/heartbeat.json`, with a `beat` counter that changes at every write."""

    def __init__(self, store, every_s: float):
        self.store, self.every_s = store, every_s
        self.body = {"state": "watching", "beat": 0, "started": time.time(), "host": socket.gethostname(),
                     "pid": os.getpid()}
        self.next = 0.0

    def tick(self, state: str = "watching") -> None:
        now = time.monotonic()
        if now < self.next and state == "watching":
            return
        self.next = now + self.every_s
        self.body.update(state=state, beat=self.body["beat"] + 1, time=time.time())
        try:
            self.store.put_json(HEARTBEAT, self.body)
        except Exception as exc:  # noqa: BLE001 - a missed beat is retried at the next one
            log.debug("tripwire watch: heartbeat not written: %s", exc)


def heartbeat_every(config: dict | None) -> float:
    """How often the watcher beats: a quarter of the training's `evaluation.watcher_timeout_s`, 0.2 s to 5 s."""
    timeout = float(((config or {}).get("evaluation") or {}).get("watcher_timeout_s") or 60.0)
    return min(5.0, max(0.2, timeout / 4))


class WatcherLink:
    """The training process's end (worker 0). Each warning is given once (the heartbeat one again after a
    watcher re-attaches); training always goes on."""

    def __init__(self, store, run_url: str, timeout_s: float):
        self.store, self.run_url, self.timeout_s = store, run_url, timeout_s
        self.process: subprocess.Popen | None = None  # the watcher this process spawned
        self._started_at = time.monotonic()
        self._exit_warned = False  # the spawned watcher exited
        self._warned = False  # no watcher attached, or its heartbeat stopped
        self._key: object = "unread"  # what the heartbeat said last, and since when (monotonic)
        self._beat_at = 0.0
        self._attached = False
        self._state = None
        self._checked = 0.0

    @property
    def attached(self) -> bool:
        """Whether a watcher's heartbeat has been seen since training started."""
        return self._attached

    def spawn(self, storage_options: dict) -> None:
        """Start `tripwire watch` as a child process; its config is this training's own (--trust-run)."""
        env = dict(os.environ)
        if storage_options:
            env[STORAGE_OPTIONS_ENV] = json.dumps(storage_options)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "tripwire", "watch", self.run_url, "--quiet",
                                             "--trust-run"], env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            log.warning("tripwire: could not start the side-process watcher (%s); training goes on without rule "
                        "evaluation. Run `tripwire watch %s` yourself.", exc, self.run_url)

    def check_spawned(self) -> None:
        """Training thread, cheap (no I/O): say so if the spawned watcher exited while training runs."""
        if self.process is not None and not self._exit_warned and self.process.poll() is not None:
            self._exit_warned = True
            log.warning("tripwire: the side-process watcher exited (code %s) while training runs; rules are no "
                        "longer evaluated. Training goes on. Restart it with `tripwire watch %s`.",
                        self.process.returncode, self.run_url)

    def check_heartbeat(self) -> None:
        """Writer thread: one small GET per second at most."""
        timeout = self.timeout_s
        now = time.monotonic()
        if now - self._checked < min(1.0, timeout / 4):
            return
        self._checked = now
        try:
            beat = json.loads(self.store.get(HEARTBEAT))
            key = (beat.get("pid"), beat.get("started"), beat.get("beat"), beat.get("state"))
        except FileNotFoundError:
            beat = key = None
        except (OSError, ValueError, AttributeError):  # storage hiccup or a torn read: judged again next time
            return
        if self._key == "unread":  # the first look: a heartbeat left by a watcher of an earlier session
            self._key = key  # (this run resumed) proves nothing until it changes
            return
        if key != self._key:
            self._key, self._beat_at = key, now
            attached = beat.get("state") == "watching"
            if attached and self._warned:
                log.warning("tripwire: a side-process watcher is attached to %s again.", self.run_url)
                self._warned = False
            self._attached = self._attached or attached
            self._state = beat.get("state")
        if self._warned or self._exit_warned:
            return
        if not self._attached:
            if now - self._started_at > timeout:
                self._warned = True
                code = self.process.poll() if self.process is not None else None
                how = (f"run `tripwire watch {self.run_url}` (here or on any machine that reads the store), or set "
                       "evaluation.spawn: true" if self.process is None else
                       f"the spawned watcher exited with code {code} (its output says why)" if code is not None else
                       "the spawned watcher is running but has not attached")
                log.warning("tripwire: evaluation.where is side_process but no watcher attached to %s within %gs "
                            "(evaluation.watcher_timeout_s): no rule is evaluated. Training goes on; %s.",
                            self.run_url, timeout, how)
        elif self._state == "exited" or now - self._beat_at > timeout:
            self._warned = True
            what = ("exited" if self._state == "exited" else
                    f"stopped refreshing its heartbeat for {timeout:g}s (evaluation.watcher_timeout_s)")
            log.warning("tripwire: the side-process watcher of %s %s; rules are no longer evaluated. Training "
                        "goes on. Restart it with `tripwire watch %s`.", self.run_url, what, self.run_url)

    def stop(self, grace_s: float = 10.0) -> None:
        """At the end of training: the spawned watcher exits by itself once it sees the run finished."""
        if self.process is None:
            return
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
