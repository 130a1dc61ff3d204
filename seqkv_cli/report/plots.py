"""PNG charts of a report (matplotlib, no display needed): one set per model.

* cumulative bits vs position, per codec, log scale, with the cumulative surprisal (the
  sequential bound) — "mean session": each position averages the sessions that reach it;
* marginal bits per position in windows, per codec, with the mean surprisal curve;
* rate-distortion of the lossy rows: bits per position vs attention-output error.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from seqkv_cli.report.aggregate import CodecSummary, by_codec
from seqkv_cli.report.collect import Report
from seqkv_cli.report.outputs import OutputSet
from seqkv_cli.report.table import codec_label
from seqkv_cli.report.windows import mean_curve, windows

PLOTS = ("cumulative_bits", "marginal_bits", "rate_distortion")
BOUND_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.5}


def write_plots(out: OutputSet, report: Report, folder: Path) -> list[Path]:
    """Write every chart into `folder` (which must exist); returns the paths written."""
    written = []
    for group in report.groups:
        rows = [r for r in report.rows if r.model_fingerprint == group.fingerprint]
        if not rows:
            continue
        suffix = "" if len(report.groups) == 1 else f"-{_slug(group.name)}-{group.fingerprint[:8]}"
        summaries = by_codec(rows)
        n = len({r.id for r in rows})
        title = f"{group.name} ({n} session{'' if n == 1 else 's'})"
        for name, draw in zip(PLOTS, (_cumulative, _marginal, _rate_distortion), strict=True):
            fig = draw(summaries, title, report.options.window)
            target = folder / f"{name}{suffix}.png"
            out.write(target, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))
            written.append(target)
    return written


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    return fig, fig.subplots()


def _label(s: CodecSummary) -> str:
    return codec_label(s.rows[0])


def _surprisal(summaries: list[CodecSummary]) -> np.ndarray | None:
    """Mean surprisal per position (position 0 has none) over the sessions that have it."""
    seen, curves = set(), []
    for s in summaries:
        for r in s.rows:
            if r.surprisal is not None and r.id not in seen:
                seen.add(r.id)
                curves.append(np.concatenate([[np.nan], r.surprisal]))
    return mean_curve(curves) if curves else None


def _mean_curves(summaries):
    """(codec summary, its bits per position averaged over its sessions) for each codec."""
    for s in summaries:
        yield s, mean_curve([r.curve for r in s.rows if r.curve is not None])


def _finish(fig, xlabel: str, ylabel: str, title: str, log_y: bool = True):
    """The axes every plot shares: labels, title, grid and legend (a log y axis)."""
    [ax] = fig.axes
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    return fig


def _cumulative(summaries, title: str, window: int):
    fig, ax = _figure()
    for s, curve in _mean_curves(summaries):
        x = np.arange(1, len(curve) + 1)
        ax.plot(x, np.cumsum(curve), label=_label(s), linewidth=1.8)
    surprisal = _surprisal(summaries)
    if surprisal is not None:
        cum = np.cumsum(np.nan_to_num(surprisal))
        cum[cum <= 0] = np.nan  # nothing spent before the second token: off a log axis
        ax.plot(np.arange(1, len(cum) + 1), cum, label="Σ surprisal (log2 PP bound)", **BOUND_STYLE)
    return _finish(
        fig,
        "token position (tokens of context)",
        "cumulative bits stored (log scale)",
        f"Cumulative bits vs position — {title}, mean over sessions",
    )


def _marginal(summaries, title: str, window: int):
    fig, ax = _figure()
    for s, curve in _mean_curves(summaries):
        w = windows(curve, None, window)
        mid = [(x["start"] + x["end"] - 1) / 2 for x in w]
        ax.plot(mid, [x["bits_per_position"] for x in w], marker="o", ms=3, label=_label(s))
    surprisal = _surprisal(summaries)
    if surprisal is not None:
        w = windows(surprisal, surprisal[1:], window)  # index j: position j + 1
        mid = [(x["start"] + x["end"] - 1) / 2 for x in w if x["surprisal"] is not None]
        ys = [x["surprisal"] for x in w if x["surprisal"] is not None]
        ax.plot(mid, ys, label="surprisal, -log2 P(token) (bound)", **BOUND_STYLE)
    return _finish(
        fig,
        f"token position (window centre, {window} positions per window)",
        "marginal bits per position (log scale)",
        f"Marginal cost vs context length — {title}",
    )


def _rate_distortion(summaries, title: str, window: int):
    fig, ax = _figure()
    lossy = [s for s in summaries if s.exact is False and s.mean("attention_error") is not None]
    for s in lossy:
        x, y = s.bits_per_position, max(s.mean("attention_error"), 1e-12)
        ax.scatter([x], [y], s=60, label=_label(s), zorder=3)
        ax.annotate(_label(s), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    for s in summaries:  # exact codecs have no error to plot: their rate, as a line
        if s.exact:
            ax.axvline(s.bits_per_position, linestyle=":", color="grey", linewidth=1.2)
            ax.annotate(
                f"{_label(s)} (exact)",
                (s.bits_per_position, 0.02),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=8,
                color="dimgrey",
                xytext=(3, 0),
                textcoords="offset points",
            )
    ppl = [s.log2_ppl for s in summaries if s.log2_ppl is not None]
    if ppl:
        ax.axvline(float(np.mean(ppl)), label="log2 PP (sequential bound)", **BOUND_STYLE)
    if not lossy:
        ax.text(0.5, 0.5, "no lossy codec in this report", transform=ax.transAxes, ha="center")
    ax.set_xscale("log")
    ax.margins(x=0.2)
    return _finish(
        fig,
        "bits per token position (log scale)",
        "attention-output relative L2 error",
        f"Rate-distortion of lossy codecs — {title}",
        log_y=bool(lossy),
    )


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"
