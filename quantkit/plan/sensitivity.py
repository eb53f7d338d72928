"""How much each unit of a model loses under each candidate scheme, measured once and cached: `plan --fit`'s loss.

For every candidate scheme, `convert` writes the model with that scheme on every unit it can take (its shipped
recipe's group, GPTQ calibrated as convert calibrates); then, in the source model (float32, transformers),
each unit alone gets that output's weights, decoded by quantkit's one tensor reader (the same decode `verify`
proves equal to compressed-tensors'), and the loss is the mean KL(source || model) per token position on the
calibration samples. Cost: one convert per scheme plus (units x schemes) forward passes of the whole model, in
memory: this measures models that transformers holds in RAM (the trained fixtures, small MoEs); for larger ones
`plan --fit` falls back to the prior (mix.prior_loss) and says so.

The table is cached under `cache_dir` by a key of the source (config.json, every shard's name, size and mtime),
the candidates' recipe groups, the calibration data and quantkit's version; the converted outputs are deleted once
measured."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import FitError
from .mix import Choice, Unit, _shipped_group, uniform_recipe

Loss = dict[tuple[int, str], dict[str, float]]
# the reference's log-probabilities are kept in memory (samples x tokens x vocab x 4 bytes): refused above this
MAX_LOGPROB_BYTES = 2 << 30


def cache_key(src: Path, cands: Sequence[Choice], calibration: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    h.update((src / "config.json").read_bytes())
    for f in sorted(src.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps([[c.name, None if c.keep else _shipped_group(c.recipe, c.group)] for c in cands],
                        sort_keys=True, default=str).encode())
    h.update(json.dumps(dict(calibration), sort_keys=True, default=str).encode())
    h.update(__version__.encode())
    return h.hexdigest()[:16]


def measure(src: Path, units: Sequence[Unit], cands: Sequence[Choice], calibration: Mapping[str, Any],
            cache_dir: Path, say: Callable[[str], None] = lambda s: None) -> tuple[Loss, dict[str, Any]]:
    """({(layer, kind): {choice: loss}}, what was measured and how): cached in `cache_dir`. `calibration`:
    {dataset, num_samples, seq_len} (dataset None: the shipped calibration set)."""
    key = cache_key(src, cands, calibration)
    table = cache_dir / f"sensitivity-{key}.json"
    if table.is_file():
        doc = json.loads(table.read_text())
        say(f"fit: sensitivity from the cache {table}")
        return _loss_of(doc["loss"]), {**doc["info"], "cached": str(table)}
    loss, info = _measure(src, units, cands, calibration, cache_dir / f"work-{key}", say)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = table.with_suffix(".tmp")
    tmp.write_text(json.dumps({"loss": [[l, k, c, v] for (l, k), d in loss.items() for c, v in d.items()],
                               "info": info}, indent=1))
    tmp.replace(table)
    return loss, {**info, "cached": str(table)}


def _loss_of(rows: list) -> Loss:
    out: Loss = {}
    for layer, kind, choice, v in rows:
        out.setdefault((int(layer), str(kind)), {})[str(choice)] = float(v)
    return out


def _measure(src: Path, units: Sequence[Unit], cands: Sequence[Choice], calibration: Mapping[str, Any],
             work: Path, say) -> tuple[Loss, dict[str, Any]]:
    import time

    import torch

    from ..convert import ConvertOptions, convert
    from ..read.checkpoint import Checkpoint
    from ..verify.numerics import token_data

    t0 = time.monotonic()
    ck = Checkpoint.open(src)
    samples, data = token_data(ck, calibration.get("dataset"), int(calibration["num_samples"]),
                               int(calibration["seq_len"]), seed=0)
    vocab = int((ck.config.get("text_config") or ck.config).get("vocab_size") or 0)
    if sum(len(s) for s in samples) * vocab * 4 > MAX_LOGPROB_BYTES:
        raise FitError(f"measuring sensitivity would hold {sum(len(s) for s in samples) * vocab * 4 / 2**30:.1f} GiB "
                       "of reference log-probabilities", hint="pass fewer --num-samples or a shorter --seq-len")
    say(f"fit: loading the source model (float32) and its logits on {len(samples)} samples")
    from .. import hf

    model = hf.load_model(src, torch.float32).eval()
    ids = torch.nn.utils.rnn.pad_sequence([s.long() for s in samples], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.bool) for s in samples], batch_first=True)
    with torch.no_grad():
        ref = _logprobs(model, ids)
    orig = {n: p.detach().clone() for n, p in model.named_parameters() if "layers." in n}
    loss: Loss = {(u.layer, u.kind): {} for u in units}
    for c in cands:
        if c.keep:
            for u in units:
                loss[(u.layer, u.kind)][c.name] = 0.0
    todo = [c for c in cands if not c.keep]
    for i, c in enumerate(todo, 1):
        rec = uniform_recipe(c, units, calibration={k: v for k, v in calibration.items() if v is not None})
        if rec is None:
            continue
        out = work / c.name
        say(f"fit: [{i}/{len(todo)}] convert with {c.name} on every unit it takes")
        convert(src, out, ConvertOptions(recipe=rec, dataset=calibration.get("dataset"),
                                         num_samples=int(calibration["num_samples"]),
                                         seq_len=int(calibration["seq_len"]), model_card=False, overwrite=True,
                                         resume=False))
        for u, v in _unit_losses(model, orig, out, [u for u in units if u.kind in c.kinds], ids, mask, ref):
            loss[(u.layer, u.kind)][c.name] = v
            say(f"fit:   {u.name:<18} {c.name:<15} KL {v:.3e}")
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    info = {"method": "KL(source || source with one unit quantized), mean per token position",
            "data": {k: v for k, v in data.items() if k != "notes"}, "tokens": int(mask.sum()),
            "seconds": round(time.monotonic() - t0, 1), "choices": [c.name for c in cands]}
    return loss, info


def _logprobs(model, ids):
    import torch

    out = model(ids).logits.float()
    return torch.log_softmax(out, -1)


def _unit_losses(model, orig: Mapping, qdir: Path, units: Sequence[Unit], ids, mask, ref):
    """(unit, KL) for each unit of `units` with the weights of `qdir` in the source model, one unit at a time."""
    import torch

    from ..read.checkpoint import Checkpoint
    from ..read.sources import detect_format, scan
    from ..read.tensors import TensorReader
    from ..verify.numerics import assign_weight

    ck = Checkpoint.open(qdir)
    stored = scan(ck, detect_format(ck.config))
    params = dict(model.named_parameters())
    with TensorReader.of(ck) as r, torch.no_grad():
        for u in units:
            missing = [m for m in u.modules if m not in stored]
            if missing:
                raise FitError(f"{u.name}: {missing[0]} was not quantized by the uniform recipe",
                               hint="a candidate scheme that does not apply to a module is dropped, not measured")
            for m in u.modules:
                assign_weight(params, m, r.decode(stored[m], torch.float32))
            lq = _logprobs(model, ids)
            kl = (ref.exp() * (ref - lq)).sum(-1)  # [B, L]
            yield u, float(kl[mask].double().mean())
            mark = f"layers.{u.layer}."
            for n, p in params.items():  # the unit's layer back to the source's weights
                if mark in n and (n.startswith(mark) or f".{mark}" in n):
                    p.data.copy_(orig[n])
