"""Plot the Grafana dashboard's panels from a Prometheus server with matplotlib.

Grafana is not available here; this draws the same queries (variables substituted) over a
time range, one subplot per panel in the dashboard's order, so the picture in docs/ shows what
the dashboard shows. Used by tests/integration/test_prometheus_scrape.py (ADAPTIS_UPDATE_DOCS=1
writes docs/dashboard.png).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import promkit

# Grafana's $__rate_interval is at least four scrape intervals; the test scrapes every second.
RATE_INTERVAL = "15s"


def concrete(expr: str, *, job: str, rank: str = ".*", namespace: str = ".*") -> str:
    """The query Grafana would send with these variable values."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", namespace)
            .replace("$job", job).replace("$rank", rank))


def legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


_SCALE = {"percentunit": (100.0, "%"), "bytes": (1 / 2**20, "MiB"), "Bps": (1 / 2**10, "KiB/s"),
          "s": (1.0, "s"), "short": (1.0, ""), "none": (1.0, "")}


def plot(board: Mapping[str, Any], prom: promkit.PrometheusServer, *, start: float, end: float,
         job: str, out: Path, step: float = 1.0) -> int:
    """Draw every panel to ``out`` (PNG); returns how many panels were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in board["panels"] if p["type"] != "row"]
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.2 * rows), squeeze=False)
    drawn = 0
    for index, panel in enumerate(panels):
        ax = axes[index // cols][index % cols]
        unit = panel["fieldConfig"]["defaults"].get("unit", "none")
        scale, suffix = _SCALE.get(unit, (1.0, ""))
        for target in panel["targets"]:
            dashed = "predicted" in target.get("legendFormat", "")
            for series in prom.query_range(concrete(target["expr"], job=job), start=start,
                                           end=end, step=step):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                ax.plot(xs, ys, linestyle="--" if dashed else "-", linewidth=1.6,
                        label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_ylabel(suffix)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        drawn += 1
    for index in range(len(panels), rows * cols):
        axes[index // cols][index % cols].axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the job started")
    fig.suptitle(f"{board['title']} (job {job}, plotted from Prometheus)", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn
