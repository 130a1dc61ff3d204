"""One report row: a session compressed by one codec, with everything measured about it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PARTS = ("tokens", "residual", "kv", "trie", "header")
TURBO3_BITS_PER_COMPONENT = 3  # the nominal rate of the 3-bit per-vector baseline (turbo3)


@dataclass
class Row:
    """Sizes in bits; errors None when not measured (no capture to compare with, --no-verify)."""

    id: str
    codec: str
    codec_config: dict
    model: str
    model_fingerprint: str
    source: str  # the .skv input, or "computed" (compressed from the capture for this report)
    role: str  # "subject" (gated) or "baseline" (shown for comparison)
    lossless: bool  # what the codec promises
    positions: int
    dtype: str
    components_per_position: int
    log2_ppl: float | None
    breakdown: dict[str, float]
    exact: bool | None = None
    max_abs_error: float | None = None
    rel_l2_error: float | None = None
    attention_error: float | None = None
    delta_log2_ppl: float | None = None
    ppl_ratio: float | None = None
    greedy_agreement: float | None = None
    greedy_prefix: int | None = None
    # measured while verifying: seconds from the start of the archive's decode until this
    # session was restored, and the archive's decode rate (tokens/s) on this machine
    restore_seconds: float | None = None
    restore_tokens_per_s: float | None = None
    # measured while verifying, for codecs that add a stored residual to predicted or
    # recomputed K/V: {"key": [...], "value": [...]}, per layer the 95th percentile of
    # |residual| (Capture.residual_p95); None for codecs that store K/V directly
    residual_p95: dict | None = None
    windows: list[dict] = field(default_factory=list)
    # per-position cost (bits) and surprisal: for plots, not serialised
    curve: np.ndarray | None = field(default=None, repr=False)
    surprisal: np.ndarray | None = field(default=None, repr=False)

    @property
    def bits_total(self) -> float:
        return float(sum(self.breakdown.values()))

    @property
    def bits_per_position(self) -> float:
        return self.bits_total / max(self.positions, 1)

    @property
    def gap_ratio(self) -> float | None:
        """bits/position ÷ log2 PP: 1.0 is the sequential entropy bound."""
        return self.bits_per_position / self.log2_ppl if self.log2_ppl else None

    @property
    def gap_bits(self) -> float | None:
        return None if self.log2_ppl is None else self.bits_per_position - self.log2_ppl

    @property
    def fp16_bits_per_position(self) -> int:
        return 16 * self.components_per_position

    def residual_p95_max(self, kind: str) -> float | None:
        """The largest layer's 95th percentile of |residual| for "key" or "value"."""
        layers = (self.residual_p95 or {}).get(kind)
        return max(layers) if layers else None

    @property
    def ratio_vs_fp16(self) -> float:
        return self.fp16_bits_per_position / max(self.bits_per_position, 1e-12)

    @property
    def ratio_vs_turbo3(self) -> float:
        nominal = TURBO3_BITS_PER_COMPONENT * self.components_per_position
        return nominal / max(self.bits_per_position, 1e-12)

    def to_json(self) -> dict:
        """The documented JSON object of one session x codec (docs/REPORT.md)."""
        out = {
            "id": self.id,
            "codec": self.codec,
            "codec_config": self.codec_config,
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "source": self.source,
            "role": self.role,
            "lossless": self.lossless,
            "positions": self.positions,
            "dtype": self.dtype,
            "components_per_position": self.components_per_position,
            "bits_total": self.bits_total,
            "bits_per_position": self.bits_per_position,
            "log2_ppl": self.log2_ppl,
            "gap_ratio": self.gap_ratio,
            "gap_bits": self.gap_bits,
            "breakdown": {p: self.breakdown.get(p, 0.0) for p in PARTS},
            "ratio_vs_fp16": self.ratio_vs_fp16,
            "ratio_vs_turbo3": self.ratio_vs_turbo3,
        }
        for key in FIDELITY:
            out[key] = getattr(self, key)
        out["restore_seconds"] = self.restore_seconds
        out["restore_tokens_per_s"] = self.restore_tokens_per_s
        out["residual_p95"] = self.residual_p95
        out["windows"] = self.windows
        return _finite(out)

    def to_flat(self) -> dict:
        """One CSV/Parquet record: breakdown flattened, windows summarised by first and last."""
        drop = ("breakdown", "windows", "residual_p95")
        record = {k: v for k, v in self.to_json().items() if k not in drop}
        record["residual_p95_key_max"] = self.residual_p95_max("key")
        record["residual_p95_value_max"] = self.residual_p95_max("value")
        record["codec_config"] = _config_text(self.codec_config)
        for part in PARTS:
            record[f"breakdown_{part}"] = self.breakdown.get(part, 0.0)
        first = self.windows[0]["bits_per_position"] if self.windows else None
        last = self.windows[-1]["bits_per_position"] if self.windows else None
        record["marginal_first_window"], record["marginal_last_window"] = first, last
        return record


FIDELITY = (
    "exact",
    "max_abs_error",
    "rel_l2_error",
    "attention_error",
    "delta_log2_ppl",
    "ppl_ratio",
    "greedy_agreement",
    "greedy_prefix",
)


def _config_text(config: dict) -> str:
    import json

    return json.dumps(config, sort_keys=True)


def _finite(value):
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _breakdown(byte_parts: dict[str, float]) -> dict[str, float]:
    """Bits per part; parts this version does not know are counted as header."""
    out = dict.fromkeys(PARTS, 0.0)
    for part, n in byte_parts.items():
        out[part if part in PARTS else "header"] += 8.0 * n
    return out


def row_from_entry(arc, entry: dict, acc: dict, group, role: str, source: str) -> Row:
    """The size columns of one container session (`acc`: its `account()` record)."""
    shapes = entry["shapes"]
    return Row(
        id=entry["id"],
        codec=arc.codec.codec_id,
        codec_config=arc.codec.get_config(),
        model=group.name,
        model_fingerprint=group.fingerprint,
        source=source,
        role=role,
        lossless=bool(arc.codec.lossless),
        positions=entry["positions"],
        dtype=entry["dtype"],
        components_per_position=2
        * shapes["num_layers"]
        * shapes["num_kv_heads"]
        * shapes["head_dim"],
        log2_ppl=entry.get("log2_ppl"),
        breakdown=_breakdown(acc["breakdown"]),
    )
