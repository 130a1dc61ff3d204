"""`decompress`: sessions of a container written back as capture files, all or nothing.

Every session is first written into a staging folder of this run in the output directory
(`fsutil.staging_dir`: safetensors stages a temporary of its own beside what it writes);
only when all of them restored are they renamed to their real names. A run that fails
deletes its own staging (never a file that was there before, even one it would have
replaced) and the directories it created, so the output directory is as it was; what a run
killed with SIGKILL staged, the next writer in that folder removes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from seqkv_cli.archive.restore import Archive
from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import (
    discard_quietly,
    make_output_dir,
    publish,
    refuse_output_in_inputs,
    remove_created_dirs,
    staging_dir,
)
from seqkv_cli.kvcapture.capture_file import write_capture
from seqkv_cli.kvcapture.inputs import unique_stems

if TYPE_CHECKING:
    from seqkv_cli.runtime.loading import LoadedModel


def decompress(
    path: Path,
    out_dir: Path,
    session_ids: list[str] | None = None,
    on_session: Callable[[dict, Path], None] | None = None,
    model: str | LoadedModel | None = None,
    numbered: bool = False,
    on_tokens: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write capture files for the chosen sessions (all by default), in the order asked;
    `on_tokens(done, total)` is told the tokens decoded as model codecs restore.

    Files are named after the session ids (`file_stem_for`); `numbered` names them
    0.safetensors, 1.safetensors... instead (compact's scratch copies, where only the order
    matters and ids need no file-name form)."""
    path, out_dir = Path(path), Path(out_dir)
    if not path.is_file():
        raise SeqkvError(f"no such file: {path}")
    created = make_output_dir(out_dir)
    staged: dict[str, Path] = {}
    try:
        with Archive(path, model=model) as archive:
            archive.on_tokens = on_tokens
            entries = [archive.session(s) for s in session_ids] if session_ids else archive.sessions
            entries = list({e["index"]: e for e in entries}.values())  # --session a --session a
            ids = [e["id"] for e in entries]
            targets = (
                {i: out_dir / f"{k}.safetensors" for k, i in enumerate(ids)}
                if numbered
                else output_targets(out_dir, ids, path)
            )
            for entry, restored in archive.restore_many(entries):
                if isinstance(restored, Exception):
                    raise restored
                staged[entry["id"]] = _stage(restored, targets[entry["id"]])
        written = _publish(staged, targets, entries, on_session)
    except BaseException:
        for tmp in staged.values():  # only what this run wrote
            discard_quietly(tmp.parent)
        remove_created_dirs(created)
        raise
    return written


def output_targets(out_dir: Path, session_ids: list[str], archive: Path) -> dict[str, Path]:
    """Each session's capture file; refuses ids that share a file and the archive itself."""
    stems = unique_stems(session_ids)
    targets = {i: out_dir / f"{stems[i]}.safetensors" for i in session_ids}
    for target in targets.values():
        refuse_output_in_inputs(target, [archive])
    return targets


def _stage(restored, target: Path) -> Path:
    """Save `restored` in a staging folder of this run beside `target`: the staged file."""
    try:
        folder = staging_dir(target)
    except OSError as exc:
        raise SeqkvError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        write_capture(restored, folder / target.name, target)
    except BaseException:
        discard_quietly(folder)
        raise
    return folder / target.name


def _publish(staged: dict[str, Path], targets: dict[str, Path], entries, on_session):
    """Rename every staged file to its real name, in the order the sessions were asked."""
    written = []
    for entry in entries:
        tmp, target = staged[entry["id"]], targets[entry["id"]]
        publish(tmp, target)
        discard_quietly(tmp.parent)
        del staged[entry["id"]]
        written.append(target)
        if on_session:
            on_session(entry, target)
    return written
