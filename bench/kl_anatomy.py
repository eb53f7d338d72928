"""Where a quantized MoE's KL comes from, on a trained fixture (bench/fixture.py): one quantkit conversion
(quality.py's recipe names, the same 64 x 128 calibration windows), then on held-out windows

- the KL(bf16 || q) of the whole quantized model, and of the BF16 model with only one decoder layer's routed
  experts replaced by their quantized values (is the error additive over layers, or does it compound?);
- routing flips: per layer, the share of tokens whose top-k expert set differs between the BF16 and the
  quantized model, and the share of the KL carried by tokens with any flip.

    python -m bench kl_anatomy [--fixture default] [--method gptq-mse-aff-refit-cd2] [--group 32] [--windows 256]
    python -m bench kl_anatomy --smoke   # the tiny fixture, RTN, 8 windows
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import REPO, Run, add_common_args, id_rows, measure_cmd, scratch_dir
from bench.quality import FIXTURES, get_fixture, heldout_windows, windows


@torch.no_grad()
def logprobs_and_picks(model, ids: torch.Tensor, batch: int = 32):
    """Log-probabilities [W, T, V] and each MoE router's top-k indices per layer [W*T, k]."""
    picks: list[list[torch.Tensor]] = []
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    lps = []
    for i in range(0, len(ids), batch):
        got = []
        hooks = [r.register_forward_hook(lambda mod, a, o: got.append(o[-1] if isinstance(o, tuple) else
                                                                        o.topk(2, -1).indices)) for r in routers]
        lps.append(F.log_softmax(model(ids[i:i + batch]).logits.float(), -1))
        for h in hooks:
            h.remove()
        picks.append(got)
    layers = [torch.cat([p[j] for p in picks]) for j in range(len(routers))]
    return torch.cat(lps), layers


def kl(ref: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return (ref.exp() * (ref - lp)).sum(-1).flatten()


def main(argv=None) -> int:
    from quantkit.testing import load_model

    ap = argparse.ArgumentParser(prog="python -m bench kl_anatomy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="default", choices=sorted(FIXTURES))
    ap.add_argument("--method", default="gptq-mse-aff-refit-cd2")
    ap.add_argument("--group", default="32")
    ap.add_argument("--windows", type=int, default=256)
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    n_calib = 64
    if a.smoke:
        a.fixture, a.method, a.windows, n_calib = "tiny", "rtn", 8, 4
    run = Run("kl_anatomy", a, argv)
    fx = get_fixture(FIXTURES[a.fixture])
    src = Path(fx["model_dir"])
    train, held = torch.load(fx["train_tokens"]), torch.load(fx["heldout_tokens"])
    ev = heldout_windows(held, 128, a.windows, seed=1)
    work = scratch_dir("qk-anatomy-")
    calib = work / "calib.jsonl"
    id_rows(calib, windows(train, 128, n_calib, seed=2))
    out = work / "q"
    measure_cmd([sys.executable, "-m", "bench.quality", "--child", a.method, a.group, str(src), str(out), str(calib),
                 str(n_calib), "128"], cwd=REPO, check=True)
    base, quant = load_model(src, torch.float32).eval(), load_model(out, torch.float32).eval()
    ref, ref_picks = logprobs_and_picks(base, ev)
    lp, q_picks = logprobs_and_picks(quant, ev)
    k = kl(ref, lp)
    res = {"fixture": a.fixture, "method": a.method, "group": a.group, "windows": a.windows, "kl": float(k.mean()),
           "layers": []}
    anyflip = torch.zeros_like(k, dtype=torch.bool)
    for j, (x, y) in enumerate(zip(ref_picks, q_picks)):
        flip = (x.sort(-1).values != y.sort(-1).values).any(-1)
        anyflip |= flip
        alone = copy.deepcopy(base)
        alone.model.layers[j].mlp.experts.load_state_dict(quant.model.layers[j].mlp.experts.state_dict())
        res["layers"].append({"layer": j, "kl_alone": float(kl(ref, logprobs_and_picks(alone, ev)[0]).mean()),
                              "flipped_tokens": float(flip.float().mean())})
        del alone
    res["kl_sum_of_layers_alone"] = sum(r["kl_alone"] for r in res["layers"])
    res["tokens_with_a_flip"] = float(anyflip.float().mean())
    res["kl_share_of_flipped_tokens"] = float(k[anyflip].sum() / k.sum())
    print(json.dumps(res, indent=1))
    layers = res.pop("layers")
    run.write(layers, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
