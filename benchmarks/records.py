"""Result files shared by the benchmarks: rows measured with timing.device_times, checked against the
run's copy ceiling, saved as they come into a JSON file named for the card they ran on."""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from typing import Callable

import jax

from timing import DeviceTimes


def card_name(device_kind: str) -> str:
    """A short lower-case name for the card: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" ->
    "h200", "cpu" -> "cpu"; names without a model number become a slug of the whole name."""
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", device_kind)
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "unknown"


def result_path(out_dir: str, stem: str) -> str:
    """<out_dir>/<stem>_<card>.json for the default device's card."""
    return os.path.join(out_dir, f"{stem}_{card_name(jax.devices()[0].device_kind)}.json")


def run_header(peak_gbps: float, **more) -> dict:
    """The fields every result file starts with: the card, jax, the date, the command, the copy
    ceiling of the run and how rows were timed."""
    device = jax.devices()[0]
    return dict(device=device.device_kind, card=card_name(device.device_kind),
                jax=jax.__version__, date=datetime.date.today().isoformat(),
                command=" ".join(["python", *sys.argv]), peak_gbps=peak_gbps,
                timing=("per-call device time: the median over calls of the sum of the call's "
                        "kernel durations in the JAX profiler's trace (benchmarks/timing.py); "
                        "spread = (max - min) / median over the calls"), **more)


class Recorder:
    """Rows of a result, each printed as it is measured and, with `path`, saved at once (the header
    plus the rows so far), so that a run cut short keeps what it measured.

    A row whose implied bandwidth (its `nbytes` over its time) exceeds the run's copy ceiling
    `peak_gbps` is physically impossible from HBM: it is measured again once, and if it still
    exceeds the ceiling it is kept with `us` None, the measured time under `flagged_us` and the
    reason under `flag`, never as a result.
    """

    def __init__(self, log: Callable[[str], None], path: str | None = None,
                 header: dict | None = None, peak_gbps: float = float("nan")):
        self.rows: list[dict] = []
        self.log, self.path, self.header, self.peak_gbps = log, path, header or {}, peak_gbps

    def save(self, **more) -> None:
        if self.path is not None:
            with open(self.path, "w") as f:
                json.dump(dict(self.header, **more, rows=self.rows), f, indent=1)

    def measure(self, label: str, measure: Callable[[], DeviceTimes], nbytes: float,
                **fields) -> dict:
        """Times one row with `measure()` (again when over the ceiling), records it and returns it.
        `fields` (op, backend, shape, ...) lead the row; `label` prefixes its log line."""
        times = measure()
        if self._over_ceiling(times.us, nbytes):
            times = measure()
        return self.add(label, times.summary(), nbytes, **fields)

    def add(self, label: str, summary: dict, nbytes: float, **fields) -> dict:
        """Records a row from a DeviceTimes.summary() (or a dict with at least `us`)."""
        us = summary["us"]
        gbps = nbytes / us / 1e3 if us > 0 else float("nan")
        row = dict(fields, **summary, gbps=gbps)
        if self._over_ceiling(us, nbytes):
            row.update(us=None, flagged_us=us, gbps=None,
                       flag=f"implied {gbps:.0f} GB/s exceeds the run's copy ceiling "
                            f"{self.peak_gbps:.0f} GB/s")
        self.rows.append(row)
        self.save()
        if row["us"] is None:
            self.log(f"  {label}: FLAGGED {us:.1f} us ({row['flag']})")
        else:
            spread = summary.get("spread")
            spread_text = f" spread {100 * spread:4.1f}%" if spread is not None else ""
            self.log(f"  {label}: {us:9.1f} us{spread_text} {gbps:8.1f} GB/s")
        return row

    def _over_ceiling(self, us: float, nbytes: float) -> bool:
        return us > 0 and self.peak_gbps == self.peak_gbps and nbytes / us / 1e3 > self.peak_gbps
