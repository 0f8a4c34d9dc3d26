# SPDX-License-Identifier: Apache-2.0
"""A memory timeline: per-framework bytes sampled over time, saved, and plotted.

>>> with bridge.record(interval=0.05) as rec:
...     train_step()
...     rec.mark("after step 1")
>>> rec.to_csv("memory.csv")
>>> rec.plot("memory.png")          # needs matplotlib: pip install 'gpumem-bridge[plot]'
"""

from __future__ import annotations

__all__ = ["Sample", "Recording", "record", "load", "FIELDS"]

import csv
import dataclasses
import json
import logging
import math
import os
import pathlib
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from bridge import _runtime
from bridge._errors import BridgeError
from bridge._version import DISTRIBUTION
from bridge.frameworks import COLORS
from bridge.pool import FRAMEWORKS, stats

log = logging.getLogger("bridge")

PathLike = str | os.PathLike
DeviceArg = int | Iterable[int] | None


class _ByFramework:
    @property
    def by_framework(self) -> dict[str, int]:
        """Live bytes per framework: ``{"cupy": ..., "torch": ..., ..., "other": ...}``."""
        return {f: getattr(self, f) for f in FRAMEWORKS}


@dataclasses.dataclass(frozen=True)
class _Reading(_ByFramework):
    """One reading of one device's pool.

    Attributes
    ----------
    t : float
        Seconds since the recording started.
    device : int
    label : str
        ``""`` for a periodic sample; the text given to :meth:`Recording.mark`.
    {frameworks}
        Live bytes per framework (:attr:`bridge.Stats.by_framework`), one
        field each, named by the registry (bridge.frameworks.FRAMEWORKS); 0
        in files written before a framework was counted.
    used : int
        Bytes in use in the pool, every framework (:attr:`bridge.Stats.used`).
    reserved : int
        Bytes the pool holds from the driver (:attr:`bridge.Stats.reserved`).
    limit : int
        The budget in bytes; 0 = no limit.
    waiting : int
        Threads waiting for memory others free at that instant
        (:attr:`bridge.Stats.waiting`).
    num_waits : int
        Allocations that waited so far (:attr:`bridge.Stats.num_waits`); the
        plot marks where it grew.
    """

    t: float
    device: int
    label: str
    used: int
    reserved: int
    limit: int
    waiting: int = 0
    num_waits: int = 0

    if TYPE_CHECKING:  # the frameworks' fields, added from the registry below

        def __getattr__(self, name: str) -> int: ...


if TYPE_CHECKING:
    Sample = _Reading
else:
    # _Reading's fields with one per framework after the label (bridge.frameworks.FRAMEWORKS,
    # the columns' order): a framework added to the registry is a field and a column
    # without a line here
    def _fields() -> list[tuple[str, Any, Any]]:
        out = []
        for fld in dataclasses.fields(_Reading):
            out.append((fld.name, fld.type, dataclasses.field(default=fld.default)))
            if fld.name == "label":
                out += [(f, int, dataclasses.field()) for f in FRAMEWORKS]
        return out

    Sample = dataclasses.make_dataclass("Sample", _fields(), bases=(_ByFramework,), frozen=True)
    Sample.__module__ = __name__
    Sample.__doc__ = (_Reading.__doc__ or "").replace(
        "{frameworks}", f"{', '.join(FRAMEWORKS)} : int"
    )

#: The columns of a recording's CSV (and the JSON's "fields"), in order.
FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


def _sample_of(row: Mapping[str, Any]) -> Sample:
    """A Sample from a CSV row (strings) or a JSON object."""
    return Sample(
        t=float(row["t"]),
        device=int(row["device"]),
        label=str(row["label"]),
        used=int(row["used"]),
        reserved=int(row["reserved"]),
        limit=int(row["limit"]),
        waiting=int(row.get("waiting") or 0),  # files written before waiting existed
        num_waits=int(row.get("num_waits") or 0),
        # files written before a framework was counted have no column of it
        **{f: int(row.get(f) or 0) for f in FRAMEWORKS},
    )


def _read(device: int, t: float, label: str) -> Sample:
    s = stats(device)
    return Sample(
        t=t,
        device=device,
        label=label,
        used=s.used,
        reserved=s.reserved,
        limit=s.limit,
        waiting=s.waiting,
        num_waits=s.num_waits,
        **s.by_framework,
    )


def _devices(device: DeviceArg) -> tuple[int, ...]:
    if device is None:
        devices = [_runtime.current_device()]
    else:
        devices = _runtime.resolve_devices(device)
    for d in devices:
        _runtime.ensure_device(d)
    return tuple(devices)


class Recording:
    """Samples of per-framework bytes, taken by a background thread and on :meth:`mark`.

    Use :func:`record` to make one. A recording keeps every sample in memory
    (one :class:`Sample` per device per ``interval``: 72,000 an hour at the
    default 0.05 s).

    Attributes
    ----------
    interval : float or None
        Seconds between periodic samples (None for a recording read from a file).
    devices : tuple of int
    samples : list of Sample
        In time order; grows while the recording runs.
    start_time : float or None
        ``time.time()`` when the recording started.
    errors : list of str
        Why sampling stopped early, if it did (logged as well).
    """

    def __init__(self, interval: float = 0.05, device: DeviceArg = None) -> None:
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not math.isfinite(interval)
            or interval <= 0
        ):
            raise ValueError(f"interval={interval!r}: pass a number of seconds > 0")
        self.interval: float | None = float(interval)
        self.devices: tuple[int, ...] = _devices(device)
        self.samples: list[Sample] = []
        self.start_time: float | None = None
        self.errors: list[str] = []
        self._t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- recording ----
    @property
    def running(self) -> bool:
        """Whether the background thread is sampling."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Recording:
        """Take a first sample and start the background thread.

        Raises
        ------
        BridgeError
            When the recording is already running.
        """
        if self._thread is not None:
            raise BridgeError("this recording is already running; stop() it first")
        self._stop.clear()
        if self.start_time is None:  # a restarted recording keeps its clock
            self._t0 = time.monotonic()
            self.start_time = time.time()
        self._sample("")
        self._thread = threading.Thread(target=self._run, name="bridge-timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a last sample (no-op when not running)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        try:
            self._sample("")
        except Exception as exc:  # noqa: BLE001 - stopping never raises over the user's error
            self.errors.append(f"last sample: {exc}")

    def mark(self, label: str) -> None:
        """Take a sample of every device now, labelled (a vertical line on the plot).

        Parameters
        ----------
        label : str

        Raises
        ------
        BridgeError
            When the recording is not running.
        """
        if not isinstance(label, str):
            raise ValueError(f"label={label!r}: pass a str")
        if self._thread is None:
            raise BridgeError(
                "mark() needs a running recording: call it inside "
                "`with bridge.record() as rec:` or after rec.start()"
            )
        self._sample(label)

    def _sample(self, label: str) -> None:
        with self._lock:  # the samples of one instant stay together and in order
            t = time.monotonic() - self._t0
            self.samples.extend(_read(d, t, label) for d in self.devices)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._sample("")
            except Exception as exc:  # noqa: BLE001 - a sampling thread never dies loudly
                self.errors.append(str(exc))
                log.warning("bridge.record: sampling stopped: %s", exc)
                return

    def __enter__(self) -> Recording:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"<bridge.Recording {state} devices={list(self.devices)} samples={len(self.samples)}>"
        )

    # ---- saving and loading ----
    def to_csv(self, path: PathLike) -> pathlib.Path:
        """Write the samples as CSV, one row per sample, columns :data:`FIELDS`.

        Returns
        -------
        pathlib.Path
        """
        path = pathlib.Path(path)
        with self._lock:
            rows = list(self.samples)
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(FIELDS)
            for s in rows:
                w.writerow([repr(s.t) if f == "t" else getattr(s, f) for f in FIELDS])
        return path

    def to_json(self, path: PathLike) -> pathlib.Path:
        """Write ``{interval, devices, start_time, samples: [{field: value}]}`` as JSON.

        Returns
        -------
        pathlib.Path
        """
        path = pathlib.Path(path)
        with self._lock:
            rows = [dataclasses.asdict(s) for s in self.samples]
        doc = {
            "interval": self.interval,
            "devices": list(self.devices),
            "start_time": self.start_time,
            "fields": list(FIELDS),
            "samples": rows,
        }
        path.write_text(json.dumps(doc, indent=1))
        return path

    @classmethod
    def _loaded(
        cls,
        samples: list[Sample],
        interval: float | None,
        devices: Iterable[int],
        start_time: float | None,
    ) -> Recording:
        rec = cls.__new__(cls)
        rec.interval, rec.start_time, rec.samples, rec.errors = interval, start_time, samples, []
        rec.devices = tuple(devices) or tuple(sorted({s.device for s in samples}))
        rec._t0, rec._lock, rec._stop, rec._thread = 0.0, threading.Lock(), threading.Event(), None
        return rec

    @classmethod
    def from_csv(cls, path: PathLike) -> Recording:
        """A stopped recording with the samples of a file written by :meth:`to_csv`."""
        with pathlib.Path(path).open(newline="") as fh:
            samples = [_sample_of(row) for row in csv.DictReader(fh)]
        return cls._loaded(samples, None, (), None)

    @classmethod
    def from_json(cls, path: PathLike) -> Recording:
        """A stopped recording with the samples of a file written by :meth:`to_json`."""
        doc = json.loads(pathlib.Path(path).read_text())
        samples = [_sample_of(r) for r in doc["samples"]]
        return cls._loaded(
            samples, doc.get("interval"), doc.get("devices", ()), doc.get("start_time")
        )

    # ---- plotting ----
    def plot(self, path: PathLike, *, title: str | None = None, dpi: int = 120) -> pathlib.Path:
        """Draw a PNG: per-framework bytes stacked over time, the budget, the marks.

        One panel per device. Needs matplotlib (``pip install 'gpumem-bridge[plot]'``).

        Parameters
        ----------
        path : str or os.PathLike
            Where to write the PNG.
        title : str, optional
        dpi : int

        Returns
        -------
        pathlib.Path

        Raises
        ------
        ImportError
            When matplotlib is not installed.
        ValueError
            When there are no samples.
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.ticker import MaxNLocator
        except ImportError as exc:
            raise ImportError(
                "Recording.plot needs matplotlib, which is not installed: "
                f"pip install '{DISTRIBUTION}[plot]' (or pip install matplotlib). "
                "to_csv() and to_json() work without it."
            ) from exc
        with self._lock:
            samples = list(self.samples)
        if not samples:
            raise ValueError("this recording has no samples to plot")
        devices = sorted({s.device for s in samples})
        peak = max(max(s.used, s.limit, sum(s.by_framework.values())) for s in samples)
        scale, unit, top = axis_scale(peak)
        fig = Figure(figsize=(10, 1.2 + 3.0 * len(devices)))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(devices), 1, squeeze=False, sharex=True)[:, 0]
        colors = COLORS
        for ax, d in zip(axes, devices, strict=True):
            ss = [s for s in samples if s.device == d]
            t = [s.t for s in ss]
            ax.stackplot(
                t,
                *[[getattr(s, f) / scale for s in ss] for f in FRAMEWORKS],
                labels=list(FRAMEWORKS),
                colors=[colors[f] for f in FRAMEWORKS],
                alpha=0.85,
                step="post",
            )  # bytes hold until the next sample
            if any(s.limit for s in ss):
                ax.step(
                    t,
                    [s.limit / scale if s.limit else float("nan") for s in ss],
                    where="post",
                    color="#c44e52",
                    linestyle="--",
                    linewidth=1.5,
                    label="budget",
                )
            # where allocations waited for memory: a band along the bottom
            waited = [
                (a.t, b.t)
                for a, b in zip(ss, ss[1:], strict=False)
                if b.waiting or b.num_waits > a.num_waits
            ]
            for i, (t0, t1) in enumerate(waited):
                ax.axvspan(
                    t0, t1, ymin=0.0, ymax=0.03, color="#c44e52", alpha=0.9,
                    label="waiting for memory" if i == 0 else None,
                )  # fmt: skip
            for s in ss:
                if s.label:
                    ax.axvline(s.t, color="black", linewidth=0.8, linestyle=":")
                    ax.annotate(
                        s.label,
                        (s.t, 0.98),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        va="top",
                        ha="right",
                        fontsize=8,
                    )
            ax.set_ylabel(f"device {d} ({unit})")
            ax.set_ylim(bottom=0, top=top)
            if unit == "B":  # whole bytes: no 0.05-byte ticks
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        axes[0].legend(
            loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, ncol=5, frameon=False
        )
        axes[-1].set_xlabel("seconds")
        fig.suptitle(title or "bridge memory timeline")
        fig.tight_layout()
        path = pathlib.Path(path)
        fig.savefig(path, dpi=dpi, format="png")
        return path


def axis_scale(peak: int) -> tuple[float, str, float | None]:
    """The unit of a plot's byte axis for its highest value: (bytes per unit, unit, top).

    ``top`` is 1 unit for an axis where nothing was ever held (peak 0), which
    would otherwise be labelled in fractions of a byte; None lets the plot choose.
    """
    for k, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if peak >= 1024**k:
            return 1024.0**k, unit, None
    return 1.0, "B", (1.0 if peak == 0 else None)


def record(interval: float = 0.05, device: DeviceArg = None) -> Recording:
    """Record per-framework bytes over time; use as a context manager.

    Parameters
    ----------
    interval : float
        Seconds between samples (> 0). Samples are also taken at the start,
        the end, and at each :meth:`Recording.mark`.
    device : int, list of int, or None
        Devices to sample; the current device when None.

    Returns
    -------
    Recording
        Not yet started: ``with`` starts and stops it (or call ``start()``
        and ``stop()``).

    Raises
    ------
    ValueError
        For a bad interval or device.
    BridgeError
        When there is no CUDA driver or device.
    """
    return Recording(interval, device)


def load(path: PathLike) -> Recording:
    """A recording saved by :meth:`Recording.to_csv` or :meth:`Recording.to_json`.

    The format follows the suffix: ``.json`` is JSON, anything else CSV.
    """
    if pathlib.Path(path).suffix.lower() == ".json":
        return Recording.from_json(path)
    return Recording.from_csv(path)
