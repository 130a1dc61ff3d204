"""The layout fields of a llama.cpp state file (what `write_state` needs besides tokens and
K/V), and the bounds its parser holds a file to: one set, so that a layout stored in an
archive's metadata is checked exactly as a file would be before anything is written."""

from __future__ import annotations

from seqkv_cli.errors import SeqkvError

MAX_STREAMS = 4096
MAX_ARCH_BYTES = 256
TOKEN_FORMS = ("plain", "server-v1")
# ggml_type ids (ggml/include/ggml.h) of the cache types seqkv reads, with element sizes.
GGML_TYPES = {0: ("f32", 4), 1: ("f16", 2), 30: ("bf16", 2)}
GGML_TYPE_IDS = {name: i for i, (name, _) in GGML_TYPES.items()}
INT32 = (-(1 << 31), (1 << 31) - 1)


def check_arch(arch: str, name: str) -> None:
    """llama.cpp's architecture names: short ASCII letters, digits, `-` and `_`."""
    if len(arch) > MAX_ARCH_BYTES:
        raise SeqkvError(f"{name}: architecture name of {len(arch)} bytes (at most 256)")
    if not (arch.isascii() and arch.replace("-", "").replace("_", "").isalnum()):
        raise SeqkvError(f"{name}: architecture name {arch[:60]!r} is not a llama.cpp name")


def check_layout(layout: object, name: str) -> dict:
    """The layout fields `write_state` takes, checked against what `parse_state` accepts.

    The fields come from a session's stored metadata, which any archive (or `add(meta=...)`)
    can set: each is checked for type and range here, so a bad one is one line naming it and
    no state file seqkv's own parser would refuse is ever written.
    """
    if not isinstance(layout, dict):
        raise SeqkvError(f"{name}: the llama.cpp layout is {type(layout).__name__}, not a table")

    def brief(value) -> str:  # a crafted value may be nested past repr's recursion limit
        return f"a {type(value).__name__}" if isinstance(value, dict | list) else repr(value)[:60]

    def field(key: str, allowed=None, ints: tuple[int, int] | None = None):
        if key not in layout:
            raise SeqkvError(f"{name}: the llama.cpp layout has no {key!r}")
        value = layout[key]
        if ints is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise SeqkvError(f"{name}: layout {key!r} is {brief(value)}, not a whole number")
            if not ints[0] <= value <= ints[1]:
                raise SeqkvError(f"{name}: layout {key!r} is {value}, outside {ints[0]}..{ints[1]}")
        elif value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise SeqkvError(f"{name}: layout {key!r} is {brief(value)}; one of {shown}")
        return value

    out = {
        "kind": field("kind", ("session", "sequence")),
        "token_form": field("token_form", TOKEN_FORMS),
        "n_stream": field("n_stream", ints=(1, MAX_STREAMS)),
        "seq_id": field("seq_id", ints=INT32),
        "v_trans": field("v_trans", (True, False)),
        "k_type": field("k_type", tuple(GGML_TYPE_IDS)),
        "v_type": field("v_type", tuple(GGML_TYPE_IDS)),
    }
    out["v_trans"] = bool(out["v_trans"])
    out["stream"] = field("stream", ints=(0, out["n_stream"] - 1))
    arch = layout.get("arch")
    if out["kind"] == "session":
        if not isinstance(arch, str):
            raise SeqkvError(f"{name}: a session file needs an arch name, not {brief(arch)}")
        check_arch(arch, name)
    out["arch"] = arch if out["kind"] == "session" else None
    return out
