"""The library API: open_archive / add / load / sessions on a tiny random Llama model."""

from __future__ import annotations

import re

import pytest
import torch

import seqkv_cli as seqkv
from conftest import token_ids
from seqkv_cli.errors import SeqkvError


def _cache_of(model, ids, dtype=None):
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    if dtype is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    return cache


def _layers(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def _assert_same(a, b) -> None:
    for i, ((ka, va), (kb, vb)) in enumerate(zip(_layers(a), _layers(b), strict=True)):
        assert ka.dtype == kb.dtype and va.dtype == vb.dtype, i
        assert torch.equal(ka, kb) and torch.equal(va, vb), f"layer {i} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_users_own_cache_comes_back_bit_for_bit(tmp_path, user_model, dtype):
    ids = token_ids(40)
    cache = _cache_of(user_model, ids, dtype)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        replayed = arc.add("chat-42", ids, cache=cache)  # default: replay, checked now
        kept = arc.add("chat-43", ids, cache=cache, residual="lossless")
        loaded, portable = arc.load("chat-42"), arc.load("chat-43")
        canonical = arc.load("chat-42", replay=False)
        how = {s.id: s.restore for s in arc.sessions()}
        own = {s.id: s.bytes for s in arc.sessions()}
    assert (
        replayed.kv_strategy == "replay" and kept.kv_strategy == "exact" and replayed.tokens == 40
    )
    assert replayed.max_abs_difference > 0  # transformers' numerics are not the canonical ones
    # a record instead of a residual: the replayed session's own bytes are its tokens
    assert how == {"chat-42": "replay", "chat-43": "canonical + residual"}
    assert own["chat-43"] > 4 * own["chat-42"]
    assert type(loaded).__name__ == "DynamicCache"
    _assert_same(cache, loaded)
    _assert_same(cache, portable)
    assert loaded.get_seq_length() == 40
    # the canonical recompute is not the user's cache (replay is what brought theirs back);
    # somewhere, not in a given layer: in bf16 the closer v3 can round a whole layer alike
    assert any(
        not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))
        for a, b in zip(canonical.layers, cache.layers, strict=True)
    )


def test_a_generate_cache_replays_with_its_prompt_length(tmp_path, user_model):
    prompt = token_ids(12)
    with torch.inference_mode():
        out = user_model.generate(
            prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True
        )
    n = out.past_key_values.get_seq_length()
    seq = out.sequences[:, :n]
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        report = arc.add("g", seq, cache=out.past_key_values, prompt_length=12)
        loaded = arc.load("g")
        with pytest.raises(SeqkvError, match="did not reproduce the cache"):
            arc.add("g2", seq, cache=out.past_key_values, residual="replay", prompt_length=n)
    assert report.kv_strategy == "replay"
    _assert_same(out.past_key_values, loaded)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_an_agent_turn_continued_from_a_loaded_cache_replays_with_its_schedule(
    tmp_path, user_model
):
    prompt, follow_up = token_ids(10), token_ids(4, seed=3)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        with torch.inference_mode():
            out = user_model.generate(
                prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True
            )
        n1 = out.past_key_values.get_seq_length()
        arc.add("turn-1", out.sequences[:, :n1], cache=out.past_key_values, prompt_length=10)
        cache = arc.load("turn-1")  # after a restart: the agent's cache, bit for bit
        ids = torch.cat([out.sequences, follow_up], 1)  # the whole conversation so far
        with torch.inference_mode():
            out2 = user_model.generate(
                ids,
                past_key_values=cache,
                max_new_tokens=5,
                do_sample=False,
                return_dict_in_generate=True,
            )
        n2 = out2.past_key_values.get_seq_length()
        schedule = arc.schedule("turn-1") + [ids.shape[1] - n1] + [1] * (n2 - ids.shape[1])
        report = arc.add(
            "turn-2",
            out2.sequences[:, :n2],
            cache=out2.past_key_values,
            schedule=schedule,
            residual="replay",
        )
        _assert_same(out2.past_key_values, arc.load("turn-2"))
        assert arc.schedule("turn-2") == schedule and arc.schedule("turn-1") == [10, 1, 1, 1, 1]
    assert report.kv_strategy == "replay" and report.new_tokens == n2 - n1


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_generate_outputs_are_added_as_they_are_and_a_loaded_cache_needs_no_schedule(
    tmp_path, user_model
):
    """The common agent loop without a hand-built schedule: generate()'s output with its
    prompt length, and a continued loaded cache whose earlier calls seqkv knows."""
    prompt, follow_up = token_ids(10), token_ids(4, seed=3)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        with torch.inference_mode():
            out = user_model.generate(
                prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True
            )
        first = arc.add("turn-1", out, prompt_length=10)
        n1 = out.past_key_values.get_seq_length()
        assert first.tokens == n1 and arc.tokens("turn-1") == out.sequences[0, :n1].tolist()
        cache = arc.load("turn-1")
        ids = torch.cat([out.sequences, follow_up], 1)
        with torch.inference_mode():
            out2 = user_model.generate(
                ids,
                past_key_values=cache,
                max_new_tokens=5,
                do_sample=False,
                return_dict_in_generate=True,
            )
        assert out2.past_key_values is cache  # generate continued the cache load gave
        second = arc.add("turn-2", out2, prompt_length=ids.shape[1], residual="replay")
        n2 = out2.past_key_values.get_seq_length()
        want = [10, 1, 1, 1, 1, ids.shape[1] - n1] + [1] * (n2 - ids.shape[1])
        assert arc.schedule("turn-2") == want
        _assert_same(out2.past_key_values, arc.load("turn-2"))
        # with its scores, the output says how many tokens generate made: no prompt_length
        with torch.inference_mode():
            out3 = user_model.generate(
                prompt,
                max_new_tokens=3,
                do_sample=False,
                return_dict_in_generate=True,
                output_scores=True,
            )
        third = arc.add("scored", out3, residual="replay")
        assert arc.schedule("scored") == [10, 1, 1]
    assert first.kv_strategy == second.kv_strategy == third.kv_strategy == "replay"
    assert second.new_tokens == n2 - n1


def test_generate_outputs_with_wrong_arguments_are_one_line(tmp_path, user_model):
    prompt = token_ids(10)
    with torch.inference_mode():
        out = user_model.generate(
            prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        for call, words in [
            (lambda: arc.add("a", out, cache=out.past_key_values), "not both"),
            (
                lambda: arc.add("a", type(out)(sequences=out.sequences)),
                "holds no cache",
            ),
        ]:
            with pytest.raises(SeqkvError) as info:
                call()
            assert words in str(info.value) and "\n" not in str(info.value)
        arc.add("a", out, prompt_length=10)
        loaded = arc.load("a")
        with torch.inference_mode():
            more = user_model.generate(
                torch.cat([out.sequences, token_ids(3, seed=5)], 1),
                past_key_values=loaded,
                max_new_tokens=2,
                do_sample=False,
                return_dict_in_generate=True,
            )
        for bad in (5, 10**6, True):  # the prompt must lie past what the loaded cache held
            with pytest.raises(SeqkvError, match=r"prompt_length must be in 14\.\."):
                arc.add("b", more, prompt_length=bad)
        assert "b" not in arc


def test_a_replay_that_does_not_reproduce_is_one_line(tmp_path, user_model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ids = token_ids(24)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        arc.add("s", ids, cache=_cache_of(user_model, ids))
    other = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with seqkv.open_archive(tmp_path / "m.skv", model=other) as arc:
        with pytest.raises(SeqkvError, match=r"not reproduced here by replay.*attention sdpa"):
            arc.load("s")
        canonical = arc.load("s", replay=False)  # the portable approximation still restores
    assert canonical.get_seq_length() == 24


def test_replay_records_with_hostile_fields_are_refused():
    from seqkv_cli.archive import read_record

    good = {"version": 1, "calls": [[3, 1], [1, 4]], "cache_dtype": "bf16", "sha256": "a" * 64}
    assert read_record({"replay": good}, 7) == good
    assert read_record({}, 7) is None
    for bad in (
        good,  # covers 7 positions, not 8
        {**good, "calls": [[1, 10**12]]},  # refused by its sum, before anything is expanded
        {**good, "calls": [[3, 0]]},
        {**good, "calls": [[3, 1, 2]]},
        {**good, "calls": [[True, 1]]},
        {**good, "calls": []},
        {**good, "calls": [[1, 1]] * 5000},
        {**good, "calls": "3"},
        {**good, "sha256": "a" * 10},
        {**good, "cache_dtype": "int8"},
        {**good, "version": 9},
        "{not json",
        [1, 2],
    ):
        with pytest.raises(SeqkvError, match="replay record is malformed"):
            read_record({"replay": bad, "session_id": "x"}, 8 if bad is good else 7)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_a_loaded_cache_continues_exactly_where_it_stopped(tmp_path, user_model):
    ids, more = token_ids(30), token_ids(5, seed=1)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        arc.add("s", ids, cache=_cache_of(user_model, ids))
        loaded = arc.load("s")
    from seqkv_cli.runtime.hfcompat import cache_kwarg

    name = cache_kwarg(type(user_model).forward)  # `cache` on newer transformers
    with torch.inference_mode():
        expected = user_model(more, **{name: _cache_of(user_model, ids)}).logits
        got = user_model(more, **{name: loaded}).logits
        greedy = user_model.generate(
            torch.cat([ids, more], 1)[:, :31],
            past_key_values=arc_reload(tmp_path, user_model),
            max_new_tokens=4,
            do_sample=False,
        )
        plain = user_model.generate(
            torch.cat([ids, more], 1)[:, :31], max_new_tokens=4, do_sample=False
        )
    assert torch.equal(expected, got)
    assert torch.equal(greedy, plain)


def arc_reload(folder, model):
    with seqkv.open_archive(folder / "m.skv", model=model) as arc:
        return arc.load("s")


def test_tokens_only_recomputes_and_a_growing_session_pays_for_new_tokens(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.engine import run_capture

    ids = token_ids(48)
    with seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm) as arc:
        first = arc.add("turn-1", ids[:, :32])
        second = arc.add("turn-2", ids)
        rows = {s.id: s for s in arc.sessions()}
        loaded = arc.load("turn-2")
        assert arc.tokens("turn-1") == ids[0, :32].tolist()
        assert "turn-1" in arc and len(arc) == 2
    assert first.kv_strategy == "recomputed" and first.max_abs_difference is None
    with pytest.warns(DeprecationWarning, match="kv_strategy"):
        assert first.kv == "recomputed"  # the name docs/API.md used before
    # the first session alone is a compact file (43 bytes + its id beyond the tokens) ...
    assert first.added_bytes == first.file_bytes < 43 + len("turn-1") + 32 * 2
    # ... and the second add codes only the 16 tokens the first did not have
    from seqkv_cli.container import open_container
    from seqkv_cli.trie import load_trie

    with open_container(tmp_path / "m.skv") as reader:
        tokens = load_trie(reader, tmp_path / "m.skv").embedded  # after each version-2 table
    assert second.new_tokens == 16 and 0 < len(tokens[2]) < len(tokens[1])
    assert rows["turn-2"].shared_prefix == 32 and rows["turn-2"].tokens == 48
    canon = run_capture(tiny_lm, ids[0].tolist(), dtype="bf16")
    for i, (k, v) in enumerate(_layers(loaded)):
        assert torch.equal(k[0], canon.keys[i]) and torch.equal(v[0], canon.values[i])


def test_compact_makes_a_tokens_only_memory_a_compact_archive(tmp_path, tiny_lm):
    from seqkv_cli.container import open_container

    ids = token_ids(60)
    path = tmp_path / "m.skv"
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        for k in range(1, 5):
            arc.add(f"turn-{k}", ids[:, : 15 * k])
        before = path.stat().st_size
        size = arc.compact()
        assert size == path.stat().st_size < before / 2
        with open_container(path) as reader:
            assert reader.version == (1, 8) and reader.archive
        assert [s.id for s in arc.sessions()] == [f"turn-{k}" for k in range(1, 5)]
        assert arc.tokens("turn-2") == ids[0, :30].tolist()
        arc.add("turn-5", ids)  # the next turn: the full layout again, nothing lost
        assert arc.tokens("turn-3") == ids[0, :45].tolist() and len(arc) == 5
        with pytest.raises(SeqkvError, match="unknown layout"):
            arc.compact(layout="bogus")
    with pytest.raises(SeqkvError, match="has no sessions yet"):
        seqkv.open_archive(tmp_path / "new.skv", model=tiny_lm).compact()


def test_residual_none_says_how_far_the_recompute_is(tmp_path, user_model, tiny_lm):
    ids = token_ids(24)
    cache = _cache_of(user_model, ids, torch.bfloat16)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        report = arc.add("s", ids, cache=cache, residual="none")
        loaded = arc.load("s")
    assert report.kv_strategy == "recomputed" and report.max_abs_difference > 0
    worst = max(
        float((a - b).abs().max())
        for (ka, va), (kb, vb) in zip(_layers(cache), _layers(loaded), strict=True)
        for a, b in ((ka.double(), kb.double()), (va.double(), vb.double()))
    )
    assert worst == pytest.approx(report.max_abs_difference)
    assert loaded.layers[0].keys.dtype == torch.bfloat16


def test_tolerance_keeps_every_element_within_eps(tmp_path, user_model):
    ids, eps = token_ids(40), 0.05
    cache = _cache_of(user_model, ids)
    with seqkv.open_archive(tmp_path / "tol.skv", model=user_model) as arc:
        report = arc.add("s", ids, cache=cache, tolerance=eps)
        loaded = arc.load("s")
    with seqkv.open_archive(tmp_path / "exact.skv", model=user_model) as arc:
        exact = arc.add("s", ids, cache=cache)
    assert report.kv_strategy == "within EPS"
    assert report.file_bytes < exact.file_bytes
    for (ka, va), (kb, vb) in zip(_layers(cache), _layers(loaded), strict=True):
        assert float((ka - kb).abs().max()) <= eps and float((va - vb).abs().max()) <= eps


def test_the_same_weights_open_the_archive_by_folder_or_object(tmp_path, user_model, tiny_lm):
    ids = token_ids(16)
    with seqkv.open_archive(tmp_path / "m.skv", model=user_model) as arc:
        arc.add("a", ids)
    with seqkv.open_archive(tmp_path / "m.skv", model=str(tiny_lm.folder)) as arc:
        assert arc.tokens("a") == ids[0].tolist()


def test_a_bf16_model_is_another_model(tmp_path, user_model, tiny_lm):
    import copy

    with seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm) as arc:
        arc.add("a", token_ids(8))
    half = copy.deepcopy(user_model).to(torch.bfloat16)
    with pytest.raises(SeqkvError, match=r"holds sessions of model .*fingerprint"):
        seqkv.open_archive(tmp_path / "m.skv", model=half)
    assert next(half.parameters()).dtype == torch.bfloat16  # the user's object is left alone


def test_bad_calls_get_one_line_each(tmp_path, user_model, tiny_lm):
    ids = token_ids(12)
    arc = seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm)
    arc.add("a", ids)
    cases = [
        (lambda: arc.add("a", ids), "already has a session 'a'"),
        (lambda: arc.add("", ids), "non-empty string"),
        (lambda: arc.add("x\ny", ids), "no control characters"),
        (lambda: arc.add(7, ids), "non-empty string"),
        (lambda: arc.add("b", [1, 2, 10**6]), "outside the model's vocabulary"),
        (lambda: arc.add("b", torch.zeros(2, 5, dtype=torch.long)), r"shape \(2, 5\)"),
        (lambda: arc.add("b", []), "empty"),
        (lambda: arc.add("b", [0.5, 1.5]), "integer ids"),
        (lambda: arc.add("b", ids, residual="lossy"), "residual must be one of"),
        (lambda: arc.add("b", ids, prompt_length=3), "describe a cache"),
        (
            lambda: arc.add("b", ids, cache=_cache_of(user_model, ids), schedule=[5, 5]),
            "schedule covers 10 tokens; the session has 12",
        ),
        (
            lambda: arc.add("b", ids, cache=_cache_of(user_model, ids), schedule=[12, 0]),
            "positive token counts",
        ),
        (
            lambda: arc.add("b", ids, cache=_cache_of(user_model, ids), prompt_length=99),
            "prompt_length must be in 1..12",
        ),
        (lambda: arc.add("b", ids, tolerance=0.1), "tolerance needs a cache"),
        (lambda: arc.add("b", ids, cache=object()), "transformers Cache"),
        (lambda: arc.add("b", ids, cache=_cache_of(user_model, ids[:, :11])), "after generate"),
        (lambda: arc.add("b", ids, cache=_cache_of(user_model, ids), tolerance=-1), "> 0"),
        (lambda: arc.load("nope"), "has no session 'nope'"),
        (lambda: seqkv.open_archive(tmp_path, model=tiny_lm), "is not a file"),
        (lambda: seqkv.open_archive(tmp_path / "x.skv", model=3.5), "must be a transformers"),
        (lambda: seqkv.open_archive(tmp_path / "y.skv", tiny_lm, codec="kivi2"), "trie codec"),
        (
            lambda: seqkv.open_archive(
                tmp_path / "y.skv", tiny_lm, codec={"id": "seq", "parallel": 8}
            ),
            "parallel runs .* are not kept in trie archives",
        ),
    ]
    for call, message in cases:
        with pytest.raises(SeqkvError, match=message):
            call()
    arc.close()
    with pytest.raises(SeqkvError, match="closed"):
        arc.add("c", ids)
    with seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm) as again:
        assert [s.id for s in again.sessions()] == ["a"]  # nothing half-added


def test_a_flat_archive_is_refused_before_any_work(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.capture_file import save_capture
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(tiny_lm, token_ids(8)[0].tolist())
    cap.meta["session_id"] = "a"
    save_capture(cap, tmp_path / "a.safetensors")
    seqkv.compress(
        tmp_path / "a.safetensors",
        tmp_path / "flat.skv",
        codec="seq",
        layout="flat",
        model=tiny_lm,
        check=False,
    )
    with pytest.raises(SeqkvError, match="flat layout"):
        seqkv.open_archive(tmp_path / "flat.skv", model=tiny_lm)


def test_crafted_replay_records_fail_alone_and_in_one_line(tmp_path, tiny_lm):
    from seqkv_cli.archive import compress_sources, read_record
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.sequential.registry import resolve_codec
    from seqkv_cli.trie.sources import Source

    for raw in ("[1]", "null", "[" * 5000 + "]" * 5000, 7):
        with pytest.raises(SeqkvError, match="replay record is malformed"):
            read_record({"replay": raw}, 3)
    caps = []
    for sid, record in (("good", None), ("bad", {"version": 1, "calls": [[1, 10**12]]})):
        cap = run_capture(tiny_lm, token_ids(10, seed=len(caps))[0].tolist())
        cap.meta["session_id"] = sid
        if record:
            cap.meta["replay"] = {**record, "cache_dtype": "bf16", "sha256": "0" * 64}
        caps.append(Source.from_capture(cap))
    compress_sources(caps, tmp_path / "m.skv", resolve_codec("seq"), False, tiny_lm, None)
    with seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm) as arc:
        how = {s.id: s.restore for s in arc.sessions()}  # one bad session hides no other
        assert how == {"good": "canonical", "bad": "malformed replay record"}
        with pytest.raises(SeqkvError, match="'bad': its replay record is malformed"):
            arc.schedule("bad")
        with pytest.raises(SeqkvError, match="'bad': its replay record is malformed"):
            arc.load("bad")
        assert arc.load("good").get_seq_length() == 10


def test_the_first_add_never_replaces_a_file_another_writer_created(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.trie.sources import Source

    late = seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm)  # both see no file yet
    with seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm) as first:
        first.add("a", token_ids(8))
    before = (tmp_path / "m.skv").read_bytes()
    cap = run_capture(tiny_lm, token_ids(8, seed=2)[0].tolist())
    cap.meta["session_id"] = "b"
    assert late._create([Source.from_capture(cap)]) is None  # lost the race: nothing replaced
    assert (tmp_path / "m.skv").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.skv"]  # no temporary left
    late.add("b", token_ids(8, seed=2))  # and a normal add appends
    assert [s.id for s in late.sessions()] == ["a", "b"]


def test_library_compress_refuses_an_output_that_is_an_input(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.capture_file import save_capture
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(tiny_lm, token_ids(8)[0].tolist())
    save_capture(cap, tmp_path / "a.safetensors")
    before = (tmp_path / "a.safetensors").read_bytes()
    with pytest.raises(SeqkvError, match="is also an input"):
        seqkv.compress(tmp_path / "a.safetensors", tmp_path / "a.safetensors", model=tiny_lm)
    assert (tmp_path / "a.safetensors").read_bytes() == before


def test_add_many_is_one_append_and_meta_comes_back(tmp_path, tiny_lm):
    path = tmp_path / "m.skv"
    with seqkv.open_archive(path, model=tiny_lm) as arc:
        first = arc.add("solo", token_ids(8), meta={"user": "ana", "tags": {"n": 1, "ok": True}})
        assert arc.meta("solo") == {"user": "ana", "tags": {"n": 1, "ok": True}}
        assert first.new_tokens == 8
        before = path.stat().st_size
        reports = arc.add_many(
            [
                {"session_id": "b1", "input_ids": token_ids(12, seed=3), "meta": {"turn": 1}},
                {"session_id": "b2", "input_ids": token_ids(12, seed=4)},
            ]
        )
        assert [r.id for r in reports] == ["b1", "b2"]
        assert reports[0].added_bytes == reports[1].added_bytes == path.stat().st_size - before
        assert arc.meta("b1") == {"turn": 1} and arc.meta("b2") == {}
        assert [s.id for s in arc.sessions()] == ["solo", "b1", "b2"]
        from seqkv_cli.archive import session_rows

        rows, _ = session_rows(path)
        assert [r["segment"] for r in rows] == [1, 2, 2]  # the batch is one segment
        size = path.stat().st_size
        for bad, message in (
            ([{"session_id": "c", "input_ids": token_ids(4)}] * 2, "session 'c' is given twice"),
            ([{"session_id": "b1", "input_ids": token_ids(4)}], "already has a session 'b1'"),
            ([{"session_id": "d", "input_ids": token_ids(4), "colour": 1}], "add()'s keyword"),
            ([], "no sessions given"),
            (
                [{"session_id": "e", "input_ids": token_ids(4), "meta": {"x": [1]}}],
                "meta['x'] is list",
            ),
            ([{"session_id": "e", "input_ids": token_ids(4), "meta": {"x": float("nan")}}], "JSON"),
            ([{"session_id": "e", "input_ids": token_ids(4), "meta": "x"}], "meta must be a dict"),
        ):
            with pytest.raises(SeqkvError, match=re.escape(message)):
                arc.add_many(bad)
        assert path.stat().st_size == size  # nothing refused was written


def test_max_relative_difference_refuses_another_models_cache(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.caches import to_cache
    from seqkv_cli.kvcapture.engine import run_capture

    ids = token_ids(10)[0].tolist()
    cap = run_capture(tiny_lm, ids, dtype="fp32")
    own = to_cache(cap.keys, cap.values)
    with seqkv.open_archive(tmp_path / "m.skv", model=tiny_lm) as arc:
        ok = arc.add("own", ids, cache=own, residual="lossless", max_relative_difference=0.01)
        assert ok.relative_difference == 0.0 and ok.kv_strategy == "exact"
        foreign = to_cache([k.flip(1) for k in cap.keys], [v.flip(1) for v in cap.values])
        with pytest.raises(SeqkvError, match="a cache of another model"):
            arc.add("other", ids, cache=foreign, residual="lossless", max_relative_difference=0.25)
        assert [s.id for s in arc.sessions()] == ["own"]
