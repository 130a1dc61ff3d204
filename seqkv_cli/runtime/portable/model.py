"""PortableLM: any transformers causal LM, run by its own modeling code, in portable numerics.

The model's forward runs unchanged under `PortableMode` (every aten op exact by IEEE or
replaced by `exact`), with seqkv's attention registered through transformers'
AttentionInterface and a transformers `Cache` (`rows_cache.RowsCache`) that writes each
sequence's K/V into its preallocated `PortableState`.
Rotary frequencies are recomputed in the portable definition at load (the ones computed at
model init came from the machine's `pow`). A canary (`canary`) checks the machine before
first use.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.checkpoint import WeightStore
from seqkv_cli.runtime.devices import model_device
from seqkv_cli.runtime.forward import check_batch
from seqkv_cli.runtime.hfcompat import cache_kwarg
from seqkv_cli.runtime.model_config import ModelShape, ShapeAttributes, text_config
from seqkv_cli.runtime.portable import exact, fused, kernels
from seqkv_cli.runtime.portable.attention import (
    ATTENTION_NAME,
    ROWS_KWARG,
    PortableState,
    portable_attention,
    rows_of_call,
)
from seqkv_cli.runtime.portable.canary import check_step, run_canary, same_bits
from seqkv_cli.runtime.portable.mode import PortableMode
from seqkv_cli.runtime.portable.rows_cache import RowsCache
from seqkv_cli.runtime.portable.weights import WeightCache
from seqkv_cli.runtime.surprisal import portable_surprisal_bits

# Module types the path refuses by name: their state or ops have no portable definition yet.
_REFUSED_MODULES = ("Conv1d", "Conv1D", "Conv2d", "Mamba")


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, portable_attention)


class PortableLM(ShapeAttributes):
    """The `CanonicalForward` of a portable path (runtime/forward.py); its states are
    `PortableState`."""

    surprisal = staticmethod(portable_surprisal_bits)

    def __init__(
        self, hf_model, numeric_path: str = exact.NUMERIC_PATH_V3, store: WeightStore | None = None
    ) -> None:
        if numeric_path not in exact.FORMS:
            raise SeqkvError(f"{numeric_path!r} is not a portable numeric path")
        self.numeric_path = numeric_path
        self.form = exact.FORMS[numeric_path]
        self.model_type = getattr(text_config(hf_model.config), "model_type", "?")
        _refuse_unvetted(hf_model, self.model_type)
        self.device = model_device(hf_model)
        store = store if store is not None else WeightStore.of_module(hf_model)
        run_canary(self.device, tuple(store.kinds()) or ("f32",), self.form)
        _register_attention()
        if next(hf_model.parameters()).dtype != torch.float32:
            raise SeqkvError("portable numerics run fp32 weights; load the model in float32")
        self.model = hf_model.eval()
        self.shape = ModelShape.of(hf_model.config)
        # Fixed-point widths: keys for q·k over head_dim, values for weights·V over the context
        # (v3: fixed, the queries and weights carry the L1 bound), and the softmax numerators
        # (<= 1 in units of 2**-prob_bits, so a row sums below 2**53 at the model's context).
        context_bits = max(1, self.max_context - 1).bit_length()
        if self.form == exact.L1:
            kv_bits = (exact.L1_KV_BITS, exact.L1_KV_BITS)
        else:
            kv_bits = (
                exact.contraction_bits(self.head_dim),
                exact.contraction_bits(self.max_context),
            )
        self.bits = (*kv_bits, exact.MANTISSA - context_bits)
        # A model seqkv loaded holds its weights in a store at the checkpoint's width; a
        # user's model object is read through views of its own fp32 weights.
        self.weights = WeightCache(hf_model, store, check_step)
        self._configs = list({id(c): c for c in _configs(hf_model)}.values())
        self._rotary = self._portable_rotary()
        self.fused = self._fused_decoder()

    def _mode(self) -> PortableMode:
        return PortableMode(self.weights, self.model_type, self.form)

    @contextlib.contextmanager
    def _installed(self):
        """The model switched to seqkv's attention, eager experts and portable rotary tables
        for one call, and switched back after: the caller's model is left as it was."""
        saved = [
            (
                c,
                getattr(c, "_attn_implementation_internal", None),
                getattr(c, "_experts_implementation_internal", None),
            )
            for c in self._configs
        ]
        swapped = [(m, m.inv_freq.clone()) for m, _ in self._rotary]
        try:
            for c in self._configs:
                c._attn_implementation_internal = ATTENTION_NAME
                if hasattr(c, "_experts_implementation_internal"):
                    c._experts_implementation_internal = "eager"
            for module, inv_freq in self._rotary:
                module.inv_freq.copy_(inv_freq)
            yield
        finally:
            for c, attn, experts in saved:
                c._attn_implementation_internal = attn
                if hasattr(c, "_experts_implementation_internal"):
                    c._experts_implementation_internal = experts
            for module, original in swapped:
                module.inv_freq.copy_(original)

    @torch.inference_mode()
    def _portable_rotary(self) -> list:
        """(module, inv_freq) for every rotary table, recomputed in the portable definition."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        tables = []
        for module in self.model.modules():
            if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                continue
            rope_type = getattr(module, "rope_type", "default")
            fn = (
                getattr(module, "compute_default_rope_parameters", None)
                if rope_type == "default"
                else ROPE_INIT_FUNCTIONS.get(rope_type)
            )
            if fn is None:
                raise SeqkvError(
                    f"portable numerics: rotary embedding type {rope_type!r} of "
                    f"{type(module).__name__} cannot be recomputed portably"
                )
            # Computed on the CPU (newer transformers ignore a `device` argument here) and
            # moved: the definition gives the same bits on every device.
            with self._mode():
                inv_freq, _ = fn(module.config)
            tables.append((module, inv_freq.to(module.inv_freq.device, module.inv_freq.dtype)))
        return tables

    def _fused_decoder(self) -> fused.FusedDecoder | None:
        """The fused forward where it mirrors this model and, probed here, agrees bit for bit
        with the reference (a prefill, then a chunk: logits and every K/V)."""
        if not kernels.enabled() or not fused.fusable(self.model, self.model_type):
            return None
        rotary = self.model.model.rotary_emb
        inv_freq = next((f for m, f in self._rotary if m is rotary), None)
        if inv_freq is None:
            return None
        decoder = fused.FusedDecoder(self.model, self.weights, self.form, inv_freq)
        # What can differ is the order of operations (the canary checks the products'
        # kernels), so a short prefill and a chunk after it: the reference runs every op in
        # Python, which makes this the longest part of a load. Its products and attention run
        # as a prefill's (the same bits as a step's kernels): a capture compiles no step
        # kernel.
        first = 3
        n = 5
        ids = torch.arange(n) % self.vocab_size
        runs = []
        for run in (self._run_reference, decoder.run):
            state = self.new_state(n)
            with kernels.tiles_only():
                logits = [
                    self._forward_with(run, state, ids[:first]),
                    self._forward_with(run, state, ids[first:]),
                ]
            runs.append((torch.cat(logits), state.keys[:, :, :n], state.values[:, :, :n]))
        if all(same_bits(a, b) for a, b in zip(*runs, strict=True)):
            return decoder
        warnings.warn(
            f"seqkv: the fused {self.model_type} forward does not match this transformers "
            "version's modeling code bit for bit; using the reference forward (same bits, slower)",
            stacklevel=2,
        )
        return None

    def new_state(self, capacity: int) -> PortableState:
        if capacity > self.max_context:
            raise SeqkvError(f"{capacity} positions exceed the model context ({self.max_context})")
        return PortableState(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            self.bits,
            self.device,
            self.form,
        )

    @torch.inference_mode()
    def forward(self, state: PortableState, token_ids: torch.Tensor) -> torch.Tensor:
        """Append `token_ids` (M,) to `state`; return their next-token logits (M, vocab), fp32."""
        m = int(token_ids.shape[0])
        if m == 0:
            return torch.empty((0, self.vocab_size))
        if state.length + m > state.capacity:
            raise SeqkvError(f"sequence longer than the state's capacity ({state.capacity})")
        positions = (state.length + torch.arange(m))[None]
        logits = self._run([state], token_ids.long()[None], positions)
        return logits[0]

    @torch.inference_mode()
    def forward_rows(self, states: list[PortableState], token_ids: list[int]) -> torch.Tensor:
        """Append one token to each of several sequences in one pass; logits (B, vocab).

        Rows share the weight products; every product is exact per row, so each sequence
        gets the same bits as if it were stepped alone.
        """
        check_batch(states, call="forward_rows")
        for s in states:
            if s.length + 1 > s.capacity:
                raise SeqkvError(f"sequence longer than the state's capacity ({s.capacity})")
        ids = torch.tensor(list(token_ids), dtype=torch.long)[:, None]
        positions = torch.tensor([s.length for s in states], dtype=torch.long)[:, None]
        return self._run(states, ids, positions)[:, 0]

    @torch.inference_mode()
    def forward_many(self, states: list[PortableState], token_ids: list) -> list[torch.Tensor]:
        """Append token_ids[i] (one or more) to states[i] in one pass; logits of each, (m_i, V).

        Rows of one pass are rectangular: a shorter list is padded by repeating its last
        token, at positions that must fit the state's capacity; the padding's K/V sit past
        the row's length (cropped here) and are overwritten by its next call.
        """
        lists = [list(map(int, ids)) for ids in token_ids]
        check_batch(states, lists, "forward_many")
        m = max(len(x) for x in lists)
        for s in states:
            if s.length + m > s.capacity:
                raise SeqkvError(f"sequence longer than the state's capacity ({s.capacity})")
        ids = torch.tensor([x + [x[-1]] * (m - len(x)) for x in lists], dtype=torch.long)
        positions = torch.stack([s.length + torch.arange(m) for s in states])
        logits = self._run(states, ids, positions)
        for s, x in zip(states, lists, strict=True):
            s.crop(len(x) - m)  # the padding is not part of the sequence
        return [logits[i, : len(x)] for i, x in enumerate(lists)]

    def _forward_with(self, run, state, ids) -> torch.Tensor:
        positions = (state.length + torch.arange(len(ids)))[None]
        logits = run([state], ids[None].to(self.device), positions.to(self.device))
        state.length += len(ids)
        return logits[0].float().cpu()  # the fused decoder leaves them on the model's device

    def _step_check(self) -> bool:
        """Whether the fused decoder's native step gives the torch path's bits on this machine:
        three tokens prefilled, then one stepped both ways from the same state (logits and
        every K/V). Run before the first step of a process, so a capture compiles none of it."""
        fused = self.fused
        if not fused.steps_natively():
            return False
        n = 4
        ids = torch.arange(n) % self.vocab_size
        state = self.new_state(n)
        self._forward_with(fused.run, state, ids[: n - 1])
        runs = []
        for native in (False, True):
            branch = state.fork(n - 1, n)
            fused.native_step = native
            logits = self._forward_with(fused.run, branch, ids[n - 1 :])
            runs.append((logits, branch.keys[:, :, :n], branch.values[:, :, :n]))
        agree = all(same_bits(a, b) for a, b in zip(*runs, strict=True))
        if not agree:
            warnings.warn(
                f"seqkv: the native {self.model_type} step does not match the fused forward bit "
                "for bit on this machine; stepping through torch (same bits, slower)",
                stacklevel=3,
            )
        return agree

    def _run(self, states, ids, positions) -> torch.Tensor:
        """Next-token logits (batch, seq, vocab) on the CPU; each state grows by seq positions."""
        if self.fused is not None and ids.shape[1] == 1 and self.fused.native_step is None:
            self.fused.native_step = False  # the check's own steps take the torch path
            self.fused.native_step = self._step_check()
        if self.fused is not None:
            logits = self.fused.run(states, ids.to(self.device), positions.to(self.device))
            logits = logits.float().cpu()
        else:
            logits = self._run_reference(states, ids, positions)
        for s in states:
            s.length += ids.shape[1]
        return logits

    def _run_reference(self, states, ids, positions) -> torch.Tensor:
        """The model's own code under `PortableMode`: the definition's bits (states' lengths
        are left to the caller)."""
        # No attention mask: the registered attention masks each row from its positions.
        rows = {cache_kwarg(type(self.model).forward): RowsCache(states), ROWS_KWARG: states}
        with self._installed(), rows_of_call(states), self._mode():
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **rows,
            )
        return out.logits.float().cpu()  # the coder's tables are built on the CPU


def _configs(hf_model):
    for module in hf_model.modules():
        conf = getattr(module, "config", None)
        if conf is not None:
            yield conf
            for key in ("text_config", "decoder"):
                sub = getattr(conf, key, None)
                if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                    yield sub


def _refuse_unvetted(hf_model, model_type: str) -> None:
    for module in hf_model.modules():
        name = type(module).__name__
        if any(bad in name for bad in _REFUSED_MODULES):
            raise SeqkvError(
                f"portable numerics: the {model_type} model contains {name}, which has no "
                "portable definition; compress it with --codec lossless or a per-vector codec"
            )
