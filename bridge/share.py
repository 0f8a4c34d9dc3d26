# SPDX-License-Identifier: Apache-2.0
"""One budget for every bridge process on a GPU: ``bridge.unify(share=...)``.

Processes of one user that pass the same share name for the same physical GPU
(found by its UUID, whatever ``CUDA_VISIBLE_DEVICES`` says) draw from one
budget, kept in a small shared file (``BRIDGE_SHARE_DIR``, default
``/dev/shm``; mode 0600, one per user, GPU and name). The compiled core
(bridge/_native/share.c) keeps it exact; this module names shares, joins
them, and reads the files for ``python -m bridge stats``.
"""

from __future__ import annotations

__all__ = [
    "SHARE_ENV",
    "SHARE_DIR_ENV",
    "DEFAULT_SHARE",
    "Member",
    "Share",
    "share_name",
    "share_dir",
    "join",
    "membership",
    "list_shares",
    "set_worker_label",
    "label_if_member",
    "worker_labels",
]

import dataclasses
import json
import os
import stat
import struct
import time
import warnings
from collections.abc import Iterable

from bridge._errors import BridgeError, check, format_bytes
from bridge._runtime import core
from bridge.budget import size_from_env
from bridge.pool import TAG_NAMES

SHARE_ENV = "BRIDGE_SHARE"  # the share name when unify() is given none
SHARE_DIR_ENV = "BRIDGE_SHARE_DIR"  # where the share files live
# bytes (a multiple of 2 MiB): how much the driver's pool may grow for one allocation, claimed
# while it is in flight (read by the core at join; default 32 MiB, as measured on an H200)
SHARE_GROWTH_ENV = "BRIDGE_SHARE_GROWTH"
SHARE_UNIT = 2 << 20  # the claims' granule (share.c's SHARE_UNIT)
DEFAULT_SHARE_GROWTH = 32 << 20  # share.c's SHARE_GROWTH


MAX_SHARE_GROWTH = 1 << 40


def share_growth_from_env() -> int | None:
    """``BRIDGE_SHARE_GROWTH`` in bytes (None when unset or empty): a size as every size
    variable takes it (``4194304``, ``4MiB``), a positive multiple of 2 MiB up to 1 TiB.

    Raises
    ------
    ValueError
        Naming the variable and its value, with the forms it takes.
    """
    size = size_from_env(SHARE_GROWTH_ENV, total=None, of=None)
    if size is None:
        return None
    if not 0 < size <= MAX_SHARE_GROWTH or size % SHARE_UNIT:
        raise ValueError(
            f"{SHARE_GROWTH_ENV}={os.environ.get(SHARE_GROWTH_ENV)!r} is not a valid growth: "
            f"it is {format_bytes(size)} ({size} bytes); write a positive multiple of 2 MiB "
            "up to 1 TiB, as bytes (4194304) or with a unit (4MiB, 32MiB)."
        )
    return size


DEFAULT_SHARE = "default"  # share=True
DEFAULT_DIR = "/dev/shm"
NAME_MAX = 63
UNRESPONSIVE_S = 1.0  # a trim request unanswered this long: the member is unresponsive
_LAYOUT = core.share_layout()
_TAGS = TAG_NAMES  # the core's framework tags by name


def share_name(share: object) -> str | None:
    """The share name ``unify(share=...)`` stands for; None for no share.

    ``None``: ``BRIDGE_SHARE`` if set (and not empty), else no share.
    ``False``: no share. ``True``: the default share. A string: that name.

    Raises
    ------
    ValueError
        For a name that is empty, longer than 63 characters, or not printable,
        and for anything else than None, a bool or a string.
    """
    where = "share"
    if share is None:
        raw = os.environ.get(SHARE_ENV, "")
        share = raw if raw.strip() else None  # empty or blank: unset, as every variable
        where = SHARE_ENV
        if share is None:
            return None
    if share is False:
        return None
    if share is True:
        return DEFAULT_SHARE
    if not isinstance(share, str):
        raise ValueError(
            f"share={share!r}: pass a name (a string), True for the default share, or None"
        )
    if not 0 < len(share) <= NAME_MAX or not share.isprintable() or share != share.strip():
        raise ValueError(
            f"{where}={share!r}: a share name must be 1 to {NAME_MAX} printable characters, "
            "without spaces at either end"
        )
    return share


def share_dir() -> str:
    """The directory of the share files: ``BRIDGE_SHARE_DIR``, else ``/dev/shm``."""
    return os.environ.get(SHARE_DIR_ENV) or DEFAULT_DIR


def join(device: int, name: str, budget: int) -> None:
    """Make this process a member of the share ``name`` on a device's GPU.

    Parameters
    ----------
    device : int
        The device, in this process's numbering (set up already).
    name : str
        The share's name (see :func:`share_name`).
    budget : int
        Bytes; 0 adopts the budget of the share, which must then exist.

    Raises
    ------
    BridgeError
        When the share's file cannot be used (another user's, readable by
        others, corrupt, a symbolic link), the budget differs from the
        share's (both named), the share has no free slot, or this process
        already uses another share on that GPU. The message says what to do.
    ValueError
        For a bad ``BRIDGE_SHARE_GROWTH``.
    """
    growth = share_growth_from_env()
    mine = membership(device)
    if mine is not None:
        if mine["name"] != name:
            raise BridgeError(
                f"this process already uses the share {mine['name']!r} on device {device} "
                f"(budget {format_bytes(mine['budget'])}); a process belongs to one share per "
                f"GPU, so it cannot join {name!r} too. Use share={mine['name']!r}, or another "
                "process for the other share."
            )
        if budget and mine["budget"] not in (budget, budget // SHARE_UNIT * SHARE_UNIT):
            raise BridgeError(
                f"this process is in the share {name!r} on device {device}, whose budget is "
                f"{format_bytes(mine['budget'])} ({mine['budget']} bytes); a budget of "
                f"{format_bytes(budget)} ({budget} bytes) cannot apply to it. Pass the share's "
                "budget or none (the share's applies), or use another share name."
            )
        return
    core.share_set_growth(growth or 0)
    check(
        core.share_join(device, name, share_dir(), budget), what="joining the share", device=device
    )


def membership(device: int) -> dict | None:
    """This process's membership figures on a device (``None`` when it is in no share)."""
    rc, info = core.share_stats(device)
    check(rc, what="reading the share", device=device)
    return dict(info) if info is not None else None


# ---- reading the files (the stats command) ----


@dataclasses.dataclass(frozen=True)
class Member:
    """One process of a share, as its slot says.

    Attributes
    ----------
    pid : int
    device : int
        The GPU's ordinal in that process (its ``CUDA_VISIBLE_DEVICES`` view).
    alive : bool
        The process exists, started when the slot says, and maps the share's
        file (a slot naming any other process is not believed).
    claim : int
        Bytes the member may hold on the GPU (its pool, cached blocks included).
    by_framework : dict[str, int]
        Live bytes per framework (``cupy``, ``torch``, ``other``: JAX's and
        anyone else's bytes in its pool), as the member last published them.
    cached : int
        The bridge's cached blocks in the member (idle; part of the claim).
    pool_reserved : int
        The member's pool, as the driver reported it (``RESERVED_MEM_CURRENT``).
    unresponsive : bool
        A trim request to it has gone unanswered for more than a second.
    age : float
        Seconds since the member last published its figures.
    overshoots : int
        Pool growths its claim did not cover in advance.
    worker : str
        What the process said it is (:func:`set_worker_label`: a Dask worker's
        name and address, a Ray actor or task); empty when it said nothing.
    """

    pid: int
    device: int
    alive: bool
    claim: int
    by_framework: dict[str, int]
    cached: int
    pool_reserved: int
    unresponsive: bool
    age: float
    overshoots: int
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class Share:
    """One share file: a share name on one GPU.

    Attributes
    ----------
    name : str
    uuid : str
        The GPU (``GPU-...``, as ``nvidia-smi -L`` writes it).
    path : str
    budget : int
    claimed : int
        The sum of the members' claims. A raise is visible while it is
        checked against the budget, so this may show above ``budget`` for a
        moment; what the members are admitted to hold never is.
    members : tuple[Member, ...]
    error : str or None
        Why the file could not be read (then the other figures are empty).
    """

    name: str
    uuid: str
    path: str
    budget: int = 0
    claimed: int = 0
    members: tuple[Member, ...] = ()
    error: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _u64(buf: bytes, off: int) -> int:
    return int(struct.unpack_from("<Q", buf, off)[0])


def _u32(buf: bytes, off: int) -> int:
    return int(struct.unpack_from("<I", buf, off)[0])


def _maps(pid: int, path: str) -> bool | None:
    """Whether process ``pid`` maps ``path``; None when that cannot be read."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip("\n").endswith(path) for line in f)
    except FileNotFoundError:
        return False
    except OSError:
        return None


def _start_time(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    return int(fields[19]), fields[0]


def _alive(pid: int, start: int, path: str) -> bool:
    if not 0 < pid < (1 << int(_LAYOUT["pid_bits"])):
        return False
    st = _start_time(pid)
    if st is None:
        return False
    started, state = st
    if state in ("Z", "X") or (start and started != start):
        return False
    return _maps(pid, os.path.realpath(path)) is not False


def _start_of(buf: bytes, o: int, word: int) -> int:
    """The slot's start time, or 0 while it is a former owner's (the new one is setting up)."""
    gen = word >> (int(_LAYOUT["unit_bits"]) + int(_LAYOUT["pid_bits"]))
    if _u32(buf, o + _LAYOUT["off_fields_gen"]) != gen & 0xFFFFFFFF:
        return 0
    return _u64(buf, o + _LAYOUT["off_start"])


def _read_share(path: str, uid: int, labels: dict[int, str]) -> Share:
    """One file, read without trusting it: every figure checked, never an exception."""
    base = os.path.basename(path)
    lay = _LAYOUT
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return Share(name="?", uuid="?", path=path, error=f"cannot open it: {exc.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != uid:
            why = f"it belongs to uid {st.st_uid}, not to this user"
        elif st.st_mode & 0o077:
            why = f"other users may read or write it (mode {stat.S_IMODE(st.st_mode):o})"
        elif st.st_size != lay["file_size"]:
            why = f"its size is {st.st_size} bytes, not {lay['file_size']}"
        else:
            why = None
        if why is not None:
            return Share(name="?", uuid="?", path=path, error=f"not used ({why})")
        buf = os.read(fd, int(lay["file_size"]))
    finally:
        os.close(fd)
    if len(buf) != lay["file_size"]:
        return Share(name="?", uuid="?", path=path, error="it could not be read whole")
    fields = struct.unpack_from("<QIIIIQ", buf, 0)
    expected = (
        lay["magic"],
        lay["version"],
        lay["header_size"],
        lay["slot_size"],
        lay["nslots"],
        lay["unit"],
    )
    if fields != expected:
        return Share(name="?", uuid="?", path=path, error=f"{base} is corrupt or not bridge's")
    raw_name = buf[lay["off_name"] : lay["off_name"] + NAME_MAX + 1]
    name = raw_name.split(b"\0", 1)[0].decode("utf-8", errors="replace")
    uuid = _uuid_text(buf[lay["off_uuid"] : lay["off_uuid"] + 16])
    if _u32(buf, lay["off_uid"]) != uid:
        return Share(name=name, uuid=uuid, path=path, error="its header names another user")
    budget = _u64(buf, lay["off_budget"])
    unit, ubits, pbits = int(lay["unit"]), int(lay["unit_bits"]), int(lay["pid_bits"])
    now = time.monotonic()
    members = []
    claimed = 0
    for i in range(int(lay["nslots"])):
        o = int(lay["header_size"]) + i * int(lay["slot_size"])
        word = _u64(buf, o + lay["off_word"])
        claim = (word & ((1 << ubits) - 1)) * unit
        pid = (word >> ubits) & ((1 << pbits) - 1)
        claimed += claim
        if pid == 0:
            continue
        tags = [_u64(buf, o + lay["off_tag_bytes"] + 8 * t) for t in range(len(_TAGS))]
        by = {name: tags[t] for t, name in _TAGS.items() if t != core.TAG_OTHER}
        by["other"] = tags[core.TAG_OTHER] + _u64(buf, o + lay["off_outside"])
        req, done = _u32(buf, o + lay["off_trim_req"]), _u32(buf, o + lay["off_trim_done"])
        asked = _u64(buf, o + lay["off_asked_at"]) / 1e9
        beat = _u64(buf, o + lay["off_heartbeat"]) / 1e9
        members.append(
            Member(
                pid=pid,
                device=struct.unpack_from("<i", buf, o + lay["off_device"])[0],
                alive=_alive(pid, _start_of(buf, o, word), path),
                claim=claim,
                by_framework=by,
                cached=_u64(buf, o + lay["off_cached"]),
                pool_reserved=_u64(buf, o + lay["off_pool_reserved"]),
                unresponsive=req != done and asked > 0 and now - asked > UNRESPONSIVE_S,
                age=max(0.0, now - beat) if beat else float("inf"),
                overshoots=_u32(buf, o + lay["off_overshoots"]),
                worker=labels.get(pid, ""),
            )
        )
    return Share(
        name=name, uuid=uuid, path=path, budget=budget, claimed=claimed, members=tuple(members)
    )


def list_shares(directory: str | None = None) -> list[Share]:
    """Every share file of this user in the share directory, read (never trusted).

    Parameters
    ----------
    directory : str, optional
        Where to look; :func:`share_dir` when None.

    Returns
    -------
    list of Share
        Sorted by name, then GPU. A file that cannot be used is listed with
        its ``error``; a missing directory gives an empty list.
    """
    directory = directory or share_dir()
    uid = os.geteuid()
    prefix = f"bridge-{uid}-"
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except OSError:
        return []
    labels = worker_labels(directory)
    shares = [_read_share(os.path.join(directory, n), uid, labels) for n in names]
    return sorted(shares, key=lambda s: (s.name, s.uuid, s.path))


# ---- what each process is (the cluster plugins name their workers) ----
LABEL_MAX = 200  # characters of a label that are kept


def _label_dir(directory: str | None = None) -> str:
    """The folder of the labels: beside the share files, one per user (its name is no
    share file's: those are ``bridge-<uid>-...``)."""
    return os.path.join(directory or share_dir(), f"bridge-{os.geteuid()}.workers")


def set_worker_label(text: str) -> None:
    """Say what this process is, for ``bridge stats`` (its ``worker`` column).

    The cluster plugins call it (``bridge.dask``: the worker's name and address,
    ``bridge.ray``: the actor or task and its share of the GPU). The label is a
    small file beside the share files, named by the pid and believed only while
    a process with that pid and start time exists; labels of ended processes go
    when the next one is written.

    Parameters
    ----------
    text : str
        One line (longer ones are cut at 200 characters).
    """
    folder = _label_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    pid = os.getpid()
    start = _start_time(pid)
    doc = {"start": start[0] if start else 0, "label": " ".join(str(text).split())[:LABEL_MAX]}
    tmp = os.path.join(folder, f".{pid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(folder, str(pid)))
    # one reading decides each file's process alive or ended: a label another process
    # writes meanwhile is either not seen or seen alive, never taken for an ended one's
    for gone in _scan_labels(folder)[1]:
        try:
            os.unlink(os.path.join(folder, str(gone)))
        except OSError:
            pass


def label_if_member(devices: Iterable[int], text: str) -> bool:
    """:func:`set_worker_label` where this process is in a share on one of these devices.

    Returns
    -------
    bool
        Whether the label was written. One that cannot be written (the folder
        is read-only) is a warning: a label is for people, the process runs
        without it.
    """
    if not any(membership(d) is not None for d in devices):
        return False
    try:
        set_worker_label(text)
    except OSError as exc:
        warnings.warn(
            f"bridge: could not write this process's label for `bridge stats` beside the share "
            f"files ({exc}); check that {share_dir()} (BRIDGE_SHARE_DIR) is writable",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def _scan_labels(folder: str) -> tuple[dict[int, str], list[int]]:
    """The label files: pid -> label of the living processes, and the pids of ended ones."""
    try:
        names = [n for n in os.listdir(folder) if n.isdigit()]
    except OSError:
        return {}, []
    uid = os.geteuid()
    living, ended = {}, []
    for name in names:
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            raw = os.read(fd, 4096) if stat.S_ISREG(st.st_mode) and st.st_uid == uid else b""
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw)
            start, label = int(doc["start"]), str(doc["label"])[:LABEL_MAX]
        except (ValueError, KeyError, TypeError):
            continue
        pid = int(name)
        now = _start_time(pid) if 0 < pid < (1 << int(_LAYOUT["pid_bits"])) else None
        if now is not None and now[1] not in ("Z", "X") and (not start or now[0] == start):
            living[pid] = label
        else:
            ended.append(pid)
    return living, ended


def worker_labels(directory: str | None = None) -> dict[int, str]:
    """What each living process of this user said it is (:func:`set_worker_label`).

    Returns
    -------
    dict of int to str
        pid -> label; processes that have ended are left out.
    """
    return _scan_labels(_label_dir(directory))[0]
