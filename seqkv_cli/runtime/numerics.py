"""Numeric paths: which canonical forward a file was coded under, and building it.

A model-coded stream (``seq``, ``seq-fast``) decodes only under the forward that encoded it,
so the codec config names its path and a decoder that cannot honour it refuses:

* ``portable-fx53-v3`` (default for new files, seqkv 0.5): the model's own transformers code
  run under the portable definition (`runtime.portable`): the same bits on any IEEE machine,
  thread count, ISA level, BLAS or device; one fixed-point integer per activation, its row
  scaled by its L1 norm, so one product per linear where v2 took two.
* ``portable-fx53-v2`` (seqkv 0.3-0.4): activations carry two integers scaled by their row's
  peak; files written with it keep decoding on it.
* ``portable-fx53-v1`` (seqkv 0.2.0): one integer per activation scaled by its row's peak,
  ~12x further from the float model's K/V; files written with it keep decoding on it.
* ``canonical-fp32-rb8-kb256-v1`` (legacy): the lean fp32 Llama forward of earlier versions.
  Bit-exact only on the machine class that wrote the file (same ISA, BLAS and thread split);
  kept so that older files decode, never written by default.

This module is the top of the runtime that knows both paths: it imports `canonical` and
`portable.model`, and neither imports it (their shared surprisal helpers are in
`runtime.surprisal`).
"""

from __future__ import annotations

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.forward import CanonicalForward

PORTABLE = "portable-fx53-v3"
PORTABLE_V2 = "portable-fx53-v2"
PORTABLE_V1 = "portable-fx53-v1"
LEGACY = "canonical-fp32-rb8-kb256-v1"
DEFAULT = PORTABLE
PORTABLE_PATHS = (PORTABLE, PORTABLE_V2, PORTABLE_V1)
PATHS = {
    PORTABLE: "portable: same bits on any IEEE machine, thread count, ISA, BLAS or device",
    PORTABLE_V2: "portable, second version (seqkv 0.3-0.4): two integers per activation",
    PORTABLE_V1: "portable, first version (seqkv 0.2.0): one integer per activation",
    LEGACY: "legacy fp32 forward: same machine class only (llama, mistral, qwen2)",
}

ALIASES = {
    "portable": PORTABLE,
    "portable-v2": PORTABLE_V2,
    "portable-v1": PORTABLE_V1,
    "legacy": LEGACY,
}


def resolve(name: str | None) -> str:
    """A path id from an id or an alias ('portable', 'legacy'); None gives the default."""
    if name is None:
        return DEFAULT
    path = ALIASES.get(name, name)
    if path not in PATHS:
        raise SeqkvError(
            f"unknown numeric path {name!r}; choose portable ({PORTABLE}), portable-v2 "
            f"({PORTABLE_V2}), portable-v1 ({PORTABLE_V1}) or legacy ({LEGACY})"
        )
    return path


def check_path(path: str) -> str:
    if path not in PATHS:
        raise SeqkvError(
            f"numeric path {path!r} is unknown to this seqkv (it knows {', '.join(PATHS)}); "
            "decode the file with the seqkv version that wrote it"
        )
    return path


def build_canonical(hf_model, path: str = DEFAULT, store=None) -> CanonicalForward:
    """The canonical forward of `hf_model` on `path` (refuses an unknown path). ``store``:
    the `checkpoint.WeightStore` holding the model's weights, where seqkv loaded it (the
    legacy path needs them in the module: pass the model after `LoadedModel.fp32_model`)."""
    check_path(path)
    if path in PORTABLE_PATHS:
        from seqkv_cli.runtime.portable.model import PortableLM

        return PortableLM(hf_model, path, store)
    from seqkv_cli.runtime.devices import model_device
    from seqkv_cli.runtime.legacy import CanonicalLM, check_row_invariance

    where = model_device(hf_model)
    if where.type != "cpu":
        raise SeqkvError(
            f"the {LEGACY} path is defined by this machine class's CPU kernels and cannot run "
            f"on {where}; use --device cpu for files written on it"
        )

    if not check_row_invariance():
        raise SeqkvError(
            f"this machine's BLAS is not row-invariant; the {LEGACY} path cannot be "
            "reproduced here (files written on it decode only on their machine class)"
        )
    return CanonicalLM(hf_model)


def support(hf_model, store=None) -> dict[str, str]:
    """Per path: 'yes' or the one-line reason it cannot run `hf_model` here (`model info`).

    The portable path is probed for real: 6 tokens prefilled and stepped must agree bit for bit.
    """
    out = {}
    for path in PORTABLE_PATHS:
        try:
            canon = build_canonical(hf_model, path, store)
            ids = torch.arange(6) % canon.vocab_size
            a, b = canon.new_state(6), canon.new_state(6)
            whole = canon.forward(a, ids)
            steps = torch.cat([canon.forward(b, ids[i : i + 1]) for i in range(6)])
            same = torch.equal(whole, steps)
            out[path] = "yes" if same else "no: prefill and stepping differ"
        except SeqkvError as exc:
            out[path] = f"no: {exc}"
    from seqkv_cli.runtime.legacy import SUPPORTED_TYPES

    model_type = getattr(hf_model.config, "model_type", "?")
    out[LEGACY] = (
        "decode only (same machine class)"
        if model_type in SUPPORTED_TYPES
        else f"no: {model_type} is not a {'/'.join(SUPPORTED_TYPES)} model"
    )
    return out
