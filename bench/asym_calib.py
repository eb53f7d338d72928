"""Does asymmetric calibration help GPTQ of routed experts? A measurement on the trained fixtures, outside the
convert pipeline (its own layer loop, quantkit's GPTQ core for every solve).

    python -m bench asym_calib [--fixture default|skewed128] [--groups 32 128] [--num-samples 64]
    python -m bench asym_calib --smoke   # the tiny fixture, g32, sym only, 4 samples, 8 windows

GPTQ fits each expert's quantized weights W' to the inputs the quantized model feeds it, X_q (true-sequential:
every earlier layer already quantized), against the target W X_q. Asymmetric calibration (GPTAQ, "GPTQv2")
fits them against what the unquantized model computes there, W X_fp, the unquantized model's inputs for the
same tokens: min ||X_q W'^T - X_fp W^T||^2. With H = X_q^T X_q and A = X_fp^T X_q that is GPTQ of
W* = W + W (A - H) H^-1 (damped like GPTQ's H) under H, so each layer also undoes part of the error the layers
before it left in its inputs. Rows are paired by token; routing is the quantized model's.

Variants, each a whole 4-layer pass with the same calibration windows, judged by KL(bf16 || q) on held-out
windows (bench/quality.py's windows):

- `sym`: plain GPTQ of gate/up under X_q; down_proj's inputs from the unquantized gate/up on X_q (as
  quantkit's pass computes them)
- `asym-gu`: gate/up asymmetric; down as in `sym`
- `asym`: gate/up asymmetric; down_proj fitted to the unquantized model's down outputs, its inputs those the
  quantized gate/up produce
- `asym-unq`: the same, but down_proj's inputs from the unquantized gate/up on X_q (the inputs quantkit's
  pass already computes for its Hessian)

Prints one line per variant and group size.
"""

from __future__ import annotations

import argparse
import inspect
import sys

import torch
import torch.nn.functional as F

from bench.harness import Run, add_common_args
from bench.quality import FIXTURES, heldout_windows, windows
from quantkit.quant.gptq import gptq, refine_codes, refit_scales
from quantkit.quant.int4 import dequantize
from quantkit.testing import load_model


def mlp_inputs(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """[tokens, hidden] float32: what decoder layer `layer`'s MoE block receives for `ids`."""
    got = {}

    def hook(_m, args):
        got["x"] = args[0].reshape(-1, args[0].shape[-1]).detach().clone()
        raise StopForward

    h = model.model.layers[layer].mlp.register_forward_pre_hook(hook)
    try:
        model(ids)
    except StopForward:
        pass
    finally:
        h.remove()
    return got["x"]


class StopForward(Exception):
    pass


ALPHA = 1.0  # the asymmetric correction's weight (--alpha)
PLUS = False  # --plus


def solve(w: torch.Tensor, xq: torch.Tensor, xfp: torch.Tensor | None, group: int, damp: float = 0.01) -> torch.Tensor:
    """Dequantized GPTQ of w [N, K] on input rows xq [n, K]; with xfp (the same tokens' unquantized-model
    inputs) asymmetric."""
    n = max(xq.shape[0], 1)
    h = (2.0 / n) * (xq.T.double() @ xq.double())
    target = w.double()
    if xfp is not None:
        a = (2.0 / n) * (xfp.T.double() @ xq.double())
        hd = h + damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
        target = target + ALPHA * (target @ (a - h) @ torch.linalg.inv(hd))
    t, hf = target.float()[None], h.float()[None]
    observer = "mse" if PLUS else "minmax"
    if "args" in inspect.signature(gptq).parameters:  # quant/gptq.py with GPTQArgs
        from quantkit.quant.gptq import GPTQArgs

        r = gptq(t, hf, GPTQArgs(num_bits=4, group_size=group, symmetric=True, damp=damp, actorder=True,
                                 block_size=128, observer=observer))
    else:
        r = gptq(t, hf, 4, group, True, damp=damp, actorder=True, block_size=128, observer=observer)
    if PLUS:  # int4-experts-gptq-plus's steps after the solve: refitted scales, two coordinate-descent sweeps
        r.qparams.scale.copy_(refit_scales(t, r.q, r.qparams.scale, hf, r.damping)[0])
        qp = r.qparams if "qparams" in inspect.signature(refine_codes).parameters else r.qparams.scale
        r.q.copy_(refine_codes(t, r.q, qp, hf, r.damping, num_bits=4, sweeps=2)[0])
    return dequantize(r.q, r.qparams.scale)[0]


@torch.no_grad()
def quantize(fp_model, q_model, calib: torch.Tensor, group: int, variant: str) -> None:
    for li, layer in enumerate(q_model.model.layers):
        xq = mlp_inputs(q_model, calib, li)
        xfp = mlp_inputs(fp_model, calib, li)
        mlp, fmlp = layer.mlp, fp_model.model.layers[li].mlp
        _, _, idx = mlp.gate(xq)
        ex, fex = mlp.experts, fmlp.experts
        inter = ex.down_proj.shape[-1]
        for e in range(ex.gate_up_proj.shape[0]):
            rows = (idx == e).any(-1).nonzero().flatten()
            if rows.numel() == 0:
                continue
            a, b = xq[rows], xfp[rows]
            wgu = fex.gate_up_proj[e].float()  # [2I, H]: gate rows first
            qgu = solve(wgu, a, b if variant != "sym" else None, group)
            ex.gate_up_proj[e].copy_(qgu)
            wd = fex.down_proj[e].float()  # [H, I]
            g_fp, u_fp = (a @ wgu.T).split(inter, -1)
            h_unq = F.silu(g_fp) * u_fp  # down's inputs from the unquantized gate/up on X_q
            if variant in ("asym", "asym-unq"):
                gb, ub = (b @ wgu.T).split(inter, -1)
                if variant == "asym":
                    g_q, u_q = (a @ qgu.T).split(inter, -1)
                    qd = solve(wd, F.silu(g_q) * u_q, F.silu(gb) * ub, group)
                else:
                    qd = solve(wd, h_unq, F.silu(gb) * ub, group)
            else:
                qd = solve(wd, h_unq, None, group)
            ex.down_proj[e].copy_(qd)


@torch.no_grad()
def kl(fp_model, q_model, ids: torch.Tensor, batch: int = 32) -> float:
    tot, n = 0.0, 0
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch]
        p = F.log_softmax(fp_model(x).logits.float()[:, :-1], -1)
        q = F.log_softmax(q_model(x).logits.float()[:, :-1], -1)
        tot += float((p.exp() * (p - q)).sum(-1).double().sum())
        n += p.shape[0] * p.shape[1]
    return tot / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench asym_calib", description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", default="default", choices=sorted(FIXTURES))
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--variants", nargs="+", default=["sym", "asym-gu", "asym"])
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=512)
    ap.add_argument("--plus", action="store_true", help="MSE scales, refitted scales and two sweeps (gptq-plus)")
    ap.add_argument("--alpha", type=float, default=1.0, help="weight of the asymmetric correction")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.fixture, a.groups, a.variants, a.num_samples, a.eval_windows = "tiny", [32], ["sym"], 4, 8
    run = Run("asym_calib", a, argv)
    global ALPHA, PLUS
    ALPHA, PLUS = a.alpha, a.plus
    from bench.quality import get_fixture

    fx = get_fixture(FIXTURES[a.fixture])
    train, held = torch.load(fx["train_tokens"]), torch.load(fx["heldout_tokens"])
    calib = windows(train, a.seq_len, a.num_samples, seed=2)
    eval_ids = heldout_windows(held, a.seq_len, a.eval_windows, seed=1)
    fp_model = load_model(fx["model_dir"], torch.float32).eval()
    rows = []
    for group in a.groups:
        for variant in a.variants:
            q_model = load_model(fx["model_dir"], torch.float32).eval()
            quantize(fp_model, q_model, calib, group, variant)
            rows.append({"fixture": a.fixture, "group": group, "variant": variant, "kl": kl(fp_model, q_model, eval_ids)})
            print(f"{a.fixture} g{group} {variant}: kl {rows[-1]['kl']:.4e}", flush=True)
    run.write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
