"""The residual rotation (recipe `rotate: {kind: hadamard}`) against none, side by side on the trained quality
fixture: NVFP4 W4A4 GPTQ, NVFP4 W4A16, MXFP4 W4A16 (RTN, the shipped recipes) and INT4 W4A16 GPTQ
(int4-experts-gptq), each converted with and without the rotation from the same BF16 fixture on the same
calibration tokens, then `quantkit verify --reference` on held-out text: next-token KL, top-1, the convert's wall
time and peak RSS (`quantkit convert --json` in a process of its own, its RSS polled); then llm-compressor's
rotations on the same models and tokens (GPTQ NVFP4 W4A4 without and with SpinQuant R1 + R2 and QuIP, and
SpinQuant's rotation alone; `PEER_SCRIPT`); then convert time and peak RSS on a 0.6 GB synthetic qwen3_moe (hidden
2048) and on one 1.5 GB layer of 128 experts, RTN with and without the rotation. About 25 minutes on 2 cores (the peer rows ~12 of them).

    python -m bench rotate [--seed S] [--skip-massive] [--peer-python PY | --skip-peer] [--smoke]
                               # --smoke: the 5-step fixture, INT4 RTN only, no peer, no massive fixture

The fixture is bench/fixture.py's NORMTOPK (a byte-level qwen3_moe, hidden 128: one 128-wide Hadamard block,
trained norms whose gains the rotation folds into the readers). Calibration: 64 x 256 bytes of training text;
evaluation: 16 x 256 held-out bytes. Each row's `ratio_kl` and `ratio_convert_s` compare it with the same recipe
unrotated; the RTN recipes run a second seed too, the FP4 recipes a rotation bounded to one block per group
(`rotate.block` 16 / 32).

That fixture's residual stream has no outliers (the summary's `kurtosis` and `max_over_rms` of the inputs to
q_proj and the router: a Gaussian's 3 and ~3-4), so the rotation has nothing to spread there. The same model with
outlier channels (`--outlier-channels N --outlier-gain K`, default 4 and 16: N channels of every RMSNorm gain
times K, the matching input columns of every Linear that reads the norm divided by K; K a power of two, so the
model computes the same logits bit for bit) is measured beside it: the rows whose `model` is `outliers`. Folding
the norm gains into the readers undoes that planting exactly, so it shows what a rotation does to outliers that
carry signal through a norm gain. The third model, `massive`, is bench/fixture.py's MASSIVE: the same recipe
trained with 4 massive residual channels (token-independent, like the massive activations of released LLMs),
so the outliers are part of what was learned and no folding removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.harness import (PEER_PYTHON, Run, Skip, add_common_args, last_json, llamacpp_run_gguf, mib, peer_available,
                           run_quantkit, verify_json, vllm_load_check)


ROTATE = "rotate: {{kind: hadamard, seed: {seed}}}\n"
ROTATE_BLOCK = "rotate: {{kind: hadamard, seed: {seed}, block: {block}}}\n"
# NVFP4 W4A4 with GPTQ: bench/w4a4.py's --trained recipe
NVFP4A4_GPTQ = """
name: nvfp4a4-experts-gptq
groups:
  experts:
    targets: ['re:.*\\.mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$']
    method: gptq
    scheme: {num_bits: 4, type: float, symmetric: true, strategy: tensor_group, activations: nvfp4}
    options: {damp: 0.01, actorder: true, block_size: 128, fallback: all_tokens}
ignore: ['re:.*\\.mlp\\.gate$', 'lm_head']
"""


def outlier_model(src: Path, dst: Path, channels: int, gain: int) -> Path:
    """`src` (a qwen3_moe checkpoint: its RMSNorms' readers named as arch/residual.py names them) with `channels`
    outlier channels: each norm gain in front of the residual's readers times `gain` on those channels, the
    readers' matching input columns divided by it. A power-of-two gain scales exactly: the same function."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if gain < 1 or gain & (gain - 1):
        raise SystemExit("--outlier-gain must be a power of two")
    readers = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "post_attention_layernorm": ("mlp.gate", "mlp.experts.", "mlp.shared_expert.")}
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    hidden = None
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors[f.name] = load_file(str(f))
        hidden = hidden or next(t.shape[-1] for n, t in tensors[f.name].items() if n.endswith("norm.weight")
                                and "self_attn" not in n)
    idx = torch.randperm(hidden, generator=torch.Generator().manual_seed(0))[:channels]
    names = {n: f for f, ts in tensors.items() for n in ts}
    changed = 0
    for n, f in names.items():
        t = tensors[f][n]
        norm = next((k for k in readers if n.endswith(f"{k}.weight")), None)
        if norm is not None or n == "model.norm.weight":
            t[idx] *= gain
            changed += 1
            continue
        layer = n.split(".layers.")[1].split(".")[0] if ".layers." in n else None
        reads = any(f".layers.{layer}.{r}" in n and n.endswith(("gate.weight", "q_proj.weight", "k_proj.weight",
                                                                   "v_proj.weight", "gate_proj.weight", "up_proj.weight"))
                    for rs in readers.values() for r in rs) or n == "lm_head.weight"
        if reads:
            t[:, idx] /= gain
            changed += 1
    for f, ts in tensors.items():
        save_file(ts, str(dst / f), metadata={"format": "pt"})
    print(f"outlier model: {changed} tensors changed, channels {idx.tolist()} x {gain}", file=sys.stderr)
    return dst


# llm-compressor's rotations on the same model, calibration rows and held-out rows (bench/setup_peers.sh's venv):
# its MoE experts made Linears (linearize_moe) and qwen3_moe's router wrapped in one (what its own Cohere2-MoE
# preparation does), SpinQuant's mappings registered for the architecture (its on_initialize infers them from the
# registries, over any passed in), then oneshot with GPTQ NVFP4 on the same expert targets, damp 0.01, block 128.
# KL(ref || quantized) per position on the held-out rows, the reference being the source in float32, as verify.
PEER_SCRIPT = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM

src, ids_path, rotation, quantize = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
ids = json.load(open(ids_path))
cal, ev = torch.tensor(ids["cal"]), torch.tensor(ids["eval"])
torch.manual_seed(0)
from datasets import Dataset
import importlib.metadata as md
from llmcompressor import oneshot
from llmcompressor.modeling.fuse import fuse_norm_linears
from llmcompressor.modeling.moe.linearize import linearize_moe
from llmcompressor.modifiers.quantization import GPTQModifier
from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier
from llmcompressor.modifiers.transform.spinquant import base as spinquant_base
from llmcompressor.modifiers.transform.spinquant.mappings import SPINQUANT_MAPPING_REGISTRY, SpinQuantMapping
from llmcompressor.modifiers.transform.spinquant.norm_mappings import NORM_MAPPING_REGISTRY, NormMapping


class LinearRouter(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.hidden_dim = router.top_k, router.norm_topk_prob, router.hidden_dim
        self.linear = torch.nn.Linear(router.hidden_dim, router.num_experts, bias=False, dtype=router.weight.dtype)
        self.linear.weight.data.copy_(router.weight.data)

    def forward(self, hidden_states):
        logits = self.linear(hidden_states.reshape(-1, self.hidden_dim))
        top, idx = torch.topk(torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx


def logprobs(m):  # and the routed expert sets of every router call, sorted: [token-layers, top_k]
    chosen = []
    hooks = [mod.register_forward_hook(lambda _m, _i, out: chosen.append(out[-1].reshape(-1, out[-1].shape[-1])))
             for name, mod in m.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        lp = m(input_ids=ev).logits.float().log_softmax(-1)
    for h in hooks:
        h.remove()
    return lp, torch.cat(chosen).sort(-1).values


ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
lp_ref, experts_ref = logprobs(ref)
del ref
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
linearize_moe(model)
for layer in model.model.layers:
    layer.mlp.gate = LinearRouter(layer.mlp.gate)
experts = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
recipe = []
if rotation.startswith("spinquant"):
    for layer in model.model.layers:  # the norm in front of every expert and the router, fused as for Cohere2-MoE
        readers = [layer.mlp.gate.linear] + [p for e in layer.mlp.experts if hasattr(e, "gate_proj")
                                             for p in (e.gate_proj, e.up_proj)]
        fuse_norm_linears(layer.post_attention_layernorm, readers)
    SPINQUANT_MAPPING_REGISTRY[type(model).__name__] = SpinQuantMapping(
        embedding=r"re:.*embed_tokens$", attn=r"re:.*self_attn$", attn_q=r"re:.*q_proj$", attn_k=r"re:.*k_proj$",
        attn_v=r"re:.*v_proj$", attn_o=r"re:.*o_proj$", mlp_out=[r"re:.*experts\.\d+\.down_proj$"],
        mlp_in=[r"re:.*experts\.\d+\.up_proj$", r"re:.*experts\.\d+\.gate_proj$", r"re:.*mlp\.gate\.linear$"],
        lm_head="lm_head")
    NORM_MAPPING_REGISTRY[type(model).__name__] = [
        NormMapping(norm=r"re:.*input_layernorm$", linears=[r"re:.*q_proj$", r"re:.*k_proj$", r"re:.*v_proj$"]),
        NormMapping(norm="model.norm", linears=["lm_head"])]
    if rotation == "spinquant-nocenter":  # its embedding centering is not a function-preserving step under RMSNorm
        spinquant_base.center_embeddings = lambda embedding: None
    recipe.append(SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"))
elif rotation == "quip":
    recipe.append(QuIPModifier(rotations=["v", "u"], transform_type="random-hadamard", targets=[experts]))
if quantize:
    recipe.append(GPTQModifier(targets=[experts], scheme="NVFP4", ignore=["lm_head", r"re:.*mlp\.gate.*"],
                               block_size=128, dampening_frac=0.01))
ds = Dataset.from_dict({"input_ids": cal.tolist(), "attention_mask": torch.ones_like(cal).tolist()})
t = time.perf_counter()
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(cal), max_seq_length=cal.shape[1])
seconds = time.perf_counter() - t
lp, experts = logprobs(model.float().eval())
print(json.dumps({"kl": float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean()),
                  "top1": float((lp_ref.argmax(-1) == lp.argmax(-1)).float().mean()), "oneshot_s": round(seconds, 3),
                  "router_same": float((experts_ref == experts).all(-1).float().mean()),
                  "llmcompressor": md.version("llmcompressor")}))
"""
# (rotation, quantize): GPTQ NVFP4 W4A4 without and with each rotation, and SpinQuant's rotation alone (its KL to
# the source: what the rotation itself costs before any quantization)
PEER_CASES = [("none", True), ("spinquant", True), ("spinquant-nocenter", True), ("quip", True),
              ("spinquant", False), ("spinquant-nocenter", False)]


def peers(python: Path, models: dict, tmp: Path, cal_ids: list, ev_ids: list) -> list[dict]:
    """llm-compressor's GPTQ NVFP4 W4A4 on each model without and with SpinQuant (R1 + R2, Hadamard; as shipped,
    and with its embedding centering off) and QuIP (U and V, random Hadamard), and SpinQuant's rotation alone."""
    import subprocess

    script, ids = tmp / "peer_rotate.py", tmp / "peer_ids.json"
    script.write_text(PEER_SCRIPT)
    ids.write_text(json.dumps({"cal": cal_ids, "eval": ev_ids}))
    rows = []
    for model, src in models.items():
        base = None
        for rotation, quantize in PEER_CASES:
            r = subprocess.run([str(python), str(script), str(src), str(ids), rotation, "1" if quantize else "0"],
                               capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
            if r.returncode != 0:
                raise SystemExit(f"llm-compressor ({rotation}) failed: {r.stderr[-2000:]}")
            doc = last_json(r.stdout)
            row = {"model": model, "tool": f"llm-compressor {doc['llmcompressor']}",
                   "recipe": "nvfp4a4-experts-gptq" if quantize else "rotation only", "rotation": rotation,
                   "kl": doc["kl"], "top1": doc["top1"], "convert_s": doc["oneshot_s"]}
            if not quantize:
                row["router_same"] = doc["router_same"]
            if quantize and base is None:
                base = row
            elif quantize:
                row["ratio_kl"] = round(row["kl"] / base["kl"], 3) if base["kl"] else None
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def rotation_alone(src: Path, out: Path, ids) -> dict:
    """The rotated BF16 model `out` against its source `src` on `ids`, both in float32 (what the rotation and its
    one rounding to BF16 cost, apart from BF16 arithmetic): KL(source || rotated) per position (mean and median),
    top-1 agreement, the share of router calls x tokens whose top-k expert sets are equal, and how much of the KL
    the tokens whose routed set changed in some layer carry (`kl_routing_same`: the mean over the others). Then
    each model run in BF16 against itself in float32 (`bf16_kl_source`, `bf16_kl`, and their medians): how much
    more the rotated model feels BF16 arithmetic, which every BF16 engine adds."""
    import torch
    from transformers import AutoModelForCausalLM

    def run(path, dtype=torch.float32):
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        chosen = []
        for n, mod in m.named_modules():
            if n.endswith("mlp.gate"):
                mod.register_forward_hook(lambda _m, _i, o: chosen.append(o[-1].reshape(-1, o[-1].shape[-1])))
        with torch.no_grad():
            lp = m(input_ids=ids).logits.float().log_softmax(-1)
        return lp.flatten(0, -2), torch.stack(chosen).sort(-1).values  # [tokens, vocab], [layers, tokens, top_k]

    def kl(a, b):  # per token
        return (a.exp() * (a - b)).sum(-1)

    (la, ea), (lb, eb) = run(src), run(out)
    k = kl(la, lb)
    same = (ea == eb).all(-1)
    moved = ~same.all(0)  # tokens whose routed set changed in some layer
    k_src16, k_rot16 = kl(la, run(src, torch.bfloat16)[0]), kl(lb, run(out, torch.bfloat16)[0])
    return {"kl": float(k.mean()), "kl_median": float(k.median()),
            "top1": float((la.argmax(-1) == lb.argmax(-1)).float().mean()), "router_same": float(same.float().mean()),
            "routing_changed_tokens": int(moved.sum()), "kl_routing_same": float(k[~moved].mean()),
            "bf16_kl_source": float(k_src16.mean()), "bf16_kl": float(k_rot16.mean()),
            "bf16_kl_source_median": float(k_src16.median()), "bf16_kl_median": float(k_rot16.median())}


def activation_stats(model_dir: Path, ids) -> tuple[dict, object]:
    """The inputs of every q_proj and router (the residual's readers after their norms) on `ids`: the largest
    kurtosis over them (a Gaussian: 3) and the median per token of max|x| / rms(x); and the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    xs = []
    for n, mod in m.named_modules():
        if n.endswith(("self_attn.q_proj", "mlp.gate")):
            mod.register_forward_hook(lambda _m, inp, _o: xs.append(inp[0].reshape(-1, inp[0].shape[-1]).detach()))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    kurt = max(float(((x - x.mean(0)) ** 4).mean() / ((x - x.mean(0)) ** 2).mean() ** 2) for x in xs)
    ratio = float(torch.cat([x.abs().amax(-1) / x.pow(2).mean(-1).sqrt() for x in xs]).median())
    return {"kurtosis": round(kurt, 1), "max_over_rms": round(ratio, 1)}, logits


def engines(args, fx, tmp: Path, cal: str, ev_ids: str, n_cal: int, n_eval: int, length: int) -> list[dict]:
    """The rotated outputs in the engines, beside the unrotated ones: each recipe converted with and without the
    rotation, exported to GGUF and run in llama.cpp (bench.harness.llamacpp_run_gguf: llama.cpp's logits against
    the checkpoint's in transformers, on the held-out windows, and 16 greedy tokens), and put through vLLM
    0.33.0's loader (bench/vllm_check.py) with `--vllm PY`."""
    from quantkit.export import export
    from quantkit.match.recipe import load_recipe, parse_recipe

    rows = []
    src = Path(fx["model_dir"])
    names = ["int4-experts-rtn"] if args.smoke else ["int4-experts-rtn", "int4-experts-gptq", "mxfp4-experts",
                                                     "nvfp4-experts"]
    # first the rotation alone: the BF16 source itself (exported as it is) and its rotated BF16 output
    for name in ["rotation only"] + names:
        for seed in (None, args.seed):
            tag = f"engines-{name.replace(' ', '-')}-{'plain' if seed is None else 'rot%d' % seed}"
            if name == "rotation only" and seed is None:
                out = src  # the BF16 source, exported as it is
            else:
                out = tmp / tag
                text = (ROTATE.format(seed=seed) if seed is not None else "") + (
                    load_recipe(name).text if name != "rotation only" else "")
                yaml = tmp / f"{tag}.yaml"
                yaml.write_text(parse_recipe(text, name).text)
                run_quantkit(["convert", src, out, "--recipe", yaml, "--dataset", cal, "--num-samples", n_cal,
                              "--seq-len", length])
            gguf = tmp / f"{tag}.gguf"
            export(out, gguf)
            doc = llamacpp_run_gguf(gguf, src, out, dataset=ev_ids, num_samples=n_eval, seq_len=length,
                                    generation_tokens=16)
            e = doc["engine_run"]
            row = {"model": "trained", "recipe": name, "rotation": "none" if seed is None else f"hadamard seed {seed}",
                   "kl_source_checkpoint": e["kl_source_checkpoint"], "kl_checkpoint_llamacpp": e["kl_divergence"],
                   "ratio_engine": e["kl_engine_vs_quantization"], "top1_llamacpp": e["top1_agreement"],
                   "generation_agreement": (e.get("generation") or {}).get("agreement"), "passed": doc["passed"]}
            if args.vllm:
                v = vllm_load_check(args.vllm, out)
                row.update(vllm_accepted=v["accepted"], vllm_dropped=v["dropped"], vllm_unwritten=v["unwritten"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def recipes(smoke: bool) -> dict[str, str]:
    """Recipe name -> its YAML text (shipped recipes read as shipped)."""
    from quantkit.match.recipe import load_recipe

    if smoke:
        return {"int4-experts-rtn": load_recipe("int4-experts-rtn").text}
    return {"nvfp4a4-experts-gptq": NVFP4A4_GPTQ, "nvfp4-experts": load_recipe("nvfp4-experts").text,
            "mxfp4-experts": load_recipe("mxfp4-experts").text,
            "int4-experts-gptq": load_recipe("int4-experts-gptq").text}


def streamed(tmp: Path, seed: int, smoke: bool) -> list[dict]:
    """Convert time and peak RSS where the weights are large enough to matter: bench/convert_rtn.py's synthetic
    qwen3_moe (Qwen3-30B-A3B's widths, hidden 2048: one 2048-wide block; 0.6 GB, two shards: 32 experts, so the
    embedding and lm_head are 45% of it), and one layer of all 128 of Qwen3-30B-A3B's experts (1.5 GB: 18%; the
    whole model: 2%), int4-experts-rtn with and without the rotation and the rotation alone, each the best of three
    runs, the cases taking turns (a drift in the machine's speed touches every case alike)."""
    from bench.convert_rtn import ARCH, SMOKE_ARCH, make_checkpoint

    from quantkit.match.recipe import load_recipe

    srcs = [make_checkpoint(0.01, 2, arch=SMOKE_ARCH)] if smoke else [
        make_checkpoint(0.5, 2), make_checkpoint(1.4, 2, arch={**ARCH, "num_experts": 128})]
    rtn = load_recipe("int4-experts-rtn").text
    cases = {"int4-experts-rtn": rtn, "int4-experts-rtn + rotate": ROTATE.format(seed=seed) + rtn,
             "rotate only": ROTATE.format(seed=seed)}
    rows = []
    for src in srcs:
        runs: dict[str, list] = {name: [] for name in cases}
        for _ in range(3):
            for i, (name, text) in enumerate(cases.items()):
                yaml = tmp / f"streamed-{i}.yaml"
                yaml.write_text(text)
                doc, m = run_quantkit(["convert", src, tmp / "streamed-out", "--recipe", yaml, "--overwrite"])
                runs[name].append({**doc, "peak_rss_bytes": m["peak_rss_bytes"]})
        base = None
        for name in cases:
            best = min(runs[name], key=lambda d: d["seconds"])
            row = {"tool": "quantkit", "recipe": name, "rotation": "hadamard seed %d" % seed if "rotate" in name
                   else "none", "model": f"synthetic qwen3_moe {src.name}", "convert_s": best["seconds"],
                   "peak_rss_mib": mib(max(d["peak_rss_bytes"] for d in runs[name])),
                   "source_mib": mib(best["bytes_read"])}
            if base is None:
                base = row
            else:
                row["ratio_convert_s"] = round(row["convert_s"] / base["convert_s"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench rotate", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="the rotation's seed (its random signs)")
    ap.add_argument("--outlier-channels", type=int, default=4, help="outlier channels of the second model (0: none)")
    ap.add_argument("--outlier-gain", type=int, default=16, help="their gain (a power of two)")
    ap.add_argument("--skip-massive", action="store_true",
                    help="without the fixture trained with massive residual channels (bench fixture --massive)")
    ap.add_argument("--engines", action="store_true",
                    help="instead: rotated and unrotated outputs in llama.cpp (GGUF) and vLLM's loader (rotate-engines)")
    ap.add_argument("--vllm", default=None, help="with --engines: a vLLM 0.33.0 venv's python, for vLLM's loader")
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                    help="the peer venv's python (bench/setup_peers.sh): llm-compressor's SpinQuant / QuIP rows")
    ap.add_argument("--skip-peer", action="store_true", help="no llm-compressor rows")
    add_common_args(ap, repeat=None)
    args = ap.parse_args(argv)
    run = Run("rotate", args, argv)

    from bench.fixture import MASSIVE, NORMTOPK, TINY, get_fixture, stdlib_corpus
    from quantkit.match.recipe import parse_recipe

    from dataclasses import replace

    # llama.cpp always renormalizes the top-k weights: the engines' smoke model does too
    spec = (replace(TINY, norm_topk=True) if args.engines else TINY) if args.smoke else NORMTOPK
    fx = get_fixture(spec, log=lambda m: print(m, file=sys.stderr))
    train, held = stdlib_corpus(spec.corpus_bytes)
    n_cal, n_eval, length = (8, 4, 128) if args.smoke else (64, 16, 256)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qk-bench-rotate-") as tmp:
        tmp = Path(tmp)

        def windows(data, n):  # n windows of `length` bytes, evenly spaced (a byte-level model: tokens are bytes)
            step = max(length, (len(data) - length) // n)
            return [data[i * step: i * step + length] for i in range(n)]

        def jsonl(name, data, n):
            texts = [w.decode("latin-1") for w in windows(data, n)]
            (tmp / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            return str(tmp / name)

        cal, ev = jsonl("cal.jsonl", train, n_cal), jsonl("eval.jsonl", held, n_eval)
        if args.engines:
            import importlib.util

            if importlib.util.find_spec("llama_cpp") is None:
                raise Skip("llama-cpp-python is not installed (bench/setup_llamacpp.sh)")
            ev_ids = tmp / "eval-ids.jsonl"  # llama.cpp takes the byte model's ids as ids
            ev_ids.write_text("".join(json.dumps({"input_ids": list(w)}) + "\n" for w in windows(held, n_eval)))
            rows = engines(args, fx, tmp, cal, str(ev_ids), n_cal, n_eval, length)
            run.write(rows, summary={"model": f"fixture {spec.key}", "evaluation": f"{n_eval} x {length} held-out "
                                     "bytes", "vllm": bool(args.vllm)}, tag="engines")
            return 0
        import torch

        models = {"trained": Path(fx["model_dir"])}
        if args.outlier_channels:
            models["outliers"] = outlier_model(models["trained"], tmp / "outliers", args.outlier_channels,
                                               args.outlier_gain)
        if not args.smoke and not args.skip_massive:
            massive = get_fixture(MASSIVE, log=lambda m: print(m, file=sys.stderr))
            models["massive"] = Path(massive["model_dir"])
        ids = torch.tensor(list(held[: n_eval * length]), dtype=torch.int64).view(n_eval, length)
        stats = {m: activation_stats(p, ids) for m, p in models.items()}
        if "outliers" in stats:  # the same function: float32 logits equal up to the order of the sums
            same = float((stats["outliers"][1] - stats["trained"][1]).abs().max())
            print(f"outlier model: max |logit difference| {same:.2e}", file=sys.stderr)
        stats = {m: st for m, (st, _) in stats.items()}
        ev_ids = torch.tensor([list(w) for w in windows(held, n_eval)], dtype=torch.int64)
        (tmp / "rotate.yaml").write_text(ROTATE.format(seed=args.seed))
        for model, src in models.items():  # the rotation alone, before any quantization
            out = tmp / f"{model}-rotated"
            doc, m = run_quantkit(["convert", src, out, "--recipe", tmp / "rotate.yaml"])
            row = {"model": model, "tool": "quantkit", "recipe": "rotation only",
                   "rotation": f"hadamard seed {args.seed}", **rotation_alone(src, out, ev_ids),
                   "convert_s": doc["seconds"], "peak_rss_mib": mib(m["peak_rss_bytes"])}
            print(json.dumps(row), flush=True)
            rows.append(row)
        for (model, src), (name, text) in ((m, r) for m in models.items() for r in recipes(args.smoke).items()):
            base = None
            # the RTN recipes (seconds each) also with a second seed: how much the seed alone moves the KL; the
            # FP4 ones with one Hadamard block per group
            group = 16 if "nvfp4" in name else 32 if "mxfp4" in name else None
            seeds = [(None, None), (args.seed, None)]
            seeds += [(args.seed + 1, None)] if "gptq" not in name and not args.smoke else []
            seeds += [(args.seed, group)] if group else []
            for seed, block in seeds:
                rotated = seed is not None
                rot = ROTATE.format(seed=seed) if block is None else ROTATE_BLOCK.format(seed=seed, block=block)
                recipe = parse_recipe((rot if rotated else "") + text, name)
                out = tmp / f"{model}-{name}-{'rot%d-%s' % (seed, block) if rotated else 'plain'}"
                yaml = tmp / f"{out.name}.yaml"
                yaml.write_text(recipe.text)
                # in a process of its own: its peak RSS is the convert's alone (convert --json reports it)
                doc, m = run_quantkit(["convert", src, out, "--recipe", yaml, "--dataset", cal, "--num-samples",
                                       n_cal, "--seq-len", length])
                v = verify_json(out, reference=src, dataset=ev, num_samples=n_eval, seq_len=length,
                                generation_tokens=0)
                mt = v["metrics"]
                rotation = "none" if not rotated else f"hadamard seed {seed}" + (f" block {block}" if block else "")
                row = {"model": model, "tool": "quantkit", "recipe": name, "rotation": rotation,
                       "kl": mt["kl_divergence"], "top1": mt["top1_agreement"], "ppl_ref": mt["perplexity_reference"],
                       "ppl": mt["perplexity_quantized"], "convert_s": doc["seconds"],
                       "peak_rss_mib": mib(m["peak_rss_bytes"]), "passed": v["passed"]}
                if base is None:
                    base = row
                else:
                    row["ratio_kl"] = round(row["kl"] / base["kl"], 3) if base["kl"] else None
                    row["ratio_convert_s"] = round(row["convert_s"] / base["convert_s"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
        peer = "skipped (--smoke)" if args.smoke else "skipped (--skip-peer)" if args.skip_peer else None
        if peer is None:
            ok, why = peer_available(args.peer_python)
            if ok:
                rows += peers(args.peer_python, models, tmp, [list(w) for w in windows(train, n_cal)],
                              [list(w) for w in windows(held, n_eval)])
                peer = why
            else:
                peer = f"pending: {why}"
                print(f"llm-compressor: {peer}; re-run with --peer-python PATH", file=sys.stderr)
        rows += streamed(tmp, args.seed, args.smoke)
    model = f"fixture {spec.key} ({spec.steps} steps, final loss {fx['final_loss']:.3f}, hidden {spec.hidden})"
    summary = {"model": model, "calibration": f"{n_cal} x {length} training bytes",
               "evaluation": f"{n_eval} x {length} held-out bytes",
               "outliers": f"{args.outlier_channels} channels x {args.outlier_gain}" if args.outlier_channels else None,
               "llmcompressor": peer}
    if "massive" in models:
        summary["massive_model"] = (f"fixture {MASSIVE.key} ({MASSIVE.offset_channels} channels +{MASSIVE.offset} "
                                    f"at the embedding, final loss {massive['final_loss']:.3f})")
    summary.update({f"{m}_{k}": v for m, st in stats.items() for k, v in st.items()})
    if args.outlier_channels:
        summary["outliers_max_logit_difference"] = same
    run.write(rows, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
