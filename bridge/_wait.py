# SPDX-License-Identifier: Apache-2.0
"""Waiting for memory others free: the process's time, a thread's own, and what a wait did.

An allocation the budget refuses (after the recovery chain) waits up to the
calling thread's time for other threads to free memory, then fails with the
framework's usual out-of-memory error. The waiting itself is in the compiled
core (bridge/_native/wait.c); this module checks arguments and words messages.
"""

from __future__ import annotations

__all__ = ["WAIT_ENV", "waiting", "set_wait", "get_wait", "parse_wait", "wait_note"]

import contextlib
import math
import os
import threading
from collections.abc import Iterator

from bridge import _errors
from bridge._errors import format_bytes
from bridge._runtime import core, on_reset

WAIT_ENV = "BRIDGE_WAIT"  # seconds an allocation waits for memory (0: none)


def parse_wait(value: object, *, name: str = "wait") -> float:
    """Seconds from ``None`` (0), an int or a float >= 0; ValueError otherwise."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"{name}={value!r}: pass a number of seconds >= 0 (None or 0: fail at once)"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(
            f"{name}={value!r}: pass a number of seconds >= 0 (None or 0: fail at once)"
        )
    return seconds


def wait_from_env() -> float | None:
    """Seconds in ``BRIDGE_WAIT``, or None when unset or empty.

    Raises
    ------
    ValueError
        Naming the variable and its value.
    """
    raw = os.environ.get(WAIT_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(
            f"{WAIT_ENV}={raw!r}: set it to a number of seconds >= 0 such as '5' or '0.5' "
            "(0: an allocation the budget refuses fails at once)"
        )
    return seconds


def set_wait(seconds: float | None) -> None:
    """Set the process's wait (what :func:`bridge.unify` ``wait=`` sets)."""
    core.set_wait(parse_wait(seconds))


@on_reset
def _no_wait() -> None:
    """A fork child (or a test) starts with the default: no waiting."""
    core.set_wait(0.0)


def get_wait() -> float:
    """The process's wait in seconds (0: an allocation the budget refuses fails at once)."""
    return float(core.get_wait())


@contextlib.contextmanager
def waiting(seconds: float | None, priority: int | None = None) -> Iterator[None]:
    """Let this thread's allocations wait up to ``seconds`` for memory others free.

    Overrides the process's setting (:func:`bridge.unify` ``wait=``) for the
    calling thread inside the ``with`` block; the setting before it comes back
    at its end. Only allocations made on this thread follow it (torch's
    backward pass allocates on torch's own threads, which follow the
    process's setting).

    Parameters
    ----------
    seconds : float or None
        The longest an allocation the budget refuses waits; ``0`` or ``None``:
        it fails at once.
    priority : int, optional
        When every thread holding bridge memory is waiting, nobody would free:
        the waiter of the lowest priority is refused at once (the newest among
        equals). Default: the enclosing block's, else 0.

    Raises
    ------
    ValueError
        For a negative or non-numeric time, or a priority that is not an int.
    """
    secs = parse_wait(seconds, name="seconds")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority={priority!r}: pass an int (lower is refused first) or None")
    before = core.thread_wait()
    prio = before[2] if priority is None else priority
    if not -(2**31) <= prio < 2**31:
        raise ValueError(f"priority={priority!r}: pass an int between -2**31 and 2**31 - 1")
    core.set_thread_wait(True, secs, prio)
    try:
        yield
    finally:
        core.set_thread_wait(*before)


_OUTCOMES = {
    core.WAIT_OK: "got the memory",
    core.WAIT_TIMEOUT: "waited {t} for other threads to free memory; none freed enough",
    core.WAIT_ALL_WAITING: (
        "stopped waiting after {t}: every thread holding bridge memory on this device was "
        "waiting for memory too, so none would free any (this one was refused to end it){held}"
    ),
    core.WAIT_INTERRUPTED: "gave up waiting after {t} (interrupted)",
    core.WAIT_CAPTURE: "did not wait: a CUDA graph capture runs on this device",
    core.WAIT_HOPELESS: "did not wait: the request is larger than the budget or the device",
}


def _thread_name(ident: int) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"thread {ident}"


def holders_text(device: int) -> str:
    """``"MainThread 1.00 GiB (waiting), ..."``: who holds bridge memory on a device."""
    try:
        rc, rows = core.wait_holders(device)
    except Exception:  # noqa: BLE001 - a message never fails
        return ""
    if rc != 0 or not rows:
        return ""
    rows = sorted(rows, key=lambda r: -r[1])
    parts = [
        f"{_thread_name(ident)} {format_bytes(n)}" + (" (waiting)" if w else "")
        for ident, n, w in rows[:8]
    ]
    more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
    return ", ".join(parts) + more


def wait_note(device: int) -> str:
    """What the calling thread's last refused allocation did about waiting, for its OOM message.

    Empty when it did not wait because no wait was set.
    """
    seconds, outcome = core.last_wait()
    text = _OUTCOMES.get(outcome)
    if text is None or outcome == core.WAIT_OK:
        return ""
    held = ""
    if outcome in (core.WAIT_TIMEOUT, core.WAIT_ALL_WAITING):
        who = holders_text(device)
        held = f". Threads holding bridge memory: {who}" if who else ""
    note = text.format(t=f"{seconds:.2f} s", held=held if outcome == core.WAIT_ALL_WAITING else "")
    if outcome == core.WAIT_TIMEOUT:
        note += held
    return note[0].upper() + note[1:] + "."


# OOM messages (bridge._errors.oom_message) say what the wait did.
_errors.set_wait_note(wait_note)
