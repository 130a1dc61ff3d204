"""How many bits each operand of the portable products needs: a probe of candidate definitions.

    python -m bench.studies.definition_sweep --tokens 300 [--generic-weights] [--json out.json]

Runs the embedded model's fused decoder with its products and attention replaced by float64
emulations of candidate quantizations (not exact implementations: only their rounding is
modelled), and reports, per candidate, the share of bf16 K/V elements that differ from the
model run in float64 and the cross-entropy of 300 prose tokens. It is how v3's budget was
chosen (docs/NUMERICS.md, "Why v3"): `peak` quantizes a left row to `ab` bits of its peak
(v1: ab = 21; v2's two limbs: 42), `l1` scales it by its L1 norm against right operands of
`wb` bits (weights) and `kb` (keys and values). --generic-weights moves the weights off the
4-bit GGUF grid they come from (times 1 + 0.02·N(0, 1)), as an ordinary checkpoint's are.
"""

from __future__ import annotations

import copy
import json
import math

import torch

from bench import harness
from bench.harness import SAMPLE
from bench.table import table

CANDIDATES = [
    {"name": "v1 (peak, 21-bit activations)", "mode": "peak", "ab": 21, "wb": 21, "kb": 23,
     "vb": 20, "pw": 20},
    {"name": "v2 (peak, two limbs: 42 bits)", "mode": "peak", "ab": 42, "wb": 21, "kb": 23,
     "vb": 20, "pw": 40},
    {"name": "l1, weights 20", "mode": "l1", "wb": 20, "kb": 23},
    {"name": "l1, weights 21", "mode": "l1", "wb": 21, "kb": 23},
    {"name": "v3: l1, weights 22", "mode": "l1", "wb": 22, "kb": 23},
    {"name": "l1, weights 23", "mode": "l1", "wb": 23, "kb": 23},
    {"name": "l1, weights 24", "mode": "l1", "wb": 24, "kb": 23},
]  # fmt: skip


def _peak(x: torch.Tensor, bits: int):
    _, e = torch.frexp(x.abs().amax(-1, keepdim=True))
    e = e.to(torch.int64) - bits
    return torch.round(x * torch.exp2(-e.double())), e


def _l1(x: torch.Tensor, right: int):  # sum |X| < 2**(53 - right)
    _, e = torch.frexp(x.abs().sum(-1, keepdim=True))
    e = e.to(torch.int64) - (52 - right)
    return torch.round(x * torch.exp2(-e.double())), e


def _left(x: torch.Tensor, cfg: dict, right: int, bits_key: str):
    return _l1(x, right) if cfg["mode"] == "l1" else _peak(x, cfg[bits_key])


def install(cfg: dict):
    """Replace the fused decoder's products and attention with emulations of `cfg`."""
    from seqkv_cli.runtime.portable import fused

    def linear(self, x, *modules):
        w = torch.cat([m.weight for m in modules]).double()
        wq, ew = _peak(w, cfg["wb"])
        xq, ex = _left(x.double(), cfg, cfg["wb"], "ab")
        out = (xq @ wq.T) * torch.exp2((ex + ew.T).double())
        return [o.to(x.dtype) for o in out.split([m.weight.shape[0] for m in modules], -1)]

    def attend(state, layer, q, scaling, window, softcap):
        heads, m, hd = q.shape
        kvh, p0 = state.keys.shape[1], state.length
        n, g = p0 + m, heads // state.keys.shape[1]
        k, v = state.keys[layer, :, :n].double(), state.values[layer, :, :n].double()
        qq, eq = _left(q.float().double().reshape(kvh, g * m, hd), cfg, cfg["kb"], "ab")
        kq, ek = _peak(k, cfg["kb"])
        s = (qq @ kq.transpose(-1, -2)) * torch.exp2((eq + ek.transpose(-1, -2)).double())
        qpos = (p0 + torch.arange(m)).repeat(g)
        s = (s * scaling).masked_fill(torch.arange(n)[None, :] > qpos[:, None], -math.inf)
        num = torch.round(torch.exp(s - s.amax(-1, keepdim=True)) * 2.0**40)
        vb = cfg.get("vb", cfg["kb"])
        vq, ev = _peak(v, vb)
        wq, ew = _left(num * torch.exp2(ev.transpose(-1, -2).double()), cfg, vb, "pw")
        out = (wq @ vq) * torch.exp2(ew.double()) / num.sum(-1, keepdim=True)
        return out.view(kvh, g, m, hd).reshape(heads, m, hd).transpose(0, 1)

    fused.FusedDecoder._linear = linear
    fused.attend = attend


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, threads=2)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--generic-weights", action="store_true")
    args = parser.parse_args(argv)
    from seqkv_cli.runtime.portable import exact, fused
    from seqkv_cli.runtime.portable.model import PortableLM

    lm = harness.start(args)
    model = lm.model
    if args.generic_weights:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(1 + 0.02 * torch.randn_like(p))
    ids = torch.tensor(lm.tokenizer((SAMPLE / "prose.txt").read_text()).input_ids[: args.tokens])
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids[None], use_cache=True)
        plain = model(ids[None], use_cache=True)

    def differing(kv) -> float:
        d = n = 0
        for layer, ref in zip(kv, truth.past_key_values.layers, strict=True):
            for got, want in zip(layer, (ref.keys[0], ref.values[0]), strict=True):
                d += int((got.bfloat16() != want.bfloat16()).sum())
                n += got.numel()
        return d / n

    def bits(logits) -> float:
        lp = torch.log_softmax(logits.double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
        return float(-lp.mean() / math.log(2))

    canon = PortableLM(model, exact.NUMERIC_PATH_V3)
    inv_freq = next(f for m, f in canon._rotary if m is model.model.rotary_emb)
    decoder = fused.FusedDecoder(model, canon.weights, exact.L1, inv_freq)
    fp32 = [(layer.keys[0], layer.values[0]) for layer in plain.past_key_values.layers]
    rows = [{"name": "transformers fp32", "bf16_differ": differing(fp32),
             "bits_per_token": bits(plain.logits[0])}]  # fmt: skip
    exact_linear, exact_attend = fused.FusedDecoder._linear, fused.attend
    try:
        for cfg in CANDIDATES:
            install(cfg)
            state = canon.new_state(len(ids))
            logits = decoder.run([state], ids[None], torch.arange(len(ids))[None])[0]
            state.length = len(ids)
            kv = [state.layer_kv(i) for i in range(canon.num_layers)]
            rows.append({"name": cfg["name"], "bf16_differ": differing(kv),
                         "bits_per_token": bits(logits)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    finally:  # the emulations replace the exact kernels process-wide: put them back
        fused.FusedDecoder._linear, fused.attend = exact_linear, exact_attend
    fields = {"tokens": len(ids), "generic_weights": args.generic_weights, "rows": rows}
    return harness.finish(args, lm, markdown, **fields)


def markdown(result: dict) -> str:
    lines = [
        *harness.heading("Candidate definitions of the portable products", result),
        *table(
            ["candidate", "bf16 K/V differing from float64", "bits/token"],
            [
                [r["name"], f"{r['bf16_differ']:.3%}", f"{r['bits_per_token']:.6f}"]
                for r in result["rows"]
            ],
            align="lrr",
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
