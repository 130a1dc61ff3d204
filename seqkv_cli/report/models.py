"""Which model a group of rows needs (seq rows, decoding, continuation) and where it comes from."""

from __future__ import annotations

from collections.abc import Sequence

from seqkv_cli.errors import SeqkvError
from seqkv_cli.report.inputs import ModelGroup


class ModelResolver:
    """Each `--model` first, then where the group's captures say their model came from (the
    embedded model or a hub id; a capture names no folder of the machine it was made on).

    A model is loaded once per spec and used only for groups whose fingerprint it has: a
    report may mix models, so each `--model` serves the groups of its own model, and groups
    of the embedded model or a hub model load their own.
    """

    def __init__(self, specs: str | Sequence[str] | None, notes: list[str], progress=None) -> None:
        self.specs = [specs] if isinstance(specs, str) else list(specs or [])
        self.notes, self.progress = notes, progress
        self._loaded: dict[str | None, object] = {}
        self._said: set[str] = set()

    def for_group(self, group: ModelGroup, why: str, *, required: bool = False):
        """The LoadedModel of `group`, or None with a note (an error when `required`)."""
        tried = []
        for spec, explicit in self._candidates(group):
            try:
                lm = self._load(spec)
            except SeqkvError as exc:
                if explicit:
                    raise
                tried.append(f"its model could not be loaded ({exc})")
                continue
            if lm.fingerprint == group.fingerprint:
                return lm
            what = f"--model {spec}" if explicit else f"model {spec or 'embedded'}"
            tried.append(f"{what} is {lm.name} ({lm.fingerprint[:12]}), another model")
        reason = "; ".join(tried) or "no model is known for it (pass --model)"
        message = f"model {group.name} ({group.fingerprint[:12]}): cannot {why}: {reason}"
        if required:
            raise SeqkvError(message)
        if group.fingerprint not in self._said:
            self._said.add(group.fingerprint)
            self.notes.append(message)
        return None

    def _candidates(self, group: ModelGroup) -> list[tuple[str | None, bool]]:
        from seqkv_cli.runtime.embedded import EMBEDDED_NAME

        out: list[tuple[str | None, bool]] = [(spec, True) for spec in self.specs]
        if group.source == "embedded" or (group.source is None and group.name == EMBEDDED_NAME):
            out.append((None, False))
        elif group.source:
            out.append((group.source, False))
        return out

    def _load(self, spec: str | None):
        from seqkv_cli.runtime.loading import load_model

        if spec not in self._loaded:
            self._loaded[spec] = load_model(spec, progress=self.progress)
        return self._loaded[spec]
