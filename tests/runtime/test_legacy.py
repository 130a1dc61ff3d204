"""The canonical-numerics property: same bits for prefill, any chunking, and token stepping."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_model
from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.legacy import KEY_BLOCK, CanonicalLM, check_row_invariance


def run_chunks(lm: CanonicalLM, ids: torch.Tensor, sizes: list[int]):
    state = lm.new_state(len(ids))
    logits, i = [], 0
    for size in sizes:
        logits.append(lm.forward(state, ids[i : i + size]))
        i += size
    assert i == len(ids)
    return torch.cat(logits), state


def chunkings(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    random_sizes, left = [], n
    while left:
        size = min(left, int(torch.randint(1, 97, (1,), generator=gen)))
        random_sizes.append(size)
        left -= size
    return [[n], [1] * n, [7] * (n // 7) + ([n % 7] if n % 7 else []), random_sizes]


def assert_same_everywhere(lm: CanonicalLM, ids: torch.Tensor, seed: int = 0):
    ref_logits, ref_state = run_chunks(lm, ids, [len(ids)])
    for sizes in chunkings(len(ids), seed)[1:]:
        logits, state = run_chunks(lm, ids, sizes)
        assert torch.equal(logits, ref_logits), f"logits differ for chunking {sizes[:8]}..."
        assert torch.equal(state.keys, ref_state.keys)
        assert torch.equal(state.values, ref_state.values)
    return ref_logits, ref_state


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tiny_models_bit_identical_across_chunkings(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(tmp_path / model_type, model_type=model_type, context=1024)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    lm = CanonicalLM(hf)
    n = KEY_BLOCK + 61  # crosses a key-block boundary
    ids = torch.randint(0, lm.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    logits, _ = assert_same_everywhere(lm, ids)
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    # Canonical numerics reorder sums, nothing else: within float rounding of transformers.
    assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4)


def test_thread_count_does_not_change_bits(tiny_lm):
    lm = CanonicalLM(tiny_lm.model)
    ids = torch.arange(200) % lm.vocab_size
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_chunks(lm, ids, [200])
        torch.set_num_threads(max(2, before))
        many, _ = run_chunks(lm, ids, [200])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_the_legacy_path_builds_only_where_the_row_invariance_canary_holds(tiny_lm):
    """Where this machine's BLAS splits rows by batch size (an Intel Xeon's MKL AVX-512, seen
    at stops 20 and 43), the legacy forward is refused in one line instead of run."""
    from seqkv_cli.runtime.numerics import LEGACY, build_canonical

    if check_row_invariance():
        assert isinstance(build_canonical(tiny_lm.fp32_model(), LEGACY), CanonicalLM)
        return
    with pytest.raises(SeqkvError) as info:
        build_canonical(tiny_lm.fp32_model(), LEGACY)
    assert "this machine's BLAS is not row-invariant" in str(info.value)
    assert "\n" not in str(info.value)


def test_capacity_and_architecture_are_checked(tiny_lm):
    lm = CanonicalLM(tiny_lm.model)
    state = lm.new_state(4)
    lm.forward(state, torch.tensor([1, 2, 3]))
    with pytest.raises(SeqkvError, match="capacity"):
        lm.forward(state, torch.tensor([4, 5]))
    with pytest.raises(SeqkvError, match="exceed the model context"):
        lm.new_state(lm.max_context + 1)

    class FakeConfig:
        model_type = "gpt2"

    class Fake:
        config = FakeConfig()

    with pytest.raises(SeqkvError, match="--no-canonical"):
        CanonicalLM(Fake())


@pytest.mark.model
def test_embedded_model_bit_identical_prefill_chunked_stepwise(embedded_lm):
    from conftest import SAMPLE_DATA
    from seqkv_cli.kvcapture.engine import canonical_model, tokenize
    from seqkv_cli.kvcapture.inputs import read_inputs

    lm = canonical_model(embedded_lm)
    doc = read_inputs([str(SAMPLE_DATA / "prose.txt")])[0]
    ids = torch.tensor(tokenize(embedded_lm, doc)[: KEY_BLOCK + 44])  # 300 positions
    assert_same_everywhere(lm, ids, seed=3)


def test_rows_of_several_sequences_match_stepping_each_alone(tiny_lm):
    lm = CanonicalLM(tiny_lm.model)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, lm.vocab_size, (n,), generator=gen) for n in (300, 40, 9)]
    alone = [run_chunks(lm, s, [len(s)]) for s in seqs]
    states = [lm.new_state(len(s)) for s in seqs]
    logits = [[] for _ in seqs]
    for i in range(max(len(s) for s in seqs)):
        live = [j for j, s in enumerate(seqs) if i < len(s)]  # sequences end at different steps
        out = lm.forward_rows([states[j] for j in live], [int(seqs[j][i]) for j in live])
        for row, j in enumerate(live):
            logits[j].append(out[row])
    for j, (ref_logits, ref_state) in enumerate(alone):
        assert torch.equal(torch.stack(logits[j]), ref_logits)
        assert torch.equal(states[j].keys, ref_state.keys)
        assert torch.equal(states[j].values, ref_state.values)


def test_rms_norm_and_rotate_are_the_forward_pieces_branch_uses(tiny_lm):
    lm = CanonicalLM(tiny_lm.model)
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    w = torch.tensor([1.0, 2.0, 1.0, 1.0])
    expected = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + lm.eps)
    assert torch.allclose(lm.rms_norm(x, w), expected, rtol=1e-6)
    assert lm.rms_norm(x, w)[0, 1] == pytest.approx(2 * 4 / (6.25 + lm.eps) ** 0.5, rel=1e-6)
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ones, zeros = torch.ones(4), torch.zeros(4)
    assert torch.equal(lm.rotate(v, ones, zeros), v)  # angle 0
    assert torch.equal(lm.rotate(v, zeros, ones), torch.tensor([-3.0, -4.0, 1.0, 2.0]))  # 90°
    # position 0 of the model's own table is angle 0 (times its attention scaling)
    assert torch.equal(lm.sin[0], torch.zeros_like(lm.sin[0]))


def test_surprisal_of_uniform_logits_is_log2_of_the_vocabulary():
    from seqkv_cli.runtime.surprisal import SURPRISAL_ROWS, portable_surprisal_bits, surprisal_bits

    rows = 2 * SURPRISAL_ROWS + 1  # crosses the row blocks
    logits = torch.zeros(rows, 256)
    ids = torch.arange(rows)
    for fn in (surprisal_bits, portable_surprisal_bits):
        out = fn(logits, ids)
        assert out.dtype == torch.float64 and out.shape == (rows,)
        assert torch.allclose(out, torch.full((rows,), 8.0, dtype=torch.float64), atol=1e-12)
        assert fn(logits[:0], ids[:0]).shape == (0,)
    peaked = torch.zeros(1, 4)
    peaked[0, 2] = 10.0
    p = torch.softmax(peaked.double(), -1)
    for fn in (surprisal_bits, portable_surprisal_bits):
        assert float(fn(peaked, torch.tensor([2]))) == pytest.approx(-float(p[0, 2].log2()))
        assert float(fn(peaked, torch.tensor([0]))) == pytest.approx(-float(p[0, 0].log2()))
