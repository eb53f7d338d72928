"""Stage 3 of `verify`, numerics (needs the reference, the source checkpoint): per-module weight SQNR
aggregated per decoder layer and compared with what the manifest recorded at conversion; then both models
run with transformers on token data: mean next-token KL(ref || quant), top-1 agreement, perplexity of
each, greedy-generation agreement; with `kernels="triton"` the runtime's INT4 GEMM on a few modules."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import re
import types
import warnings
from pathlib import Path

import torch

from ..arch import hf_module_name, layer_index, wrapper_prefixes
from ..arch.layout import (FUSED_GATE_UP, disk_experts, expert_parts, experts_key, hf_expert_param,
                           is_routed_expert, naming_of)
from ..errors import ConfigError, DatasetError, QuantkitError, ReferenceModelError
from ..read.checkpoint import Checkpoint
from .common import Check, finite
from ..options import Thresholds
from ..pack.names import Tensor

KERNEL_RTOL = 2e-2  # |triton - torch| <= rtol * max|torch|: bf16 outputs, fp32 accumulation either way
# Built-in text for token data when the reference has a tokenizer but no dataset is given (varied prose,
# code and numbers so that the distributions are not all trivially repetitive).
_BUILTIN_TEXT = (
    "The committee met on a grey Tuesday morning to review the harbour plans. Three proposals were on the "
    "table: widen the northern channel, rebuild the old breakwater, or do nothing until the survey was done. "
    "def moving_average(xs, n):\n    out = []\n    for i in range(len(xs) - n + 1):\n"
    "        out.append(sum(xs[i:i + n]) / n)\n    return out\n"
    "In 1869 the canal opened, cutting the voyage from London to Bombay by roughly 7,000 kilometres. "
    "Photosynthesis converts light energy into chemical energy stored in glucose; oxygen is released as a "
    "by-product. She asked whether the train to Lyon left at 14:05 or 14:35, and the clerk checked twice. "
    "Q: What is 17 times 23? A: 391. Q: Name a prime between 90 and 100. A: 97. "
    "Le marché ouvre à huit heures; les pêcheurs arrivent plus tôt avec la marée. "
    "A good error message says what went wrong, where, and what to do next. "
)


def check_reference(ref_ck: Checkpoint, manifest: dict | None) -> Check:
    """Is `reference` the source the manifest records? Names, sizes and the config hash (shard contents
    are not hashed: that would read the whole source)."""
    src = (manifest or {}).get("source")
    if not isinstance(src, dict) or not isinstance(src.get("shards"), list):
        return Check("reference", None, "the manifest records no source: the reference cannot be matched to it")
    want = {s.get("name"): s.get("size") for s in src["shards"] if isinstance(s, dict)}
    have = {s.name: s.size for s in ref_ck.shards}
    diffs = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            diffs.append(f"{name} missing")
        elif name not in want:
            diffs.append(f"{name} not in the manifest's source")
        elif want[name] != have[name]:
            diffs.append(f"{name} is {have[name]} B, the source was {want[name]} B")
    cfg = hashlib.sha256((ref_ck.root / "config.json").read_bytes()).hexdigest()
    if src.get("config_sha256") and cfg != src["config_sha256"]:
        diffs.append("config.json differs from the source's")
    if diffs:
        return Check("reference", False, "the reference is not the source this checkpoint was converted from: "
                     + "; ".join(diffs[:5]) + (f" (+{len(diffs) - 5} more)" if len(diffs) > 5 else ""))
    return Check("reference", True, f"shard names, sizes and config.json match the manifest's source "
                 f"({len(have)} shards; contents not hashed)")


WRONG_REFERENCE_DB = 6.0  # a module "disagrees" when its SQNR is this far below the one recorded at conversion


def check_reference_content(sqnr: dict[str, float], drift: list[tuple[str, float, float]]) -> Check | None:
    """Same shard names, sizes and config.json as the manifest's source, yet other weights (the same model
    trained or initialised with another seed)? Against the true source every module's SQNR is the one
    recorded at conversion (the same math on the same values); against another model most modules' SQNR
    falls far below it (unrelated weights of the same scale: about -3 dB), and a module with no record lies
    farther from the reference than zero does (SQNR < 0 dB), which no quantization gives. When more than half
    of the measured modules disagree, the reference is named as not the source (a failing `reference` check),
    and the numerics are not blamed on the quantization. None otherwise."""
    if not sqnr:
        return None
    recorded = {m: rec for m, _, rec in drift}
    off = sorted((m for m, db in sqnr.items()
                  if (db < recorded[m] - WRONG_REFERENCE_DB if m in recorded else db < 0.0)),
                 key=lambda m: sqnr[m])
    if 2 * len(off) <= len(sqnr):
        return None
    m = off[0]
    was = f", {recorded[m]:.1f} dB recorded at conversion" if m in recorded else ""
    return Check("reference", False, f"the reference is not the source this checkpoint was converted from: its "
                 f"weights differ ({len(off)} of {len(sqnr)} modules' SQNR against it disagree with the conversion, "
                 f"e.g. {m}: {sqnr[m]:.1f} dB{was}), though its shard names, sizes and config.json match; another "
                 "model of the same shape? Numerics skipped: pass the checkpoint the conversion started from")


def layer_summary(sqnr: dict[str, float], min_db: float) -> list[dict]:
    by_layer: dict[int | None, list[tuple[float, str]]] = {}
    for m, db in sqnr.items():
        by_layer.setdefault(layer_index(m), []).append((db, m))
    out = []
    for layer in sorted(by_layer, key=lambda x: (x is None, x or 0)):
        vals = by_layer[layer]
        worst = min(vals)
        mean = sum(v for v, _ in vals) / len(vals)
        out.append({"layer": layer, "min_sqnr_db": round(worst[0], 3), "mean_sqnr_db": round(mean, 3),
                    "modules": len(vals),
                    "worst_module": worst[1], "ok": bool(worst[0] >= min_db)})
    return out


def sqnr_check(sqnr: dict, layers: list[dict], modules: int, t: Thresholds, awq: int = 0) -> Check:
    if not modules:
        if awq:
            return Check("weight_sqnr", None, f"{awq} AWQ module(s) store scaled weights: compared with the "
                                              "reference at the model level (KL, top-1) only")
        return Check("weight_sqnr", None, "the checkpoint holds no pack-quantized module")
    if not sqnr:
        return Check("weight_sqnr", False, "no quantized module could be compared with the reference")
    bad = [lay for lay in layers if not lay["ok"]]
    worst = min(layers, key=lambda lay: lay["min_sqnr_db"])
    if bad:
        named = ", ".join(f"layer {lay['layer']} ({lay['worst_module']}: {lay['min_sqnr_db']:.1f} dB)"
                          for lay in bad[:5])
        return Check("weight_sqnr", False, f"{len(bad)} layer(s) below {t.min_sqnr_db} dB: {named}",
                     worst["min_sqnr_db"], t.min_sqnr_db)
    return Check("weight_sqnr", True, f"{len(sqnr)} modules, worst {worst['min_sqnr_db']:.2f} dB "
                 f"({worst['worst_module']})", worst["min_sqnr_db"], t.min_sqnr_db)


def drift_check(drift: list[tuple[str, float, float]], t: Thresholds) -> Check:
    if not drift:
        return Check("sqnr_vs_manifest", None, "the manifest records no per-module SQNR")
    off = sorted(((abs(now - rec), m, now, rec) for m, now, rec in drift), reverse=True)
    worst = off[0]
    bad = [o for o in off if not o[0] <= t.max_sqnr_drift_db]
    if bad:
        named = ", ".join(f"{m} ({now:.2f} dB now, {rec:.2f} recorded)" for _, m, now, rec in bad[:3])
        return Check("sqnr_vs_manifest", False, f"{len(bad)} module(s) differ from the SQNR recorded at conversion: "
                     f"{named}", round(worst[0], 4), t.max_sqnr_drift_db)
    return Check("sqnr_vs_manifest", True, f"{len(drift)} modules match the recorded SQNR "
                 f"(max drift {worst[0]:.4f} dB)", round(worst[0], 4), t.max_sqnr_drift_db)


def token_data(ref_ck: Checkpoint, dataset, num_samples: int, seq_len: int, seed: int):
    """(samples: list of int64 [T] tensors, description of the data).

    With `dataset`: quantkit.calib.data reads it (its formats, its tokenizer rules). Without: the shipped
    calibration set through the reference's tokenizer (built-in text if that set is unavailable), or
    seeded random ids when the reference has no tokenizer (the tiny test models)."""
    vocab = _vocab_size(ref_ck.config)
    calib = importlib.import_module("quantkit.calib.data") if importlib.util.find_spec("quantkit.calib.data") else None
    if calib is not None and not hasattr(calib, "load_calibration_data"):
        calib = None
    if dataset is not None:
        if calib is None:
            raise DatasetError("a dataset needs quantkit.calib.data, which this installation lacks",
                               hint="omit --dataset to use the built-in token data")
        return _calib_samples(calib, dataset, calib.load_tokenizer(ref_ck.root), vocab, num_samples, seq_len, seed)
    tok, notes = None, []
    if calib is not None:
        try:
            tok = calib.load_tokenizer(ref_ck.root)
        except QuantkitError as e:  # e.g. a remote-code tokenizer: random ids still compare the two models
            notes.append(f"the reference's tokenizer could not be loaded ({e.message}); using random token ids")
    if tok is not None:
        try:
            return _calib_samples(calib, None, tok, vocab, num_samples, seq_len, seed)
        except QuantkitError as e:  # the shipped set is missing or too small: fall back to built-in text
            notes.append(f"the shipped calibration set is unusable ({e.message}); using built-in text")
        ids = [i for i in tok(_BUILTIN_TEXT, add_special_tokens=False)["input_ids"] if 0 <= i < vocab] or [0, 1]
        step = 37  # each sample starts at a different offset of the tiled text
        need = seq_len + (num_samples - 1) * step
        stream = torch.tensor((ids * (need // len(ids) + 1))[:need], dtype=torch.long)
        samples = [stream[i * step: i * step + seq_len].clone() for i in range(num_samples)]
        return samples, {"source": "quantkit built-in text", "tokenizer": type(tok).__name__,
                         "num_samples": num_samples, "seq_len": seq_len, "seed": seed, "notes": notes}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_samples, seq_len), generator=g)  # [N, L]
    notes = notes or ["the reference has no tokenizer: seeded random token ids (fine for random-weight test "
                      "models, weak evidence for a real one: pass a dataset)"]
    return list(ids), {"source": f"random token ids (seed {seed})", "tokenizer": None, "num_samples": num_samples,
                       "seq_len": seq_len, "seed": seed, "notes": notes}


def _calib_samples(calib, dataset, tok, vocab: int, num_samples: int, seq_len: int, seed: int):
    with warnings.catch_warnings(record=True) as caught:  # its CalibrationWarnings become report notes
        warnings.simplefilter("always")
        cd = calib.load_calibration_data(dataset, tokenizer=tok, vocab_size=vocab, num_samples=num_samples,
                                         seq_len=seq_len, seed=seed)
    samples = [s.long().reshape(-1) for s in cd.samples if s.numel() >= 2]
    if not samples:
        raise DatasetError(f"dataset {str(dataset)!r} gives no sample of 2 or more tokens")
    info = cd.describe() if hasattr(cd, "describe") else {"source": str(dataset)}
    notes = list(info.get("notes") or [])
    info["notes"] = notes + [str(w.message) for w in caught if str(w.message) not in notes]
    return samples, info


def _vocab_size(config: dict) -> int:
    v = config.get("vocab_size")
    if not isinstance(v, int):
        v = (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(v, int) or v <= 0:
        raise ConfigError("the reference's config.json has no vocab_size", hint="pass a dataset with input_ids")
    return v


def load_model(path: Path, dev: torch.device, dtype: torch.dtype = torch.bfloat16):
    from .. import hf

    return hf.load_model(path, dtype).eval().to(dev)


def transformers_cannot_load(q_dir: Path) -> bool:
    """transformers 5.24 decompresses routed experts stored per expert through a path that knows
    `weight_packed` + `weight_scale` (+ `weight_shape`) of one scheme only: NVFP4 experts lose their global
    scale there, asymmetric INT4 experts (`weight_zero_point`) and experts whose projections use different
    schemes (a group-size fallback on down_proj) stop its converter; and a KV-scales-only config (no weight
    groups) stops its MoE expert converter.
    Such checkpoints are measured as the reference model with quantkit's dequantized weights (which the
    format stage has proven equal, bit for bit, to compressed-tensors' own decompression)."""
    from ..read.sources import detect_format, scan

    ck = Checkpoint.open(q_dir)
    qc = ck.quantization_config or {}
    if qc and not qc.get("config_groups"):
        return True  # KV scales only: transformers' MoE expert converter indexes config_groups[0]
    unread = (Tensor.GLOBAL_SCALE.dotted, Tensor.ZERO_POINT.dotted)
    if any(n.endswith(unread) and is_routed_expert(n) for n in ck.location):
        return True
    if not qc:
        return False
    schemes = {json.dumps(sw.weights, sort_keys=True, default=str)
               for m, sw in scan(ck, detect_format(ck.config)).items() if is_routed_expert(m)}
    return len(schemes) > 1


def load_dequantized(ref_dir: Path, q_dir: Path, dev: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The reference model (in `dtype`) with every quantized module of `q_dir` (INT4, NVFP4, MXFP4 and FP8
    alike, read.sources.scan) replaced by its dequantization."""
    from ..read.sources import detect_format, scan
    from ..read.tensors import TensorReader

    model = load_model(ref_dir, dev, dtype)
    ck = Checkpoint.open(q_dir)
    params = dict(model.named_parameters())
    with TensorReader.of(ck) as r:
        stored = scan(ck, detect_format(ck.config))
        if _rotated(q_dir):  # every other tensor turned too (read/rotate.py): the output's own, not the reference's
            companions = {t for sw in stored.values() for _, t in sw.tensors}
            for n in sorted(set(ck.location) - companions):
                t = r.get(n)
                if t.dtype.is_floating_point and t.dtype.itemsize > 1 and n.endswith(".weight"):
                    try:
                        assign_weight(params, n[: -len(".weight")], t.float())
                    except ReferenceModelError:  # a tensor the model has no parameter for (a vision stand-in)
                        pass
                elif t.dtype.is_floating_point and hf_module_name(n) in params:  # biases, correction biases
                    params[hf_module_name(n)].data.copy_(t)
        for m, sw in stored.items():
            assign_weight(params, m, r.decode(sw, torch.float32))
    return model


def _rotated(q_dir: Path) -> bool:
    """The output's manifest records a rotation of the residual stream (its unquantized tensors differ from the
    reference's)."""
    from ..read.checkpoint import read_manifest

    try:
        return isinstance(read_manifest(q_dir, ReferenceModelError).get("rotation"), dict)
    except QuantkitError:
        return False


def assign_weight(params: dict, module: str, w: torch.Tensor) -> None:
    """Write weight `w` [N, K] of on-disk `module` into the model: a Linear's weight, or expert e's rows of
    the fused experts (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]; Mixtral's w1/w3/w2)."""
    if not any(n.startswith(wrapper_prefixes()) for n in params):  # a wrapper's text model, as transformers names it
        module = hf_module_name(module)
    if f"{module}.weight" in params:
        params[f"{module}.weight"].data.copy_(w)
        return
    where = hf_expert_param(module)
    if where is None:
        raise ReferenceModelError(f"{module}: no parameter of the reference model takes it")
    fused, e, half_of = where
    if fused not in params:
        raise ReferenceModelError(f"{module}: the reference model has no {fused}")
    p = params[fused].data
    if half_of is None:  # down_proj
        p[e].copy_(w)
    else:  # gate rows first
        half = p.shape[1] // 2
        p[e, slice(0, half) if half_of == "gate" else slice(half, None)].copy_(w)


def w4afp8_layers(q_dir: Path) -> bool:
    """Whether some config group of `q_dir` is W4AFP8 (INT4 weights, dynamic per-token FP8 activations)."""
    from ..pack.config import config_groups, is_w4afp8

    return any(is_w4afp8(g.weights, g.input_activations)
               for g in config_groups(Checkpoint.open(q_dir).quantization_config, lenient=True))


def install_w4afp8(model, q_dir: Path) -> int:
    """Make every routed-expert block of a transformers MoE `model` (experts fused as gate_up_proj [E, 2I, H] /
    down_proj [E, H, I], forward(hidden, top_k_index, top_k_weights)) compute as vLLM's W4A8 MoE kernel does
    (runtime/w4afp8.py `w4afp8_moe_ref`) from the packed experts of `q_dir`. Returns the blocks replaced."""
    from ..runtime.int4 import PackedInt4
    from ..runtime.w4afp8 import W4AFP8Weight, w4afp8_moe_ref
    from ..read.tensors import TensorReader

    ck = Checkpoint.open(q_dir)
    done = 0
    with TensorReader.of(ck) as r:
        for name, mod in model.named_modules():
            if experts_key(name) is None or not isinstance(getattr(mod, FUSED_GATE_UP, None), torch.nn.Parameter):
                continue
            n_exp = mod.gate_up_proj.shape[0]
            found = disk_experts(name, lambda m: Tensor.PACKED.of(m) in ck.location)
            if found is None:
                continue
            base, names = found
            g, u, d = names.gate, names.up, names.down

            def stack(parts):
                pk = [PackedInt4.from_tensors(r.get(Tensor.PACKED.of(f"{base}.{e}.{p}")), r.get(Tensor.SCALE.of(f"{base}.{e}.{p}")),
                                              r.get(Tensor.SHAPE.of(f"{base}.{e}.{p}")), group_size=128) for e in range(n_exp)
                      for p in parts]
                per = len(parts)
                packed = torch.stack([torch.cat([x.packed for x in pk[e * per:(e + 1) * per]]) for e in range(n_exp)])
                scale = torch.stack([torch.cat([x.scale for x in pk[e * per:(e + 1) * per]]) for e in range(n_exp)])
                n = sum(x.shape[0] for x in pk[:per])
                return W4AFP8Weight.from_int4(PackedInt4(packed, scale, None, (n, pk[0].shape[1]), 128))

            gu, dn = stack((g, u)), stack((d,))
            mod.forward = (lambda hs, idx, wts, _gu=gu, _dn=dn:
                           w4afp8_moe_ref(hs, idx, wts, _gu, _dn, out_dtype=hs.dtype))
            done += 1
    return done


def w4a4_layers(q_dir: Path) -> bool:
    """Whether some config group of `q_dir` is NVFP4 W4A4 (NVFP4 weights and activations, a static
    input_global_scale per module)."""
    from ..pack.config import config_groups, is_nvfp4_w4a4

    return any(is_nvfp4_w4a4(g.weights, g.input_activations)
               for g in config_groups(Checkpoint.open(q_dir).quantization_config, lenient=True))


def install_w4a4(model, q_dir: Path, scales: str = "layer") -> int:
    """Make the NVFP4 W4A4 parts of a transformers `model` (the reference with quantkit's dequantized weights)
    compute as engines run them: every routed-expert block whose experts carry `input_global_scale` through
    runtime/w4a4.py `w4a4_moe_ref` (activations quantized per expert, `scales` "layer" as vLLM's FlashInfer
    backends or "expert" as its CUTLASS one), and every dense W4A4 Linear with its input fake-quantized under
    its scale. Returns the blocks and Linears changed."""
    from ..quant.fp4_act import fake_quantize_act_nvfp4
    from ..read.tensors import TensorReader
    from ..runtime.fp4 import FP4Experts, PackedFP4, fuse_gate_up_fp4
    from ..runtime.w4a4 import w4a4_moe_ref

    ck = Checkpoint.open(q_dir)
    bases = {}  # "layers.L" -> the on-disk experts prefix whose expert 0 is W4A4
    for n in ck.location:
        parts = expert_parts(n[: -len(Tensor.INPUT_GLOBAL_SCALE.dotted)]) \
            if n.endswith(Tensor.INPUT_GLOBAL_SCALE.dotted) else None
        names = naming_of(parts[2]) if parts and parts[1] == 0 else None
        if names is not None and parts[2] == names.gate:
            key = experts_key(parts[0])
            if key:
                bases[key] = (parts[0], names)
    dense = {}  # layers.L.<rest> -> the input_global_scale of a dense W4A4 Linear
    for n in ck.location:
        if n.endswith(Tensor.INPUT_GLOBAL_SCALE.dotted) and not is_routed_expert(n):
            tail = _layer_tail(n[: -len(Tensor.INPUT_GLOBAL_SCALE.dotted)])
            if tail is not None:
                dense[tail] = n
    done = 0
    with TensorReader.of(ck) as r:
        def packed(mod: str) -> PackedFP4:
            return PackedFP4.from_tensors(r.get(Tensor.PACKED.of(mod)), r.get(Tensor.SCALE.of(mod)),
                                          r.get(Tensor.GLOBAL_SCALE.of(mod)), kind="nvfp4")

        def stack(parts: list[PackedFP4]) -> PackedFP4:
            gs = torch.stack([p.global_scale.reshape(1) for p in parts])  # [E, 1]
            return PackedFP4(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]), gs,
                             parts[0].shape, "nvfp4")

        for name, mod in model.named_modules():
            key = experts_key(name)
            if key in bases and isinstance(getattr(mod, FUSED_GATE_UP, None), torch.nn.Parameter):
                base, names = bases[key]
                g, u, d = names.gate, names.up, names.down
                n_exp = mod.gate_up_proj.shape[0]
                gate = stack([packed(f"{base}.{e}.{g}") for e in range(n_exp)])
                up = stack([packed(f"{base}.{e}.{u}") for e in range(n_exp)])
                experts = FP4Experts(fuse_gate_up_fp4(gate, up), stack([packed(f"{base}.{e}.{d}") for e in range(n_exp)]))
                gs13 = torch.stack([torch.cat([r.get(Tensor.INPUT_GLOBAL_SCALE.of(f"{base}.{e}.{p}")).reshape(1) for p in (g, u)])
                                    for e in range(n_exp)])  # [E, 2]
                gs2 = torch.cat([r.get(Tensor.INPUT_GLOBAL_SCALE.of(f"{base}.{e}.{d}")).reshape(1) for e in range(n_exp)])
                dev = mod.gate_up_proj.device
                # a bound method, as module.forward is: compressed-tensors' decompress hook (a compressed reference,
                # e.g. Kimi K2.5's INT4 release) re-wraps forwards through `forward.__func__` on the first call
                mod.forward = types.MethodType(
                    lambda _self, hs, idx, wts, _x=experts.to(dev), _a=gs13.to(dev), _b=gs2.to(dev):
                    w4a4_moe_ref(hs, idx, wts, _x, _a, _b, scales=scales, out_dtype=hs.dtype), mod)
                done += 1
            elif isinstance(mod, torch.nn.Linear):
                tail = _layer_tail(name)
                hit = dense.get(tail) if tail is not None else None
                if hit is not None:
                    gs = r.get(hit).float().reshape(1).to(mod.weight.device)
                    mod.register_forward_pre_hook(
                        lambda _m, args, _g=gs: (fake_quantize_act_nvfp4(args[0], _g),) + tuple(args[1:]))
                    done += 1
    return done


def _layer_tail(name: str) -> str | None:
    """`layers.L.<rest>` of a module name: what an on-disk name and transformers' name of one Linear share (a
    wrapper's prefix aside); None outside the decoder layers."""
    m = re.search(r"(?:^|\.)(layers\.\d+\..*)$", name)
    return m[1] if m else None


def model_metrics(ref_dir: Path, q_dir: Path, samples: list[torch.Tensor], dev: torch.device, gen_tokens: int,
                   t: Thresholds, say) -> tuple[dict, dict | None, list[Check]]:
    """Both models in bf16 (transformers keeps the decompressed experts in the scale dtype) on `samples`."""
    import torch.nn.functional as F

    names = ("kl_divergence", "top1_agreement", "perplexity_ratio", "generation_agreement")
    say("numerics: loading the reference model")
    try:
        ref = load_model(ref_dir, dev)
    except Exception as e:  # transformers' errors are many and unnamed
        raise ReferenceModelError(f"transformers cannot load the reference {str(ref_dir)!r}: {type(e).__name__}: "
                                  f"{str(e)[:160]}", hint="pass a checkpoint transformers can load") from None
    say("numerics: loading the quantized model (compressed-tensors decompresses it)")
    q16 = None  # W4AFP8 and NVFP4 W4A4 checkpoints: the same weights run W4A16, measured beside
    served = "W4AFP8"
    try:
        if w4a4_layers(q_dir):
            served = "NVFP4 W4A4"
            say("numerics: NVFP4 W4A4: the reference model with quantkit's dequantized weights, inputs of the W4A4 "
                "modules quantized to NVFP4 as engines do (FP8 scale per 16 values under the input_global_scale; "
                "experts: one scale per layer, as vLLM's FlashInfer backends); W4A16 beside it")
            qnt = load_dequantized(ref_dir, q_dir, dev)
            if not install_w4a4(qnt, q_dir):
                raise ReferenceModelError("no module of the model takes the NVFP4 W4A4 input scales")
            q16 = load_dequantized(ref_dir, q_dir, dev)
        elif w4afp8_layers(q_dir):
            say("numerics: W4AFP8 experts: the reference model with quantkit's dequantized weights, experts run as "
                "vLLM's W4A8 MoE kernel computes (FP8 group scales, FP8 per-token activations); W4A16 beside it")
            qnt = load_dequantized(ref_dir, q_dir, dev)
            if not install_w4afp8(qnt, q_dir):
                raise ReferenceModelError("no routed-expert block of the model takes the W4AFP8 experts")
            q16 = load_dequantized(ref_dir, q_dir, dev)
        elif transformers_cannot_load(q_dir):
            say("numerics: transformers cannot load this checkpoint as written (NVFP4 or asymmetric routed experts, "
                "experts in more than one scheme, or a config with KV scales only): the reference model with "
                "quantkit's dequantized weights")
            qnt = load_dequantized(ref_dir, q_dir, dev)
        else:
            qnt = load_model(q_dir, dev)
    except Exception as e:  # an unloadable output is a finding, not a crash
        del ref
        why = f"transformers cannot load the quantized checkpoint: {type(e).__name__}: {str(e)[:160]}"
        return {}, None, [Check(n, False, why) for n in names]

    vocab = None
    kl_sum = top1_sum = nll_ref = nll_q = kl16_sum = top1_16_sum = 0.0
    positions = targets = 0
    say(f"numerics: logits on {len(samples)} samples")
    with torch.no_grad():
        for batch in _batches(samples, ref.config):
            ids = batch.to(dev)  # [B, L]
            la = F.log_softmax(ref(ids).logits.float(), -1)  # [B, L, V]
            lb = F.log_softmax(qnt(ids).logits.float(), -1)
            vocab = la.shape[-1]
            kl_sum += float((la.exp() * (la - lb)).sum(-1).double().sum())  # KL(ref || quant) per position
            top1_sum += float((la.argmax(-1) == lb.argmax(-1)).double().sum())
            if q16 is not None:
                l16 = F.log_softmax(q16(ids).logits.float(), -1)
                kl16_sum += float((la.exp() * (la - l16)).sum(-1).double().sum())
                top1_16_sum += float((la.argmax(-1) == l16.argmax(-1)).double().sum())
            positions += la.shape[0] * la.shape[1]
            nxt = ids[:, 1:, None]
            nll_ref -= float(la[:, :-1].gather(-1, nxt).double().sum())
            nll_q -= float(lb[:, :-1].gather(-1, nxt).double().sum())
            targets += nxt.numel()
        kl = kl_sum / positions
        top1 = top1_sum / positions
        ppl_r = math.exp(nll_ref / targets) if nll_ref / targets < 700 else float("inf")
        ppl_q = math.exp(nll_q / targets) if nll_q / targets < 700 else float("inf")
        generation = None
        if gen_tokens > 0:
            say(f"numerics: greedy generation ({gen_tokens} tokens)")
            generation = _generation(ref, qnt, samples, gen_tokens, dev)
    metrics = {"kl_divergence": finite(kl), "top1_agreement": finite(top1),
               "perplexity_reference": finite(ppl_r), "perplexity_quantized": finite(ppl_q)}
    kl_what = top1_what = ""
    if q16 is not None:
        metrics.update(kl_divergence_w4a16=finite(kl16_sum / positions), top1_agreement_w4a16=finite(top1_16_sum / positions))
        kl_what = f", {served} as served (W4A16, same weights: {kl16_sum / positions:.4g})"
        top1_what = f", {served} as served (W4A16, same weights: {top1_16_sum / positions:.4f})"
    checks = [
        limit_check("kl_divergence", kl, t.max_kl, upper=True, what=f"mean next-token KL over {positions} positions{kl_what}"),
        limit_check("top1_agreement", top1, t.min_top1, upper=False,
               what=f"top-1 agreement over {positions} positions{top1_what}"),
        limit_check("perplexity_ratio", ppl_q / ppl_r if math.isfinite(ppl_r) and ppl_r > 0 else float("nan"),
               t.max_ppl_ratio, upper=True, what=f"perplexity {ppl_q:.4g} vs reference {ppl_r:.4g} (vocab {vocab})"),
    ]
    if generation is None:
        checks.append(Check("generation_agreement", None, "generation_tokens is 0: skipped"))
    else:
        checks.append(limit_check("generation_agreement", generation["agreement"], t.min_generation_agreement,
                             upper=False, what=f"{generation['prompts']} prompts x {gen_tokens} greedy tokens, "
                                               f"mean matching prefix {generation['matching_prefix']:.2f}"))
    return metrics, generation, checks


def limit_check(name: str, value: float, limit: float, *, upper: bool, what: str) -> Check:
    if not math.isfinite(value):
        return Check(name, False, f"{what}: not finite", None, limit)
    ok = value <= limit if upper else value >= limit
    return Check(name, ok, f"{what}: {value:.4g} ({'<=' if upper else '>='} {limit} {'ok' if ok else 'FAILED'})",
                 float(value), limit)


def _batches(samples: list[torch.Tensor], config, max_logit_bytes: int = 256 << 20):
    """Equal-length samples stacked into [B, L] batches whose float32 logits stay under max_logit_bytes."""
    vocab = getattr(config, "vocab_size", None) or 1
    by_len: dict[int, list[torch.Tensor]] = {}
    for s in samples:
        by_len.setdefault(int(s.numel()), []).append(s)
    for length, group in by_len.items():
        per = max(1, max_logit_bytes // (length * vocab * 4 * 3))  # log-probs of both models + a temporary
        for i in range(0, len(group), per):
            yield torch.stack(group[i:i + per])


def _generation(ref, qnt, samples: list[torch.Tensor], n: int, dev: torch.device) -> dict:
    """Greedy-generate n tokens with the reference from up to 4 prompts, then score the quantized model
    teacher-forced on that continuation: `agreement` = fraction of steps where its greedy token equals the
    reference's (immune to the divergence cascade of free-running generation); `matching_prefix` =
    mean fraction of tokens until the first disagreement, i.e. what free-running generation would share."""
    from transformers import GenerationConfig

    prompts = [s[: max(1, min(32, s.numel() // 2))] for s in samples[:4]]
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    agree = prefix = 0.0
    for p in prompts:
        ids = p.reshape(1, -1).to(dev)
        full = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)  # [1, P + n]
        cont = full[0, ids.shape[1]:]
        pred = qnt(full[:, :-1]).logits[0, ids.shape[1] - 1:].argmax(-1)  # quantized greedy choice per step
        same = (pred == cont).double()
        agree += float(same.mean())
        prefix += float(same.cumprod(0).sum()) / n
    return {"tokens": n, "prompts": len(prompts), "agreement": agree / len(prompts),
            "matching_prefix": prefix / len(prompts)}


def kernel_check(modules: list[tuple[str, dict]], dev: torch.device) -> Check:
    """The runtime's Triton INT4 GEMM against its torch reference on a few real modules."""
    from ..runtime.int4 import PackedInt4, int4_gemm, int4_gemm_ref

    worst, worst_m = 0.0, None
    for m, t in modules:
        w = PackedInt4.from_tensors(t[Tensor.PACKED], t[Tensor.SCALE], t[Tensor.SHAPE],
                                    t.get(Tensor.ZERO_POINT)).to(dev)
        x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
        want = int4_gemm_ref(x, w).float()
        got = int4_gemm(x, w, backend="triton").float()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if not err <= worst:
            worst, worst_m = err, m
    ok = worst <= KERNEL_RTOL
    return Check("kernels", ok, f"triton INT4 GEMM vs torch on {len(modules)} modules: max relative error "
                 f"{worst:.2e}{f' ({worst_m})' if worst_m else ''}", worst, KERNEL_RTOL)
