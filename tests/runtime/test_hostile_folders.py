"""Model folders as an attacker makes them: each is refused in one line naming the file and
the field or tensor, never runs the folder's code, never fills a weight, never prints a
traceback; valid folders load as before."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture import chat_render
from seqkv_cli.runtime.checkpoint import folder_check as fc
from tests.cli_run import assert_error, invoke


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("base") / "m")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _copy(base: Path, tmp_path: Path, name: str = "m") -> Path:
    dest = tmp_path / name
    shutil.copytree(base, dest)
    return dest


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))  # NaN/Infinity as Python writes them


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file(edit(tensors), path, metadata={"format": "pt"})


def _info(folder: Path, **kw):
    return invoke("model", "info", "--model", folder, **kw)


# -- 1. the folder's own code never runs ---------------------------------------------------------

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "llama"
"""


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_folder_with_auto_map_is_refused_and_its_code_never_runs(base, tmp_path, cache, where):
    folder = _copy(base, tmp_path)
    marker = tmp_path / "marker"
    (folder / "configuration_evil.py").write_text(EVIL.format(marker=str(marker)))
    target = folder / where
    data = json.loads(target.read_text())
    data["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    if where == "tokenizer_config.json":
        data["auto_map"] = {"AutoTokenizer": ["configuration_evil.EvilConfig", None]}
    target.write_text(json.dumps(data))
    result = _info(folder, input="y\n" * 10)
    assert_error(result, "auto_map")
    assert where in result.stderr
    assert not marker.exists()
    assert "Do you wish" not in result.output and "custom code" not in result.stdout


def test_an_unknown_model_type_is_refused(base, tmp_path, cache):
    folder = _copy(base, tmp_path)
    _edit_config(folder, model_type="evil_arch")
    assert_error(_info(folder), "model_type evil_arch is not a causal language model")


# -- 2. weights: missing, unexpected, wrongly shaped ----------------------------------------------


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda t: {f"foo.{k}": v for k, v in t.items()}, "is not part of a llama model"),
        (
            lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.down_proj.weight"},
            "have no model.layers.1.mlp.down_proj.weight",
        ),
        (
            lambda t: {**t, "model.layers.0.extra.weight": torch.zeros(4, 4)},
            "model.layers.0.extra.weight is not part of",
        ),
        (
            lambda t: {**t, "model.norm.weight": torch.ones(65)},
            "model.norm.weight has shape (65,)",
        ),
        (
            lambda t: {**t, "model.layers.0.mlp.up_proj.weight": torch.full((128, 64), math.nan)},
            "weight model.layers.0.mlp.up_proj.weight holds NaN",
        ),
    ],
    ids=["other-prefix", "one-absent", "unexpected", "wrong-shape", "nan"],
)
def test_weights_that_do_not_fill_the_model_exactly_are_refused(
    base, tmp_path, cache, edit, fragment
):
    folder = _copy(base, tmp_path)
    _edit_weights(folder, edit)
    assert_error(_info(folder), fragment)


@pytest.mark.parametrize(
    "layers, fragment", [(3, "have no layer 2"), (1, "the weights hold layer 1")]
)
def test_a_layer_count_other_than_the_weights_is_refused(base, tmp_path, cache, layers, fragment):
    folder = _copy(base, tmp_path)
    _edit_config(folder, num_hidden_layers=layers)
    assert_error(_info(folder), fragment)


# -- 3. config numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"num_hidden_layers": 10**5}, "num_hidden_layers is 100,000"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide"),
        ({"max_position_embeddings": 2**62}, "max_position_embeddings is"),
        ({"vocab_size": 100_000}, "vocab_size is 100,000, the embedding"),
        ({"hidden_size": 0}, "hidden_size is 0"),
        ({"num_attention_heads": True}, "num_attention_heads"),
        ({"rope_theta": math.nan}, "rope_theta is nan"),
        ({"rope_theta": math.inf}, "rope_theta is inf"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps is nan"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps is -1e-05"),
    ],
)
def test_config_numbers_out_of_bounds_are_refused_before_a_module_is_built(
    base, tmp_path, cache, changes, fragment
):
    folder = _copy(base, tmp_path)
    _edit_config(folder, **changes)
    result = _info(folder)
    assert_error(result, fragment)
    assert "config.json" in result.stderr or "vocab_size" in fragment


def test_rope_theta_zero_or_negative_is_refused():
    for theta in (0, -10000.0):
        raw = {"model_type": "llama", "rope_theta": theta, **_SHAPE}
        with pytest.raises(SeqkvError, match="rope_theta is"):
            fc.check_config(raw, "config.json")


# -- 4. the fingerprint cache --------------------------------------------------------------------


def _sharded(base: Path, tmp_path: Path) -> Path:
    """The base model as two shards in a subfolder its index names."""
    folder = _copy(base, tmp_path, "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    (folder / "shards").mkdir()
    names = sorted(tensors)
    halves = {"shards/a.safetensors": names[::2], "shards/b.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def test_an_edited_shard_in_a_subfolder_changes_the_fingerprint(base, tmp_path, cache):
    from seqkv_cli.runtime.loading import load_model

    folder = _sharded(base, tmp_path)
    first = load_model(str(folder)).fingerprint
    shard = folder / "shards" / "a.safetensors"
    st_before = shard.stat()
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0  # one weight, same size, the mtime put back
    save_file(tensors, shard, metadata={"format": "pt"})
    os.utime(shard, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
    assert load_model(str(folder)).fingerprint != first


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(base, tmp_path, cache, name):
    folder = _sharded(base, tmp_path)
    shutil.copy(folder / "shards" / "a.safetensors", tmp_path / "outside.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: name for k in index["weight_map"]}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(_info(folder), "shards must be .safetensors files inside the model folder")


@pytest.mark.parametrize(
    "damage",
    [
        b"[]",
        b"{not json",
        b'{"model": 1, "tokenizer": 2}',
        b'{"model": "zz", "tokenizer": "zz"}',
        b"\xff",
    ],
)
def test_a_damaged_fingerprint_cache_entry_is_computed_again(base, tmp_path, cache, damage):
    from seqkv_cli.runtime import fingerprint as fp
    from seqkv_cli.runtime.loading import load_model

    folder = _copy(base, tmp_path)
    want = load_model(str(folder)).fingerprint
    entry = cache / "fingerprints" / (fp.folder_cache_key(folder) + ".json")
    assert entry.exists()
    entry.write_bytes(damage)
    assert load_model(str(folder)).fingerprint == want


# -- 6. chat templates and tokenizer inputs ------------------------------------------------------


def _chat_file(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"id": "c1", "messages": [{"role": "user", "content": "hello"}]}))
    return path


def _set_template(folder: Path, template) -> None:
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_named_chat_templates_use_the_default_one(base, tmp_path, cache):
    folder = _copy(base, tmp_path)
    _set_template(
        folder,
        [
            {"name": "tool_use", "template": "TOOLS{{ messages[0]['content'] }}"},
            {"name": "default", "template": "<<{{ messages[0]['content'] }}>>"},
        ],
    )
    result = invoke("capture", _chat_file(tmp_path), "-o", tmp_path / "out", "--model", folder)
    assert result.exit_code == 0, result.output
    from seqkv_cli import load_capture

    cap = load_capture(tmp_path / "out" / "c1.safetensors")
    assert cap.positions == len("<<hello>>")


@pytest.mark.parametrize(
    "template, fragment",
    [
        ("{{ raise_exception('not for you') }}", "chat template failed: not for you"),
        ("{% for %}", "chat template failed"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "is unsafe"),
        ("{{ 'x' * 2**34 }}", "chat template was stopped"),
        (
            "{% for i in range(100000) %}{% for j in range(1000) %}{{ 'abcdefgh' }}"
            "{% endfor %}{% endfor %}",
            "output exceeds 16,777,216 characters",
        ),
    ],
    ids=["raises", "syntax", "sandbox", "huge-product", "huge-output"],
)
def test_a_chat_template_that_fails_or_explodes_is_one_line(
    base, tmp_path, cache, template, fragment
):
    folder = _copy(base, tmp_path)
    _set_template(folder, template)
    result = invoke("capture", _chat_file(tmp_path), "-o", tmp_path / "out", "--model", folder)
    assert_error(result, fragment)
    assert not (tmp_path / "out" / "c1.safetensors").exists()


def test_a_chat_template_that_loops_without_output_is_stopped(base, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(chat_render, "MAX_SECONDS", 0.5)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    )
    with pytest.raises(SeqkvError, match=r"took more than 0\.5 s"):
        chat_render.render_chat(tok, [{"role": "user", "content": "x"}], "s")


def test_bounded_rendering_is_transformers_rendering(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    msgs = [{"role": "system", "content": "be {{ brief }}"}, {"role": "user", "content": "hé\n"}]
    assert chat_render.render_chat(tok, msgs, "s") == tok.apply_chat_template(msgs, tokenize=False)


def test_a_megabyte_token_does_not_lift_the_text_length_bound():
    from seqkv_cli.kvcapture import engine

    class Tok:
        def __len__(self):
            return 3

        def convert_ids_to_tokens(self, ids):
            return ["a", "b", "x" * (4 << 20)]  # one 4 MiB token in the vocabulary

    lm = SimpleNamespace(tokenizer=Tok(), max_context=2048)
    with pytest.raises(engine.SessionTooLong):
        engine.check_text_length(lm, "y" * (4 << 20), "big.txt")
    with pytest.raises(engine.SessionTooLong, match="at most 16,777,216"):
        engine.check_text_length(
            SimpleNamespace(tokenizer=Tok(), max_context=1 << 24), "y" * (17 << 20), "big.txt"
        )


# -- 7. what the CLI prints from a folder's name -------------------------------------------------


@pytest.mark.parametrize("name", ["[bold red]x[/]", "[link=https:e.vil]y", "x\x1b[2Jz\x07"])
def test_a_folder_name_with_markup_or_escapes_is_printed_inert(base, tmp_path, cache, name):
    folder = _copy(base, tmp_path, name)
    result = _info(folder)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "Traceback" not in result.output
    shown = name.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    assert shown in result.stdout


def test_an_error_naming_a_hostile_path_is_one_inert_line(tmp_path, cache):
    folder = tmp_path / "[bold]\x1b[2J"
    folder.mkdir()
    (folder / "config.json").write_text("{nope")
    result = _info(folder)
    assert_error(result, "not valid JSON")
    assert "\x1b" not in result.stderr


# -- valid folders: unchanged --------------------------------------------------------------------


def test_a_valid_folder_loads_with_the_fingerprint_of_its_fp32_load(base, cache):
    from transformers import AutoModelForCausalLM

    from seqkv_cli.runtime import fingerprint as fp
    from seqkv_cli.runtime.loading import load_model

    lm = load_model(str(base))
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert lm.fingerprint == fp.model_fingerprint(reference, lm.tokenizer_fingerprint)
    assert load_model(str(base)).fingerprint == lm.fingerprint  # from the cache


# -- the validator, fuzzed -----------------------------------------------------------------------

_SHAPE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def _valid_pair():
    """A valid config and the header table of its weights (names, shapes, dtypes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **_SHAPE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    header = {}
    offset = 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        size = math.prod(t.shape) * 4
        header[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    return {"model_type": "llama", **_SHAPE}, header, offset


_CONFIG, _HEADER, _DATA = _valid_pair()
_values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**24 + 1, 2**62, 10**5, 3, 7]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_config_keys = st.sampled_from(
    [*_SHAPE, "rope_theta", "rms_norm_eps", "head_dim", "model_type", "auto_map", "rope_parameters"]
)
_tensor_names = st.sampled_from(sorted(_HEADER))


@st.composite
def _mutated(draw):
    config = dict(_CONFIG)
    header = {k: dict(v) for k, v in _HEADER.items()}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["config", "drop-key", "shape", "dtype", "name", "offsets"]))
        name = draw(_tensor_names)
        if kind == "config":
            config[draw(_config_keys)] = draw(_values)
        elif kind == "drop-key":
            config.pop(draw(_config_keys), None)
        elif kind == "shape" and name in header:
            header[name]["shape"] = draw(st.one_of(st.lists(_values, max_size=3), _values))
        elif kind == "dtype" and name in header:
            header[name]["dtype"] = draw(
                st.one_of(st.sampled_from(sorted(fc.DTYPE_BYTES)), _values)
            )
        elif kind == "name" and name in header:
            header[draw(st.text(max_size=30)) or "x"] = header.pop(name)
        elif kind == "offsets" and name in header:
            header[name]["data_offsets"] = draw(st.one_of(st.lists(_values, max_size=3), _values))
    return config, header


@settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(_mutated())
def test_fuzzed_config_and_header_pairs_are_checked_or_refused(pair):
    """The validator (no module built) on mutated pairs: a checked config or SeqkvError."""
    config, header = pair
    try:
        checked = fc.check_config(json.loads(json.dumps(config)), "config.json")
        tensors = fc.check_header(header, _DATA, Path("model.safetensors"))
        fc.check_tensors(checked, tensors, "folder")
    except SeqkvError as exc:
        assert "\n" not in str(exc)


# -- 5. identity: a model one weight away is refused by fingerprint ------------------------------


def test_restoring_with_a_model_one_weight_away_is_refused_naming_it(base, tmp_path, cache):
    other = _copy(base, tmp_path, "other-model")

    def nudge(tensors):
        name = "model.layers.0.mlp.up_proj.weight"
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1.0
        return tensors

    _edit_weights(other, nudge)
    (tmp_path / "in.txt").write_text("a short text to capture " * 3)
    cap, skv = tmp_path / "cap.safetensors", tmp_path / "c.skv"
    assert invoke("capture", tmp_path / "in.txt", "-o", cap, "--model", base).exit_code == 0
    assert invoke("compress", cap, "-o", skv, "--model", base).exit_code == 0
    result = invoke("decompress", skv, "-o", tmp_path / "out", "--model", other)
    assert_error(result, "the loaded model other-model differs (fingerprint")
    assert "damaged" not in result.stderr


def test_a_multimodal_folder_counts_the_language_models_layers(tmp_path):
    """A vision tower with more layers than the text model is not 'layers the config lacks'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = {**_SHAPE, "head_dim": 16}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
    vision.update(num_attention_heads=2, image_size=28, patch_size=14)
    config = AutoConfig.for_model(
        "gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mm")
    checked = fc.check_folder(tmp_path / "mm")
    assert any("vision" in n for n in checked.tensors)


def test_a_nan_written_into_a_folder_loaded_before_is_still_found(base, tmp_path, cache):
    """The NaN scan is skipped only for files fingerprinted before: an edit is new files."""
    from seqkv_cli.runtime.loading import load_model

    folder = _copy(base, tmp_path)
    load_model(str(folder))
    weights = folder / "model.safetensors"
    before = weights.stat()

    def poison(tensors):
        name = "model.layers.1.self_attn.q_proj.weight"
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[7] = math.inf
        return tensors

    _edit_weights(folder, poison)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(SeqkvError, match=r"q_proj\.weight holds NaN or infinite"):
        load_model(str(folder))
