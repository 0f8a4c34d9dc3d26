"""bridge.unify(): put the frameworks of this process on one pool and one budget."""

from __future__ import annotations

__all__ = ["Bridge", "unify", "current"]

import importlib
import threading
from collections.abc import Iterable
from types import ModuleType

from bridge import _runtime, recovery
from bridge._errors import BridgeError, check
from bridge._runtime import core
from bridge.budget import SizeLike, parse_size
from bridge.pool import Pool, Stats, pool, stats

ORDER = ("jax", "torch", "cupy")  # JAX first: its environment must precede its backend


class Bridge:
    """What :func:`unify` set up: the frameworks on the shared pool, and the devices.

    Attributes
    ----------
    frameworks : frozenset[str]
        Frameworks allocating from the shared pool (``"cupy"``, ``"torch"``, ``"jax"``).
    devices : tuple[int, ...]
        Devices whose pools the bridge set up.
    """

    def __init__(self) -> None:
        self.frameworks: frozenset[str] = frozenset()
        self.devices: tuple[int, ...] = ()
        self._args: tuple | None = None

    def pool(self, device: int | None = None) -> Pool:
        """The shared pool of a device (see :func:`bridge.pool`)."""
        return pool(device)

    def stats(self, device: int | None = None) -> Stats:
        """A snapshot of a device's pool (see :func:`bridge.stats`)."""
        return stats(device)

    def __repr__(self) -> str:
        fws = ", ".join(sorted(self.frameworks)) or "none"
        return f"<bridge.Bridge frameworks=[{fws}] devices={list(self.devices)}>"


_lock = threading.RLock()
_bridge: Bridge | None = None


def current() -> Bridge | None:
    """The Bridge that :func:`unify` returned, or None before the first call."""
    return _bridge


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: pass True or False")
    return value


def unify(
    cupy: bool = True,
    torch: bool = True,
    jax: bool = False,
    *,
    budget: SizeLike = None,
    device: int | Iterable[int] | None = None,
    release_threshold: SizeLike = None,
    peer_access: bool = True,
    jax_memory: SizeLike = None,
) -> Bridge:
    """Make the named frameworks allocate from each device's default pool under one budget.

    Call it at program start, before the first CUDA tensor or JAX array.

    Parameters
    ----------
    cupy, torch, jax : bool
        Frameworks to put on the shared pool.
    budget : int, float, str or None
        Per device. ``None``: ``BRIDGE_GPU_MEMORY_LIMIT`` if set, else no limit
        (or the limit set earlier). ``int`` bytes; ``float`` in (0, 1] =
        fraction of the device's memory; ``str`` such as ``"80%"``,
        ``"40GiB"``, ``"512MiB"``, ``"40GB"``.
    device : int, list of int, or None
        Devices to set up; every visible device when None.
    release_threshold : int, str or None
        Idle bytes each pool keeps across synchronizations; default: all of
        them (memory stays in the shared pool until ``free_all_blocks``).
    peer_access : bool
        With several devices, let each device's kernels read the others'
        pool memory (as torch does when peer access is enabled).
    jax_memory : int, str or None
        A hard partition for JAX: its own capped arena of this size instead of
        the shared pool, and the budget reduced by it. Default: JAX shares the
        pool (see bridge.adapters.jax for the trade-off).

    Returns
    -------
    Bridge
        The same object on every call.

    Raises
    ------
    ValueError
        For a bad budget, device or flag; nothing has changed then.
    BridgeError
        When a framework has already started its own allocator (torch's CUDA
        allocator, JAX's GPU backend), is not installed, or there is no CUDA
        driver or device.
    """
    global _bridge
    flags = {"cupy": _flag("cupy", cupy), "torch": _flag("torch", torch), "jax": _flag("jax", jax)}
    _flag("peer_access", peer_access)
    if budget is not None:
        parse_size(budget, total=1 << 40, name="budget")  # reject bad input before any change
    with _lock:
        devices = _runtime.resolve_devices(device)
        for d in devices:
            _runtime.ensure_device(d)
        b = _bridge if _bridge is not None else Bridge()
        args = (
            tuple(sorted(f for f, on in flags.items() if on)),
            budget,
            tuple(devices),
            release_threshold,
            peer_access,
            jax_memory,
        )
        if b._args == args:
            return b
        limits = {}
        if budget is not None:
            for d in devices:
                rc, raw = core.stats(d)
                check(rc, what="reading the device", device=d)
                limits[d] = parse_size(budget, total=raw["total"], name="budget") or 0
        if release_threshold is not None:
            _runtime.set_release_threshold(
                parse_size(release_threshold, total=None, name="release_threshold") or 0
            )
        for d, limit in limits.items():
            check(core.set_limit(d, limit), what="setting the budget", device=d)
        if peer_access and len(devices) > 1:
            for d in devices:
                check(core.grant_peer_access(d)[0], what="granting peer access", device=d)
        b.devices = tuple(sorted(set(b.devices) | set(devices)))
        recovery.install()
        _bridge = b
        for name in ORDER:
            if flags[name] and name not in b.frameworks:
                adapter = _adapter(name)
                try:  # an adapter imports its framework lazily, in install()
                    if name == "jax" and jax_memory is not None:
                        total = core.stats(b.devices[0])[1]["total"]
                        adapter.install(
                            b.devices,
                            partition=parse_size(jax_memory, total=total, name="jax_memory"),
                        )
                    else:
                        adapter.install(b.devices)
                except ImportError as exc:
                    raise _not_installed(name, exc) from exc
                b.frameworks = b.frameworks | {name}
        b._args = args
        return b


def _adapter(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"bridge.adapters.{name}")
    except ImportError as exc:  # the framework itself is missing
        raise _not_installed(name, exc) from exc


def _not_installed(name: str, exc: ImportError) -> BridgeError:
    return BridgeError(
        f"bridge.unify({name}=True): {name} is not installed ({exc}). Install it "
        f"(pip install 'bridge[{name}]') or pass {name}=False."
    )
