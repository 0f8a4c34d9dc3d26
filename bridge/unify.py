# SPDX-License-Identifier: Apache-2.0
"""bridge.unify(): put the frameworks of this process on one pool and one budget."""

from __future__ import annotations

__all__ = ["Bridge", "check_keywords", "unify", "current"]

import importlib
import importlib.util
import inspect
import sys
import threading
import warnings
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from bridge import _env, _runtime, _wait, frameworks, recovery, views
from bridge import share as _share
from bridge._errors import BridgeError, Status, check, format_bytes
from bridge._install import install_hint, own_index_command
from bridge._runtime import core
from bridge.budget import (
    DEVICE_MEMORY,
    GPU_LIMIT_ENV,
    SizeLike,
    parse_size,
    size_from_env,
    warn_if_above,
)
from bridge.pool import Pool, Stats, pool, stats

ORDER = frameworks.ORDER  # JAX first: its env must precede its backend (bridge.frameworks)


class Bridge:
    """What :func:`unify` set up: the frameworks on the shared pool, and the devices.

    Attributes
    ----------
    frameworks : frozenset[str]
        Frameworks allocating from the shared pool (``"cupy"``, ``"torch"``,
        ``"jax"``, ``"numba"``, ``"rmm"``).
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


@_runtime.on_reset
def _forget() -> None:
    """A fork child (or a test) starts without the parent's Bridge."""
    global _bridge
    _bridge = None


def current() -> Bridge | None:
    """The Bridge that :func:`unify` returned, or None before the first call."""
    return _bridge


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: pass True or False")
    return value


def _default_flag(name: str, value: object) -> bool | None:
    """True or False as given; None (the default): set up if installed, skipped if not."""
    return None if value is None else _flag(name, value)


def _asked(given: dict[str, object]) -> dict[str, bool | None]:
    """Every framework of the registry, in :data:`bridge.frameworks.FRAMEWORKS` order, with
    what unify() was given for it (its row's ``default`` when not given), checked.

    Raises
    ------
    TypeError
        For a name that is no framework of the registry (as Python says of a keyword a
        function does not take).
    ValueError
        For a value that is not True or False (or None, where the row's default is None).
    """
    for name in given:
        if name not in frameworks.NAMES:
            raise TypeError(f"unify() got an unexpected keyword argument {name!r}")
    asked: dict[str, bool | None] = {}
    for name in frameworks.FRAMEWORKS:
        if name not in frameworks.NAMES:  # "other": no framework
            continue
        default = frameworks.row(name).default
        value = given.get(name, default)
        asked[name] = _default_flag(name, value) if default is None else _flag(name, value)
    return asked


def _installed(name: str) -> bool:
    """Whether a framework's package is installed (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: Frameworks built without CUDA that a bare unify() left out: said once a process.
_said_without_cuda: set[str] = set()


def _without_cuda(names: list[str]) -> dict[str, str]:
    """Of these frameworks, the installed builds without CUDA: name -> their adapter's words.

    Asked of the adapters of the registry's ``cpu_builds`` rows (``without_cuda()``);
    nothing starts. A framework that is missing is left to the not-installed error.
    """
    found = {}
    for name in names:
        if not frameworks.row(name).cpu_builds:
            continue
        try:
            adapter = _adapter(name)
        except ImportError:
            continue
        ask = getattr(adapter, "without_cuda", None)  # a stand-in adapter may have none
        text = ask() if ask is not None else ""
        if text:
            found[name] = text
    return found


def _no_cuda(found: dict[str, str]) -> BridgeError:
    calls = ", ".join(f"{n}=True" for n in found)
    offs = ", ".join(f"{n}=False" for n in found)
    them = "it" if len(found) == 1 else "them"
    return BridgeError(
        f"bridge.unify({calls}): "
        + " ".join(f"{text}." for text in found.values())
        + f" Or pass {offs} to keep {them} on the CPU, off the shared pool."
    )


def unify(
    cupy: bool | None = None,
    torch: bool | None = None,
    jax: bool = False,
    *,
    budget: SizeLike = None,
    device: int | Iterable[int] | None = None,
    release_threshold: SizeLike = None,
    peer_access: bool = True,
    jax_memory: SizeLike = None,
    budget_views: bool = True,
    numba: bool = False,
    rmm: bool = False,
    wait: float | None = None,
    share: bool | str | None = None,
    ipc: bool | None = None,
    **other_frameworks: bool | None,
) -> Bridge:
    """Make the named frameworks allocate from each device's default pool under one budget.

    Call it at program start, before the first CUDA tensor or JAX array.

    Parameters
    ----------
    cupy, torch : bool or None
        Frameworks to put on the shared pool. ``None`` (the default): the
        framework if it is installed, skipped if not, so a bare ``unify()``
        sets up the installed ones; an installed build without CUDA (a
        CPU-only torch) is skipped too, with one warning a process. ``True``:
        set it up, and a framework that is not installed, or is a build
        without CUDA, is an error that says what to install. ``False``:
        leave it on its own allocator. (The old forms, ``unify(True, True)``,
        ``unify(cupy=True, torch=False)``, mean what they did.)
    jax : bool
        JAX on the shared pool (off unless asked for: it is configured before
        its GPU backend starts, see bridge.adapters.jax). A JAX without a CUDA
        plugin is refused before anything changes.
    budget : int, float, str or None
        Per device. ``None``: ``BRIDGE_GPU_MEMORY_LIMIT`` if set, else no limit
        (or the limit set earlier). ``int`` bytes; ``float`` in (0, 1] (or
        the same written as text, ``"0.8"``) = fraction of the device's
        memory; ``str`` such as ``"80%"``, ``"40GiB"``, ``"512MiB"``, ``"40GB"``.
    device : int, list of int, or None
        Devices to set up; every visible device when None.
    release_threshold : int, str or None
        Idle bytes each pool keeps across synchronizations (bytes or a size
        with a unit, no percentage); default: all of them (memory stays in
        the shared pool until ``free_all_blocks``).
    peer_access : bool
        With several devices, let each device's kernels read the others'
        pool memory (as torch does when peer access is enabled).
    jax_memory : int, float, str or None
        A hard partition for JAX: its own capped arena of this size (or share
        of the device) instead of the shared pool, and the budget reduced by
        it (so below the budget, when there is one). Default: JAX shares the
        pool (see bridge.adapters.jax for the trade-off).
    budget_views : bool
        Under a budget, the frameworks' free-memory queries answer within it
        (``torch.cuda.mem_get_info``, ``cupy.cuda.runtime.memGetInfo``,
        ``cupy.cuda.Device().mem_info``; not JAX's): free = min(the
        device's free memory, budget - what the budget's users hold), total =
        the budget. A device without a budget answers natively. False leaves
        the frameworks' own answers (see bridge.views).
    numba : bool
        Numba's memory manager on the shared pool (counted as ``numba``);
        before Numba's first CUDA call (see bridge.adapters.numba).
    rmm : bool
        RMM's device resource of every device on the shared pool (counted as
        ``rmm``): ``rmm.DeviceBuffer`` and what is built on it (see
        bridge.adapters.rmm).
    wait : float or None
        Seconds an allocation the budget refuses waits for memory that other
        threads free before it fails (``0``: it fails at once). ``None``:
        ``BRIDGE_WAIT`` if set, else what an earlier call set (at first 0).
        ``with bridge.waiting(seconds):`` overrides it for one thread.
    share : str, bool or None
        A name: one budget for every bridge process of this user on the same
        physical GPU that uses this name (found by the GPU's UUID, whatever
        ``CUDA_VISIBLE_DEVICES`` says); ``True``: the share named
        ``"default"``; ``None``: ``BRIDGE_SHARE`` if set, else this process's
        own budget. ``budget`` (or ``BRIDGE_GPU_MEMORY_LIMIT``) is then the
        share's budget: the first process gives it, later ones give the same
        or none. What the members hold together (their pools, cached blocks
        included) never passes it; a member that needs memory another keeps
        idle asks it to trim before its allocation fails.
    ipc : bool or None
        ``True``: each device of ``device`` allocates from a pool the bridge
        creates with POSIX file-descriptor export instead of the default
        pool, under the same budget, with the exact-size tiers as its cache
        (a block carved from a segment could not be sent), so that CUDA
        tensors can be sent to other processes of the same user
        (``torch.multiprocessing``);
        JAX stays on the default pool and is counted as before. ``None``:
        ``BRIDGE_IPC`` (``1`` on), else off. Once on, on for the process.
    **other_frameworks : bool or None
        Any other framework of the registry (bridge.frameworks), by its name,
        as the five above: {other_frameworks}. Another name is a TypeError, as
        for any keyword unify does not take.

    Returns
    -------
    Bridge
        The same object on every call. The same arguments again change
        nothing; a later call may add frameworks and devices.

    Warns
    -----
    UserWarning
        When this call changes a budget that an earlier call set (naming the
        device and both budgets: the new one applies), or the budget is
        larger than a device's memory. ``bridge.pool(d).set_limit(...)`` is
        the way to change a budget deliberately. Once a process, when a
        framework left at its default is a build without CUDA and is left out
        (naming the build and what to install).

    Raises
    ------
    ValueError
        For a bad budget, device, threshold, JAX partition or flag. Every
        argument is checked before anything changes: after a ValueError the
        process is as it was (no Bridge, no budget, no framework).
    BridgeError
        When frameworks asked for with True are not installed (all of them
        named at once, with the packages to install for CUDA 12 and 13), are
        installed but fail to import (one left at its default too: the import's
        error and what to reinstall; ``name=False`` leaves it out), or are
        builds without CUDA (a CPU-only torch or jax: the build and what to
        install instead; nothing changes, JAX is not even imported), a
        framework has already started its own allocator (torch's CUDA
        allocator, JAX's GPU backend), there is no CUDA driver or device, or
        the share cannot be joined (its file is another user's, corrupt or
        open to others; its budget differs; the first process gave none).
        A framework that has started already (torch's CUDA, JAX's backend) is
        refused before anything changes. One that refuses as it is set up (or a
        share that cannot be joined) leaves the budget and the bridge as they
        were before the call when no framework of the call was installed: a
        share the call joined is left (its slot freed, the other members get
        its claim back; one an earlier call joined stays) and a device whose
        exportable pool the call made allocates from the default pool again,
        with the cache it had (the pool is kept for a later ``ipc=True``; it
        stays in use where a block of it is live or was sent to another
        process: nothing of it can be taken back then). Frameworks the call
        installed before the one that refused stay installed, and with them
        what they run under: the budget, the share, the exportable pools.
    """
    global _bridge
    asked = _asked(dict(cupy=cupy, torch=torch, jax=jax, numba=numba, rmm=rmm, **other_frameworks))
    flags = {n: _installed(n) if on is None else on for n, on in asked.items()}
    _flag("peer_access", peer_access)
    _flag("budget_views", budget_views)
    # None: BRIDGE_IPC (off when unset); a bad value is refused before any change
    ipc_on = _runtime.ipc_from_env() if ipc is None else _flag("ipc", ipc)
    # reject bad input before any change, and before the driver is needed
    for name, value, of in (
        ("budget", budget, DEVICE_MEMORY),
        ("release_threshold", release_threshold, None),
        ("jax_memory", jax_memory, DEVICE_MEMORY),
    ):
        parse_size(value, total=1 << 40, name=name, of=of)
    # None: BRIDGE_WAIT if set, else what an earlier call set
    seconds = _wait.parse_wait(wait) if wait is not None else _wait.wait_from_env()
    share_name = _share.share_name(share)
    _share.share_growth_from_env()  # a bad BRIDGE_SHARE_GROWTH is refused as doctor refuses it
    # a build without CUDA: refused when asked for, left out (said once) when defaulted
    without = _without_cuda([n for n, on in flags.items() if on])
    left_out = {n: text for n, text in without.items() if asked.get(n, False) is None}
    flags.update(dict.fromkeys(left_out, False))
    for fw in frameworks.REGISTRY:  # a framework's bad variable, the same (bridge._env reads it)
        if flags[fw.name]:
            for var in fw.env:
                _env.variable(var).read(_env.Totals())
    if jax_memory is not None and not flags["jax"]:
        raise ValueError(
            f"jax_memory={jax_memory!r} is a partition for JAX: pass jax=True with it, or drop it"
        )
    with _lock:
        devices = _runtime.resolve_devices(device)
        for d in devices:
            _runtime.ensure_device(d)
        # no driver says so first (as for a missing framework): it is what stops everything
        if len(left_out) < len(without):  # the rest were asked for
            raise _no_cuda({n: text for n, text in without.items() if n not in left_out})
        for name, text in left_out.items():
            if name not in _said_without_cuda:
                _said_without_cuda.add(name)
                warnings.warn(
                    f"bridge.unify() left {name} out: {text}. It stays on its own allocator; "
                    f"pass {name}=False to leave it out without this warning.",
                    UserWarning,
                    stacklevel=2,
                )
        b = _bridge if _bridge is not None else Bridge()
        args = (
            tuple(sorted(f for f, on in flags.items() if on)),
            budget,
            tuple(devices),
            release_threshold,
            peer_access,
            jax_memory,
            budget_views,
            share_name,
            ipc_on,
        )
        if b._args == args:
            if seconds is not None:
                _wait.set_wait(seconds)
            return b
        # every figure from every argument, still without changing anything
        totals = {d: _total(d) for d in devices}
        limits = {}
        if budget is not None:
            limits = {d: parse_size(budget, total=t, name="budget") or 0 for d, t in totals.items()}
        _budgets_agree_with_shares(budget, limits)
        threshold = None
        if release_threshold is not None:
            threshold = parse_size(release_threshold, name="release_threshold", of=None) or 0
        partition = None
        if jax_memory is not None:
            partition = _partition(jax_memory, totals)
        # JAX's arena from an earlier call (its install() returns at once now): a budget
        # given again is taken down by it, as that call took its budget down
        arena = _partition_arena()
        if partition is not None and partition != arena and _partition_started():
            raise ValueError(
                f"jax_memory={jax_memory!r} cannot apply: JAX "
                + (
                    f"already has an arena of {format_bytes(arena)}"
                    if arena
                    else "already shares the pool"
                )
                + " (an earlier unify(jax=True) started it), and JAX's allocator is fixed "
                "once it starts. Pass the same jax_memory or none, or give JAX this "
                "partition in a new process."
            )
        if arena:
            _partition_below_budgets("JAX's arena (from an earlier call)", arena, limits, [])
        elif partition is not None:
            _partition_below_budgets(f"jax_memory={jax_memory!r}", partition, limits, devices)
        applied = {
            d: max(1, limit - arena) if limit and arena else limit for d, limit in limits.items()
        }
        adapters = _adapters([n for n in ORDER if flags[n] and n not in b.frameworks], asked)
        # a framework that would refuse for a reason it can tell now (torch has started
        # CUDA, JAX's backend has): refused before anything changes, so that no other
        # member of a share sees this process join and leave, and no pool is made
        late = [text for _, adapter in adapters if (text := _too_late(adapter))]
        if late:
            raise BridgeError(" ".join(late))
        share_budgets = {}
        if share_name is not None:
            for d, t in totals.items():
                given = limits[d] if budget is not None else size_from_env(GPU_LIMIT_ENV, total=t)
                share_budgets[d] = given or 0

        # now change things; a framework that refuses puts back what this call changed
        before = {d: _limit(d) for d in limits}
        old_threshold = _runtime.release_threshold()
        made_ipc: list[int] = []  # devices whose exportable pool this call made
        joined: list[int] = []  # devices whose share this call joined
        installed = []
        try:
            if threshold is not None:
                _runtime.set_release_threshold(threshold)
            for d, limit in applied.items():
                check(core.set_limit(d, limit), what="setting the budget", device=d)
            if ipc_on:
                for d in devices:
                    if not core.ipc_enabled(d):
                        check(core.ipc_enable(d), what="creating the exportable pool", device=d)
                        made_ipc.append(d)
                        # a block carved from a segment (or a chunk) is no allocation of the
                        # pool's own and cannot be exported: the exact-size cache instead
                        check(
                            core.set_cache_segments(d, False), what="turning segments off", device=d
                        )
                        # blocks cached from the default pool are not exportable: back to it
                        check(core.trim(d, 0), what="emptying the cache", device=d)
            # after the exportable pools exist: a grant sets both pools of a device; every
            # device of the bridge, so that a device an earlier call set up alone and the ones
            # this call adds read each other's pools as one call's devices do
            every = sorted(set(b.devices) | set(devices))
            if peer_access and len(every) > 1:
                for d in every:
                    check(core.grant_peer_access(d)[0], what="granting peer access", device=d)
            recovery.install()
            views.want(budget_views)  # JAX reads it as it starts
            if share_name is not None:
                for d, share_budget in share_budgets.items():
                    earlier_member = _share.membership(d) is not None
                    _share.join(d, share_name, share_budget)
                    if not earlier_member:
                        joined.append(d)
            for name, adapter in adapters:
                if frameworks.row(name).partition and partition is not None:
                    adapter.install(sorted(set(b.devices) | set(devices)), partition=partition)
                else:
                    adapter.install(sorted(set(b.devices) | set(devices)))
                installed.append(name)
        except BaseException:
            if not installed:  # nothing of this call stays: put back what it changed
                _put_back(joined, made_ipc, totals)
                for d, limit in before.items():
                    core.set_limit(d, limit)
                if threshold is not None:
                    _runtime.set_release_threshold(old_threshold)
                raise
            _record(b, devices, installed)
            raise
        earlier = b.devices if b._args is not None else None
        _record(b, devices, installed)
        views.apply(b.frameworks, budget_views)
        b._args = args
        if seconds is not None:
            _wait.set_wait(seconds)
        _say_what_changed(budget, before, limits, totals, earlier, applied)
        return b


def _other_frameworks_doc() -> str:
    """The frameworks unify() takes by ``**other_frameworks``, for its docstring."""
    own = set(inspect.signature(unify).parameters)
    rows = [frameworks.row(n) for n in frameworks.FRAMEWORKS if n in frameworks.NAMES]
    said = [f"``{f.name}``" + (f" ({f.doc})" if f.doc else "") for f in rows if f.name not in own]
    return "; ".join(said) if said else "none besides them today"


if unify.__doc__:  # None under python -OO
    unify.__doc__ = unify.__doc__.replace("{other_frameworks}", _other_frameworks_doc())


def _budgets_agree_with_shares(budget: SizeLike, limits: dict[int, int]) -> None:
    """A device already in a share keeps the share's budget: another one is refused, naming
    both (the share's budget is what refuses, so it is the one that stats show)."""
    for d, limit in limits.items():
        mine = _share.membership(d)
        if mine is None or not limit:
            continue
        if mine["budget"] not in (limit, limit // _share.SHARE_UNIT * _share.SHARE_UNIT):
            raise BridgeError(
                f"bridge.unify(budget={budget!r}): device {d} is in the share "
                f"{mine['name']!r}, whose budget is {format_bytes(mine['budget'])} "
                f"({mine['budget']} bytes); this process cannot have a budget of "
                f"{format_bytes(limit)} ({limit} bytes) there: the share's refuses first. "
                "Pass the share's budget or none, or run in another share."
            )


def _put_back(joined: list[int], made_ipc: list[int], totals: dict[int, int]) -> None:
    """A call that failed with nothing of it installed: out of the shares it joined (the
    slot freed, the other members get its claim back; a share an earlier call joined
    stays), and back to the default pool where it made the exportable one, with the cache
    as the environment set it. What cannot be put back stays, without a second error
    over the framework's: an exportable pool whose blocks are live or were shared."""
    for d in joined:
        core.share_leave(d)
    for d in made_ipc:
        if core.ipc_disable(d) == Status.OK:
            try:
                _runtime.apply_cache_carving(d, totals[d])
            except BridgeError:  # the cache's exact-size tiers stay: they work
                pass


def _record(b: Bridge, devices: list[int], installed: list[str]) -> None:
    """Make ``b`` the bridge, with the devices and frameworks this call set up."""
    global _bridge
    b.devices = tuple(sorted(set(b.devices) | set(devices)))
    b.frameworks = b.frameworks | set(installed)
    _bridge = b


def _total(device: int) -> int:
    rc, raw = core.stats(device)
    check(rc, what="reading the device", device=device)
    return int(raw["total"])


def _limit(device: int) -> int:
    rc, raw = core.stats(device)
    check(rc, what="reading the budget", device=device)
    return int(raw["limit"])


def _partition(jax_memory: SizeLike, totals: dict[int, int]) -> int:
    """JAX's partition in bytes, below every device's memory."""
    partition = min(
        parse_size(jax_memory, total=t, name="jax_memory") or 0 for t in totals.values()
    )
    small = min(totals.values())
    if not 0 < partition < small:
        raise ValueError(
            f"jax_memory={jax_memory!r} is {format_bytes(partition)}: a partition for JAX must be "
            f"more than 0 and below the device's memory ({format_bytes(small)}). Pass a smaller "
            "size or a share such as '25%', or leave jax_memory out to let JAX share the pool."
        )
    return partition


def _partition_arena() -> int:
    """The bytes of the hard partition an earlier call gave a framework (the registry's row
    that takes ``partition``, its adapter installed with one: its ``partition()``); 0 when
    none."""
    for fw in frameworks.REGISTRY:
        adapter = sys.modules.get(fw.adapter) if fw.partition else None
        given = getattr(adapter, "partition", None)
        if callable(given):
            return int(given() or 0)
    return 0


def _partition_started() -> bool:
    """Whether the framework that takes a hard partition (the registry's row with
    ``partition``) is already installed in this process: its allocator is then fixed."""
    for fw in frameworks.REGISTRY:
        adapter = sys.modules.get(fw.adapter) if fw.partition else None
        installed = getattr(adapter, "installed", None)
        if callable(installed) and installed():
            return True
    return False


def _partition_below_budgets(
    what: str, partition: int, limits: dict[int, int], devices: list[int]
) -> None:
    """JAX's partition is taken out of the budget (adapters/jax.py): a partition as large as
    a device's budget would leave CuPy and torch nothing (a budget of 1 byte refusing every
    allocation), so it is refused before anything changes.  The budgets given (``limits``),
    and those the ``devices`` have now where none is given."""
    for d in sorted(set(limits) | set(devices)):
        budget = limits[d] if d in limits else _limit(d)
        if budget and partition >= budget:
            raise ValueError(
                f"{what} is {format_bytes(partition)}, not below device {d}'s budget of "
                f"{format_bytes(budget)}: JAX's partition is taken out of the budget, which "
                "would leave nothing to the other frameworks. Pass a larger budget or a "
                "smaller jax_memory."
            )


def _say_what_changed(
    budget: SizeLike,
    before: dict[int, int],
    limits: dict[int, int],
    totals: dict[int, int],
    earlier: tuple[int, ...] | None,
    applied: dict[int, int] | None = None,
) -> None:
    """Warn when this call changed the budget of a device an earlier call set up, and
    about budgets larger than a device (``applied``: the budgets set, when JAX's arena took
    them below ``limits``)."""
    changed = [
        (d, before[d], new)
        for d, new in (applied if applied is not None else limits).items()
        if earlier is not None and d in earlier and before[d] != new
    ]
    if changed:
        what = "; ".join(
            f"device {d}: {_budget_text(old)} -> {_budget_text(new)}" for d, old, new in changed
        )
        warnings.warn(
            f"bridge.unify(budget={budget!r}) changed the budget an earlier call left in place "
            f"({what}); the new budget applies. To change a budget deliberately, call "
            "bridge.pool(device).set_limit(...); to keep it, call unify() again with the same "
            "budget or none.",
            UserWarning,
            stacklevel=3,
        )
    above: dict[tuple[int, int], list[int]] = {}  # (limit, total) -> devices
    for d, limit in limits.items():
        above.setdefault((limit, totals[d]), []).append(d)
    for (limit, total), devs in above.items():
        where = f"device {devs[0]}" if len(devs) == 1 else f"devices {devs}"
        warn_if_above(
            limit, total, name=f"budget={budget!r} on {where}", of=DEVICE_MEMORY, stacklevel=3
        )


def _budget_text(limit: int) -> str:
    return format_bytes(limit) if limit else "no limit"


def _adapter(name: str) -> ModuleType:
    """The adapter module of a framework; ImportError when the framework is missing."""
    row = frameworks.row(name)
    if row.imports_late and importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)
    return importlib.import_module(row.adapter)


def _too_late(adapter: ModuleType) -> str:
    """Why an adapter's ``install()`` would refuse now, without trying ("" when it would not;
    an adapter without ``too_late()`` tells only by refusing)."""
    ask = getattr(adapter, "too_late", None)
    return str(ask()) if ask is not None else ""


def _adapters(
    names: list[str], asked: dict[str, bool | None] | None = None
) -> list[tuple[str, ModuleType]]:
    """The adapters of these frameworks, in order; BridgeError naming every missing one,
    else every installed one that does not import (``asked``: unify's flags, to name the
    call as it was written)."""
    found: list[tuple[str, ModuleType]] = []
    missing: dict[str, ImportError] = {}
    broken: dict[str, ImportError] = {}
    for name in names:
        try:
            found.append((name, _adapter(name)))
        except ImportError as exc:
            # the framework missing, or installed and failing as it imports (a CuPy
            # without the CUDA libraries it was built for)
            (broken if _installed(name) else missing)[name] = exc
    if missing:
        raise _not_installed(missing)
    if broken:
        raise _not_importable(broken, asked or {})
    return found


def _listed(names: list[str]) -> str:
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _not_importable(broken: dict[str, ImportError], asked: dict[str, bool | None]) -> BridgeError:
    """Installed frameworks whose import fails: the call as written, the import's error,
    and the ways out (a framework left at its default was set up because it is installed)."""
    names = list(broken)
    calls = ", ".join(f"{n}=True" for n in names if asked.get(n) is not None)
    verb = "is" if len(names) == 1 else "are"
    it = "it" if len(names) == 1 else "them"
    why = "; ".join(f"{type(exc).__name__}: {exc}" for exc in broken.values())
    offs = ", ".join(f"{n}=False" for n in names)
    return BridgeError(
        f"bridge.unify({calls}): {_listed(names)} {verb} installed but importing {it} failed "
        f"({why}). Reinstall {it} for the CUDA major of the rest of the environment "
        f"({install_hint(names)}), or pass {offs} to leave {it} on "
        f"{'its own allocator' if len(names) == 1 else 'their own allocators'}."
    )


def _not_installed(missing: dict[str, ImportError]) -> BridgeError:
    names = list(missing)
    listed = _listed(names)
    verb = "is" if len(names) == 1 else "are"
    why = "; ".join(str(exc) for exc in missing.values())
    calls = ", ".join(f"{n}=True" for n in names)
    offs = ", ".join(f"{n}=False" for n in names)
    return BridgeError(
        f"bridge.unify({calls}): {listed} {verb} not installed ({why}). Install "
        f"{'it' if len(names) == 1 else 'them'} for the CUDA major of the rest of the "
        f"environment ({install_hint(names)}; from a checkout, pip install -e '.[cuda13]', "
        f"or '.[cuda12]' after {own_index_command(12)}), or pass {offs}, or leave "
        f"{'it' if len(names) == 1 else 'them'} out to set up only what is installed."
    )


def check_keywords(kwargs: dict[str, Any], where: str, *, but: str = "") -> dict[str, Any]:
    """``unify()``'s keywords for a later call elsewhere (a Dask or Ray worker), checked here.

    What can be checked without a driver is: the names (``but``: one that ``where`` sets
    itself, such as ``device``), the budget's form and the share's name. Returns a copy.

    Raises
    ------
    ValueError
        Naming ``where``, the keyword and what it takes instead.
    """
    named = [
        p.name for p in inspect.signature(unify).parameters.values() if p.kind != p.VAR_KEYWORD
    ]
    takes = sorted((set(named) | set(frameworks.NAMES)) - {but})
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        sets = f" but {but} ({where} chooses it)" if but else ""
        raise ValueError(
            f"{where}({', '.join(f'{k}=...' for k in unknown)}): not a keyword it takes; it takes "
            f"bridge.unify's{sets}: {', '.join(takes)}"
        )
    if "budget" in kwargs:
        parse_size(kwargs["budget"], total=1 << 40, name="budget", of=DEVICE_MEMORY)
    if "share" in kwargs:
        _share.share_name(kwargs["share"])
    return dict(kwargs)
