"""The quality fixture: a tiny Mixture-of-Experts language model trained deterministically on the Python
standard library's own sources (present on every machine), byte-level (vocab 256), with a held-out split.

    python -m bench fixture            # train (or reuse) and print where it is cached
    python -m bench fixture --wide     # the 256-wide variant (hidden and expert width 256) for W4AFP8
    python -m bench fixture --skewed   # 32 experts, top-4, skewed routing: expert coverage matters
    python -m bench fixture --skewed128  # the same with expert width 128 (group 128 fits)
    python -m bench fixture --normtopk   # norm_topk_prob true (llama.cpp's routing), 1200 steps: the GGUF export's
    python -m bench fixture --massive    # NORMTOPK trained with 4 massive residual channels (bench/rotate.py)
    python -m bench fixture --smoke      # TINY: 2 layers, 5 steps on 400 kB (seconds; the other benches' smoke case)

The model is cached under bench/.cache/fixture-<hash>/ (a normal transformers checkpoint + the token
splits as .pt files); the hash covers every training setting, so changing one retrains.
Training uses a fixed seed, a fixed thread count and a fixed data order, so it reproduces on a machine
of the same kind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.harness import CACHE, Run, add_common_args


@dataclass(frozen=True)
class FixtureSpec:
    hidden: int = 128
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    seq_len: int = 128
    batch: int = 32
    steps: int = 2400
    warmup: int = 100
    lr: float = 3e-3
    corpus_bytes: int = 6_000_000
    seed: int = 0
    threads: int = 2
    norm_topk: bool = False  # Qwen3-MoE's norm_topk_prob (its config class defaults to false; releases set true)
    # massive residual channels: `offset_channels` channels of every embedding row start at +`offset` (a fixed
    # random choice) and train from there, so the residual stream carries large, token-independent channels, as
    # released LLMs' residual streams do (the "massive activations" that act as biases)
    offset: float = 0.0
    offset_channels: int = 0

    @property
    def key(self) -> str:
        d = asdict(self)
        for k in ("norm_topk", "offset", "offset_channels"):  # fixtures trained before a field existed keep their key
            if not d[k]:
                del d[k]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


# vLLM's W4AFP8 MoE kernels need hidden and expert widths that are multiples of 256 (docs/engine.md rule W2):
# the same recipe of model, twice as wide, trained half as long (~23 min on this machine).
WIDE = FixtureSpec(hidden=256, moe_intermediate=256, steps=1200)
# Expert coverage matters when there are many experts and the router prefers some: 32 experts, top-4, half
# as wide each (the same expert FLOPs per token), trained without a load-balancing loss (Qwen3-MoE adds its
# aux loss only with output_router_logits), so the router's preferences grow unchecked; `routing` measures
# how skewed the result is.
SKEWED = FixtureSpec(experts=32, top_k=4, moe_intermediate=64, steps=1600)
# ... and with experts as wide as the first fixture's, so that group 128 divides the down projection's input
# (width 64 admits no g128: every tool refuses it)
SKEWED128 = replace(SKEWED, moe_intermediate=128)
# llama.cpp's qwen3moe graph always renormalizes the top-k routing weights, as the released Qwen3-MoE configs ask
# (norm_topk_prob: true): the fixture the GGUF export is measured on (bench/gguf_export.py), trained half as long
NORMTOPK = FixtureSpec(norm_topk=True, steps=1200)
# the same trained with 4 massive residual channels (+8 at the embedding; the trained residual stream's channels
# have an RMS of ~1-1.5): bench/rotate.py's model where outliers are part of what was learned, not planted after
MASSIVE = replace(NORMTOPK, offset=8.0, offset_channels=4)
# the smoke case of the benches that need a trained fixture: trained for seconds, so its figures mean nothing
TINY = FixtureSpec(layers=2, steps=5, warmup=2, batch=8, corpus_bytes=400_000)


def stdlib_corpus(limit: int) -> tuple[bytes, bytes]:
    """(train, heldout) bytes: stdlib .py files in sorted order; every 10th file (by sorted index) is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts)
    train, held = bytearray(), bytearray()
    for i, p in enumerate(files):
        try:
            b = p.read_bytes()
        except OSError:
            continue
        (held if i % 10 == 0 else train).extend(b)
        if len(train) + len(held) >= limit:
            break
    return bytes(train), bytes(held)


def config_for(spec: FixtureSpec):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.hidden // spec.heads,
        moe_intermediate_size=spec.moe_intermediate, num_experts=spec.experts, num_experts_per_tok=spec.top_k,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=spec.seq_len, tie_word_embeddings=False,
        router_aux_loss_coef=0.01, output_router_logits=False, norm_topk_prob=spec.norm_topk)


def get_fixture(spec: FixtureSpec = FixtureSpec(), log=print) -> dict:
    """Train the fixture (or reuse the cached one); returns {model_dir, train_tokens, heldout_tokens}."""
    from transformers import AutoModelForCausalLM

    out = CACHE / f"fixture-{spec.key}"
    done = out / "fixture.json"
    if done.is_file():
        return {"model_dir": out / "model", "train_tokens": out / "train.pt", "heldout_tokens": out / "heldout.pt",
                **json.loads(done.read_text())}
    torch.manual_seed(spec.seed)
    torch.set_num_threads(spec.threads)
    train, held = stdlib_corpus(spec.corpus_bytes)
    tr = torch.frombuffer(bytearray(train), dtype=torch.uint8).long()
    he = torch.frombuffer(bytearray(held), dtype=torch.uint8).long()
    # the eager expert loop: on this CPU 0.36 s per batch-32 training step, against 18 s for batched_mm and
    # 0.53 s for grouped_mm (measured side by side)
    model = AutoModelForCausalLM.from_config(config_for(spec), experts_implementation="eager")
    if spec.offset_channels:
        with torch.no_grad():
            pick = torch.Generator().manual_seed(spec.seed + 1)
            ch = torch.randperm(spec.hidden, generator=pick)[:spec.offset_channels]
            model.model.embed_tokens.weight[:, ch] += spec.offset
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(spec.seed)
    t0 = time.time()
    for step in range(spec.steps):
        lr = spec.lr * min(1.0, (step + 1) / spec.warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(tr) - spec.seq_len - 1, (spec.batch,), generator=gen)
        x = torch.stack([tr[s:s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == spec.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s")
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out / "model", max_shard_size="2MB")
    torch.save(tr, out / "train.pt")
    torch.save(he, out / "heldout.pt")
    meta = {"spec": asdict(spec), "train_seconds": round(time.time() - t0, 1), "train_bytes": len(tr),
            "heldout_bytes": len(he), "final_loss": float(loss)}
    done.write_text(json.dumps(meta, indent=2))
    return get_fixture(spec, log)


@torch.no_grad()
def routing(model_dir, tokens: torch.Tensor, seq_len: int = 128, windows: int = 64) -> list[dict]:
    """Per MoE layer, how the router spreads `windows` x `seq_len` held-out tokens over the experts: each
    expert's share of the routed (token, slot) pairs, as max / min / quartiles relative to an even share,
    and how many experts get under a quarter of it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = min(windows, len(tokens) // seq_len)
    x = tokens[:n * seq_len].view(n, seq_len)
    counts = {}

    def hook(name, n_exp):
        def f(mod, args, out):                       # Qwen3-MoE's router returns (logits, weights, indices)
            counts[name] = torch.bincount(out[2].flatten(), minlength=n_exp)
        return f
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            mod.register_forward_hook(hook(name, model.config.num_experts))
    model(x)
    out = []
    for name, c in counts.items():
        share = c.double() / c.sum() * len(c)          # 1.0 = an even share
        q = torch.quantile(share, torch.tensor([0.25, 0.5, 0.75], dtype=torch.double))
        out.append({"layer": name, "max": round(float(share.max()), 3), "min": round(float(share.min()), 3),
                    "quartiles": [round(float(v), 3) for v in q], "under_quarter": int((share < 0.25).sum())})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fixture", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the spec's)")
    ap.add_argument("--wide", action="store_true", help="the 256-wide fixture (W4AFP8's width rule)")
    ap.add_argument("--skewed", action="store_true", help="the 32-expert top-4 fixture with skewed routing")
    ap.add_argument("--skewed128", action="store_true", help="the same with expert width 128")
    ap.add_argument("--normtopk", action="store_true", help="norm_topk_prob true, as llama.cpp routes (GGUF export)")
    ap.add_argument("--massive", action="store_true", help="the same trained with 4 massive residual channels")
    add_common_args(ap, repeat=None)
    a = ap.parse_args(argv)
    spec = (TINY if a.smoke else WIDE if a.wide else SKEWED if a.skewed else SKEWED128 if a.skewed128
            else NORMTOPK if a.normtopk else MASSIVE if a.massive else FixtureSpec())
    if a.steps is not None:
        spec = replace(spec, steps=a.steps)
    run = Run("fixture", a, argv)
    fx = get_fixture(spec)
    print(json.dumps({k: str(v) for k, v in fx.items()}, indent=2))
    rows = routing(fx["model_dir"], torch.load(fx["heldout_tokens"]), spec.seq_len)
    for r in rows:
        print(json.dumps(r))
    run.write(rows, {k: v for k, v in fx.items() if k not in ("model_dir", "train_tokens", "heldout_tokens")},
              tag=spec.key)
    return 0


if __name__ == "__main__":
    main()
