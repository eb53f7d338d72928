"""`quantkit verify DECODE --pair PREFILL`: a prefill/decode checkpoint pair (convert/pair.py) checked as it is
served: prefill by one model into the FP8 KV cache, decode by the other reading those pages.

1. Belonging together (files, headers and manifests; any failure raises PairMismatch, exit 1, one line naming the
   file, tensor or field): both manifests complete and well-typed, each read as hostile input
   (read.checkpoint.read_json_file); every shard, config.json and other file of BOTH halves matches the size and
   sha256 its own manifest recorded at write, neither directory holds a file its manifest does not record, and
   each manifest's tensor table matches its headers (verify/integrity.py, check_checkpoint, the check `verify`
   runs on QMODEL); the same source (config.json sha256, shard names, sizes and sha256); the same KV layout
   (`kv_cache_scheme`) and the same KV-scale tensors bit for bit (names, dtypes, shapes, bytes); each records
   the other (role, the sha256 of the partner's manifest, pack.manifest.manifest_digest, and the partner's
   directory, relative, which must be the one given).
2. Quality (needs the reference, the source): quantkit's runner (runtime/) loads the source (BF16 weights,
   BF16 KV cache), the prefill model and the decode model (FP8 KV cache with the shipped scales). Each sample
   of L tokens is cut at P = L // 2: the prompt ids[:P] is prefilled, then the continuation is fed one token
   at a time (teacher forcing) through decode steps reading the paged cache. The logits at positions
   P-1 .. L-2 (the prefill's last one, then each decode step's) are compared with the source's over the same
   positions: mean KL(source || model) and top-1 agreement, for
       pair     prefill model writes the cache (and gives the first token's logits), decode model reads it
       decode   the decode model alone (its own prefill)
       prefill  the prefill model alone
   plus the pair against the decode model alone (what moving prefill to FP8 costs), and greedy agreement
   with the source over `generation_tokens` new tokens per prompt.

The pool is shared by handing the prefill runner's PagedKVPool to the decode runner: the same pages, the
same page-owner table, as a KV transfer between pools would deliver them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..errors import PairMismatch, QuantkitError
from ..pack import kv as kvrules
from ..pack.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, PAIR_KEY, manifest_digest, pair_problem
from ..read.checkpoint import read_json_file
from ..read.safetensors import SafetensorsFile
from .integrity import check_checkpoint

__all__ = ["check_pair", "pair_metrics"]

MAX_KV_SHARD_BYTES = 64 << 20  # two float32 scales (or one per KV head) a layer: far below this


def _shown(p: Path) -> str:
    return repr(str(p)[:200])


def _manifest(root: Path, what: str) -> dict:
    m = read_json_file(root / MANIFEST_NAME, f"the {what} checkpoint's {MANIFEST_NAME}", PairMismatch,
                       limit=MAX_MANIFEST_BYTES)
    if m.get("status") != "complete":
        raise PairMismatch(f"the {what} checkpoint {_shown(root)} is not a complete quantkit checkpoint (status "
                           f"{str(m.get('status'))[:40]!r})")
    problem = pair_problem(m.get(PAIR_KEY), complete=True) if PAIR_KEY in m else \
        "it has no 'pair' section: it was not written by convert --pair"
    if problem:
        raise PairMismatch(f"the {what} checkpoint {_shown(root)} is not one half of a pair: {problem}")
    return m


def _whole(root: Path, manifest: dict, what: str, say) -> None:
    """Every file of the half against its manifest (verify/integrity.py), or PairMismatch naming the first."""
    _, mm, _ = check_checkpoint(root, say, manifest)
    if mm:
        first = mm.items[0]
        more = f" (and {len(mm) - 1} more)" if len(mm) > 1 else ""
        raise PairMismatch(f"the {what} checkpoint {_shown(root)} does not match its manifest: "
                           f"{str(first['file'])[:120]}: {str(first['problem'])[:300]}{more}",
                           hint="the pair was changed after convert wrote it: convert it again (`quantkit convert "
                                "SRC OUT --recipe R --pair fp8-prefill --overwrite`)")


def _kv_tensors(root: Path, manifest: dict, what: str) -> dict[str, torch.Tensor]:
    entry = next((s for s in manifest.get("shards") if isinstance(s, dict) and s.get("name") == kvrules.KV_SHARD_NAME),
                 None)  # the shards were checked against the manifest by _whole
    if entry is None:
        raise PairMismatch(f"the {what} checkpoint holds no FP8 KV-cache scales ({kvrules.KV_SHARD_NAME}): a pair "
                           "shares an FP8 KV cache")
    if entry.get("size") > MAX_KV_SHARD_BYTES:
        raise PairMismatch(f"the {what} checkpoint's {kvrules.KV_SHARD_NAME} is {entry['size']} bytes: KV-cache "
                           "scales are a few floats a layer")
    try:
        with SafetensorsFile(root / kvrules.KV_SHARD_NAME) as f:
            return {n: f.get(n).clone() for n in f.header.tensors}
    except QuantkitError as e:
        raise PairMismatch(f"the {what} checkpoint's {kvrules.KV_SHARD_NAME} does not read: {e.message}") from None


def _obj(m: dict, key: str) -> dict:
    v = m.get(key)
    return v if isinstance(v, dict) else {}


def _source(m: dict) -> tuple:
    s = _obj(m, "source")
    raw = s.get("shards")
    shards = tuple((x.get("name"), x.get("size"), x.get("sha256")) for x in (raw if isinstance(raw, list) else [])
                   if isinstance(x, dict))
    return s.get("config_sha256"), shards


def _partner_is(root: Path, recorded: str, partner: Path) -> bool:
    try:
        return (root / recorded).resolve() == partner.resolve()
    except (OSError, ValueError, RuntimeError):
        return False


def check_pair(decode: Path, prefill: Path, say: Callable[[str], None] = lambda _s: None) -> dict:
    """Raise PairMismatch unless `decode` and `prefill` form a pair (module docstring, 1). -> what was checked."""
    decode, prefill = Path(decode), Path(prefill)
    md, mp = _manifest(decode, "decode"), _manifest(prefill, "prefill")
    pd, pp = md[PAIR_KEY], mp[PAIR_KEY]
    if pd["role"] != "decode" or pp["role"] != "prefill":
        raise PairMismatch(f"roles: {_shown(decode)} is {pd['role']!r}, {_shown(prefill)} is {pp['role']!r}; pass "
                           "the decode checkpoint first and the prefill one to --pair")
    for root, m, what in ((decode, md, "decode"), (prefill, mp, "prefill")):
        say(f"pair: every file of the {what} checkpoint against its manifest")
        _whole(root, m, what, say)
    if _source(md) != _source(mp) or _source(md)[0] is None:
        raise PairMismatch("the two checkpoints were converted from different sources (config.json or shard "
                           "hashes differ)")
    sd = _obj(md, "quantization_config").get("kv_cache_scheme")
    sp = _obj(mp, "quantization_config").get("kv_cache_scheme")
    if sd != sp:
        raise PairMismatch(f"KV-cache layouts differ: decode {json.dumps(sd)[:120]}, prefill {json.dumps(sp)[:120]}")
    kd, kp = _kv_tensors(decode, md, "decode"), _kv_tensors(prefill, mp, "prefill")
    if set(kd) != set(kp):
        only = sorted(set(kd) ^ set(kp))
        raise PairMismatch(f"KV scales differ: {len(only)} tensor(s) in one checkpoint only, e.g. {only[0][:120]}")
    for n in sorted(kd, key=str):
        a, b = kd[n], kp[n]
        if a.dtype != b.dtype or a.shape != b.shape or \
                not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            raise PairMismatch(f"KV scales differ: {n[:120]} is {a.reshape(-1)[:4].tolist()} in the decode "
                               f"checkpoint, {b.reshape(-1)[:4].tolist()} in the prefill one (a cache written under "
                               "one scale and read under another is silent corruption)")
    kv_sha = next(s["sha256"] for s in md["shards"] if isinstance(s, dict) and s.get("name") == kvrules.KV_SHARD_NAME)
    if pd["kv_shard_sha256"] != kv_sha or pp["kv_shard_sha256"] != kv_sha or pd.get("kv_cache_scheme") != sd \
            or pp.get("kv_cache_scheme") != sd:
        raise PairMismatch("the pair sections record another KV-scale shard or KV layout than the checkpoints hold")
    if pd["partner_manifest_sha256"] != manifest_digest(mp) or pp["partner_manifest_sha256"] != manifest_digest(md):
        raise PairMismatch("the manifests do not record each other: a partner's manifest hash differs from the "
                           "one recorded (one of them was converted again, or edited)")
    for root, sec, other, what in ((decode, pd, prefill, "decode"), (prefill, pp, decode, "prefill")):
        if not _partner_is(root, sec["partner"], other):
            raise PairMismatch(f"the {what} checkpoint records its partner at {sec['partner'][:120]!r}, which is not "
                               f"{_shown(other)}")
    return {"prefill": str(prefill), "kv_tensors": len(kd), "kv_shard_sha256": kv_sha,
            "kv_cache_scheme": sd, "source_config_sha256": _source(md)[0]}


def _kl_top1(ref: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || q) (nats) and top-1 agreement over rows of fp32 logits [N, V]."""
    lr, lq = ref.log_softmax(-1), q.log_softmax(-1)
    kl = (lr.exp() * (lr - lq)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == q.argmax(-1)).float().mean())


@torch.no_grad()
def _run(first, second, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill ids[:prompt] with `first`, then decode the rest teacher-forced with `second` reading the same
    pool. -> logits fp32 [L - prompt, V] for positions prompt-1 .. L-2."""
    own = second.pool
    second.pool = first.pool
    rid = 0
    try:
        rows = [first.prefill(rid, ids[:prompt])[-1:]]
        for tok in ids[prompt:-1].tolist():
            lg, aborted = second.decode([rid], [tok])
            if aborted:
                raise PairMismatch("the decode model's integrity check aborted the request reading the prefill "
                                   "model's pages")
            rows.append(lg)
        return torch.cat(rows)
    finally:
        if rid in first.pool.requests:
            first.pool.free(rid)
        second.pool = own


@torch.no_grad()
def _greedy(first, second, prompt: torch.Tensor, n: int) -> list[int]:
    own = second.pool
    second.pool = first.pool
    try:
        tok = int(first.prefill(0, prompt)[-1].argmax())
        out = [tok]
        while len(out) < n:
            lg, _ = second.decode([0], [tok])
            tok = int(lg[0].argmax())
            out.append(tok)
        return out
    finally:
        if 0 in first.pool.requests:
            first.pool.free(0)
        second.pool = own


def pair_metrics(ref_root: Path, decode: Path, prefill: Path, samples: list[torch.Tensor], dev: torch.device,
                 generation_tokens: int, say: Callable[[str], None] = lambda _s: None) -> dict:
    """The pair's quality against the source (module docstring, 2)."""
    from ..runtime.paged_attention import FP8_DTYPE
    from ..runtime.runner import PoolSize, load_runner

    longest = max(int(s.numel()) for s in samples) + generation_tokens + 1
    pages = -(-longest // 16) + 1
    kw = dict(device=dev, pool_size=PoolSize(num_pages=pages, max_requests=1))
    say("pair: loading the source, the prefill and the decode model into quantkit's runner")
    ref = load_runner(ref_root, **kw)
    a = load_runner(prefill, kv_dtype=FP8_DTYPE, **kw)
    b = load_runner(decode, kv_dtype=FP8_DTYPE, **kw)
    if a.pool.k_cache.shape != b.pool.k_cache.shape or a.pool.latent != b.pool.latent:
        raise PairMismatch(f"KV layouts differ: prefill pool {list(a.pool.k_cache.shape)}, decode pool "
                           f"{list(b.pool.k_cache.shape)}")
    for i, ((ka, va), (kb, vb)) in enumerate(zip(a.kv_scales, b.kv_scales)):
        if not torch.equal(ka, kb) or (va is not None and not torch.equal(va, vb)):
            raise PairMismatch(f"KV scales of layer {i} differ between the loaded models")
    logits = {"ref": [], "pair": [], "decode": [], "prefill": []}
    say(f"pair: {len(samples)} samples, prefill then teacher-forced decode")
    for s in samples:
        s = s.to(dev)
        p = max(1, int(s.numel()) // 2)
        full = ref.prefill(0, s)
        ref.free(0)
        logits["ref"].append(full[p - 1: -1])
        logits["pair"].append(_run(a, b, s, p))
        logits["decode"].append(_run(b, b, s, p))
        logits["prefill"].append(_run(a, a, s, p))
    cat = {k: torch.cat(v) for k, v in logits.items()}
    out = {}
    for k in ("pair", "decode", "prefill"):
        kl, top1 = _kl_top1(cat["ref"], cat[k])
        out[k] = {"kl_divergence": kl, "top1_agreement": top1}
    kl, top1 = _kl_top1(cat["decode"], cat["pair"])
    out["pair"]["kl_vs_decode"], out["pair"]["top1_vs_decode"] = kl, top1
    if generation_tokens > 0:
        say(f"pair: greedy generation, {generation_tokens} tokens per prompt")
        prompts = [s[: max(1, int(s.numel()) // 2)].to(dev) for s in samples]
        wants = [_greedy(ref, ref, pr, generation_tokens) for pr in prompts]
        for k, (x, y) in (("pair", (a, b)), ("decode", (b, b)), ("prefill", (a, a))):
            same = total = 0
            for prompt, want in zip(prompts, wants):
                got = _greedy(x, y, prompt, generation_tokens)
                same += sum(int(u == v) for u, v in zip(want, got))
                total += len(want)
            out[k]["generation_agreement"] = same / max(total, 1)
    out["positions"] = int(cat["ref"].shape[0])
    out["prompt_split"] = "P = L // 2: prefill ids[:P], decode the rest (teacher forced)"
    return out
