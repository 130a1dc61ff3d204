"""What `seqkv report` was given: capture files and .skv archives, grouped by model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from seqkv_cli.errors import SeqkvError

CAPTURE_SUFFIX = ".safetensors"
ARCHIVE_SUFFIX = ".skv"


@dataclass
class CaptureRef:
    """A capture file and its metadata; tensors are loaded only when a row needs them."""

    path: Path
    meta: dict

    @property
    def session_id(self) -> str:
        return self.meta.get("session_id", "session")


@dataclass
class ModelGroup:
    """Captures and archives of one model (by fingerprint): their rows are comparable."""

    fingerprint: str
    name: str
    captures: list[CaptureRef] = field(default_factory=list)
    archives: list[Path] = field(default_factory=list)
    source: str | None = None  # where a capture says the model came from (for seq rows)

    def capture_of(self, session_id: str) -> CaptureRef | None:
        return next((c for c in self.captures if c.session_id == session_id), None)


def expand(inputs: list[Path]) -> list[Path]:
    """Files as given; directories become their .safetensors and .skv files, sorted; a shard
    manifest (or a directory holding one) becomes the shards it lists."""
    files: list[Path] = []
    from seqkv_cli.archive import manifest_file, read_manifest

    for path in map(Path, inputs):
        if manifest_file(path) is not None:  # a sharded archive: every shard it lists
            files.extend(read_manifest(path).shards())
        elif path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.suffix in (CAPTURE_SUFFIX, ARCHIVE_SUFFIX)
            )
            if not found:
                raise SeqkvError(f"{path} holds no capture (.safetensors) or .skv files")
            files.extend(found)
        elif not path.exists():
            raise SeqkvError(f"no such input: {path}")
        elif path.suffix not in (CAPTURE_SUFFIX, ARCHIVE_SUFFIX):
            raise SeqkvError(f"{path} is neither a capture (.safetensors) nor a .skv file")
        else:
            files.append(path)
    if not files:
        raise SeqkvError("no inputs to report on")
    return files


def group_inputs(inputs: list[Path]) -> list[ModelGroup]:
    """Read every input's metadata (failing early on a bad file) and group by model."""
    from seqkv_cli.archive import Archive
    from seqkv_cli.kvcapture.capture_file import load_capture_meta

    groups: dict[str, ModelGroup] = {}

    def group(fingerprint: str, name: str) -> ModelGroup:
        return groups.setdefault(fingerprint, ModelGroup(fingerprint, name))

    for path in expand(inputs):
        if path.suffix == ARCHIVE_SUFFIX:
            with Archive(path) as arc:
                g = group(arc.model.get("fingerprint", "unknown"), arc.model.get("name", "?"))
            g.archives.append(path)
            continue
        meta = load_capture_meta(path)
        g = group(meta.get("model_fingerprint", "unknown"), meta.get("model_name", "?"))
        ref = CaptureRef(path, meta)
        if g.capture_of(ref.session_id) is not None:
            raise SeqkvError(
                f"two captures of one model have session id '{ref.session_id}' "
                f"({g.capture_of(ref.session_id).path} and {path})"
            )
        g.captures.append(ref)
        g.source = g.source or meta.get("model_source")
    return _join_compact(groups)


def _join_compact(groups: dict[str, ModelGroup]) -> list[ModelGroup]:
    """A compact file names its model by a fingerprint prefix: it joins the group of the
    full fingerprint that prefix names (where another input gives it)."""
    from seqkv_cli.archive import fingerprint_matches

    for fingerprint, g in list(groups.items()):
        whole = [
            h
            for other, h in groups.items()
            if other != fingerprint and fingerprint_matches(fingerprint, other)
        ]
        if len(whole) == 1:
            whole[0].archives.extend(g.archives)
            whole[0].captures.extend(g.captures)
            del groups[fingerprint]
    return list(groups.values())
