"""Executing one shard's plan: read the source shard (and the few companions it needs from others),
run each unit through the handler of its kind, stream the output shard(s) to disk. Runs in a worker
process when `--workers` > 1; the result (hashes, manifest entries) goes back to the orchestrator.

Memory: one work batch (at most `batch_bytes` of source weights, all experts of a layer that fit) plus
the pages of the source shard read since the mappings were last dropped (every `RELEASE_BYTES` consumed:
mapped pages count as the process's resident memory until their mapping goes, so a shard read through
one mapping would end up wholly resident). FP8 weights are dequantized per tensor, in row strips
(quant/fp8.py), straight into the batch; INT4 and FP4 weights re-quantized to FP4 are decoded one module
at a time into it; RTN batches whose weights are plain views of the mapped shard
are quantized in place by the fused kernel (no copy). The batch's memory is one buffer per converting
process (`BatchBuffer`), reused by every unit of every shard: the largest batch stays allocated until
the shards are done.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import CalibratedResultError, NonFiniteWeight, SourceFormatError
from ..match.shards import ShardPlan
from ..match.units import CalibratedUnit, CopyUnit, DecodeUnit, FP4Unit, FP8Unit, PassUnit, QuantItem, RTNUnit
from ..pack.checks import fp8_nan_codes
from ..pack.config import scheme_config
from ..pack.layout import INPUT_SCALE, check_module, fp4_module, int4_module, module_tensors, scale_dtype
from ..pack.manifest import module_entry, tensor_entry
from ..quant import fp4, fp8
from ..quant.int4 import QParams, RTNResult, native_available, rtn, sqnr_db
from ..read import prehash
from ..read.safetensors import SafetensorsFile, read_header
from ..read.sources import Notes, read_scale
from ..read.tensors import TensorReader
from ..write.writer import ShardWriter, wait_durable


# source bytes consumed between two drops of the shard's mappings (`TensorReader.release`)
RELEASE_BYTES = 32 << 20


@dataclass
class ShardResult:
    source: str
    source_sha256: str
    source_size: int
    outputs: list = field(default_factory=list)  # [{name, sha256, size}] in order
    tensors: dict = field(default_factory=dict)  # output tensor name -> manifest entry
    bytes_read: int = 0
    schemes: dict = field(default_factory=dict)  # scheme label -> {format, weights, input_activations}
    notes: list = field(default_factory=list)  # what reading the source found (e.g. broken ue8m0 promise)


@dataclass(frozen=True)
class Spool:
    """What the calibrated pass (quantkit.calib) left for convert: tensor name -> spool file, and
    per-module metadata (method, tokens, fallback)."""

    files: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.files)


class _SpoolReader:
    def __init__(self, spool: Spool):
        self.spool = spool
        self._open: dict[str, SafetensorsFile] = {}

    def has(self, name: str) -> bool:
        return name in self.spool.files

    def get(self, name: str) -> torch.Tensor:
        path = self.spool.files[name]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path].get(name, copy=True)

    def close(self):
        for f in self._open.values():
            f.close()


class BatchBuffer:
    """The memory of the work batches units read their weights into, reused from unit to unit and from
    shard to shard (one per process that converts): a fresh allocation of a batch's size is a new mapping
    whose pages the kernel faults in and zeroes at first touch. In a library caller's process (no allocator
    settings) that made an MXFP4 RTN convert ~1.2x slower; under the command's settings (quantkit/allocator.py)
    the difference is within noise (bench/HISTORY.md, `fp4_rtn.py`). Grown, never shrunk; it holds the
    largest batch until dropped."""

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)

    def batch(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of `shape`, valid until the next call: nothing written out may be a
        view of it (the writer drains its queue later)."""
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(0, dtype=torch.uint8)  # the old buffer goes before the new one comes
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype).view(shape)


class _Context:
    """What every handler needs: the source reader, the spool, the shard writer, the entries so far."""

    def __init__(self, reader: TensorReader, own: str, spool: _SpoolReader, notes: Notes,
                 batches: BatchBuffer | None = None):
        self.r, self.own, self.sp, self.notes = reader, own, spool, notes
        batches = batches or BatchBuffer()
        self.writer: ShardWriter | None = None
        self.entries: dict[str, dict] = {}
        self.schemes: dict[str, dict] = {}
        self.batch = batches.batch

    def write(self, name: str, t: torch.Tensor, entry: dict) -> None:
        self.writer.write(name, t)
        self.entries[name] = entry


def run_shard(plan: ShardPlan, src_path: Path, out_dir: Path, threads: int | None = None,
              progress: Callable[[int], None] | None = None, spool: Spool = Spool(),
              batches: BatchBuffer | None = None, rotation=None) -> ShardResult:
    """Convert one source shard by its plan; `rotation` (a read.rotate.Rotation, or None): the recipe's rotation,
    which the shard's reader applies to every tensor it turns."""
    if threads:
        torch.set_num_threads(threads)
    # sha256 of the source shard, computed while it is converted (hashlib releases the GIL): the pages
    # are read once from disk and shared with the mapping
    hasher = ThreadPoolExecutor(1)
    src_hash = hasher.submit(prehash.sha256, src_path)  # started by the CLI before the imports, if it could
    hasher.shutdown(wait=False)
    header = read_header(src_path)
    location = {n: src_path.name for n in header.tensors} | dict(plan.foreign)
    reader = TensorReader(src_path.parent, location, {src_path.name: header}, rotation=rotation)
    ctx = _Context(reader, src_path.name, _SpoolReader(spool), Notes(), batches)
    outputs, entries, read, released = [], {}, 0, 0
    try:
        for out_name, units in plan.parts:
            specs = [spec for u in units for spec in u.outputs(reader.info)]
            ctx.writer = ShardWriter(out_dir / out_name, specs, metadata={"format": "pt"})
            ctx.entries = {}
            try:
                for u in units:
                    read += HANDLERS[type(u)](u, ctx)
                    if read - released >= RELEASE_BYTES:
                        # the pages read so far leave the process: a mapped page stays resident (RssFile)
                        # as long as its mapping, so without this the whole source shard would by its end
                        # (a view still queued for the writer keeps its mapping until it is written)
                        reader.release()
                        released = read
                    if progress:
                        progress(read)
                sha, size = ctx.writer.finish()
            except BaseException:
                ctx.writer.abort()
                raise
            outputs.append({"name": out_name, "sha256": sha, "size": size})
            for k, v in ctx.entries.items():
                entries[k] = {**v, "shard": out_name, "source_shard": plan.source}
    finally:
        reader.close()
        ctx.sp.close()
    return ShardResult(plan.source, src_hash.result(), src_path.stat().st_size, outputs, entries, read,
                       dict(sorted(ctx.schemes.items())), ctx.notes.items)


# ---- one handler per unit kind; each returns the source bytes it consumed -----------------------------
def _copy(u: CopyUnit, ctx: _Context) -> int:
    info = ctx.r.info(u.tensor)
    entry = tensor_entry(info.shape, info.dtype, source_tensor=u.tensor)
    if ctx.sp.has(u.tensor):  # changed by the calibrated pass (AWQ scale folding)
        ctx.write(u.tensor, ctx.sp.get(u.tensor).to(info.dtype).reshape(info.shape), {**entry, "modified_by": "awq"})
    else:
        ctx.write(u.tensor, ctx.r.get(u.tensor), entry)
    return info.nbytes


def _passthrough(u: PassUnit, ctx: _Context) -> int:
    meta = {"scheme": u.label, "method": "passthrough", "reason": u.reason}
    if u.group is not None:
        meta["group"] = u.group.name
    read = 0
    for name, src, dtype, shape in u.renames:
        t = ctx.r.get(src)
        read += t.numel() * t.element_size()
        if t.dtype == torch.float8_e4m3fn and (nan := fp8_nan_codes(t)):
            raise NonFiniteWeight(f"{src}: {nan} NaN code(s) in an FP8 weight passed through")
        ctx.write(name, t.to(dtype).reshape(shape), tensor_entry(shape, dtype, source_tensor=src, **meta))
    ctx.schemes[u.label] = json.loads(u.config)
    return read


def _item_meta(u, it: QuantItem, method: str, sqnr: float) -> dict:
    ref = it.source
    return module_entry(u.scheme.label, method, u.group.name, ref.tensor, sqnr, expert=ref.expert, rows=ref.rows,
                        encoding=ref.encoding)


def _calibrated(u: CalibratedUnit, ctx: _Context) -> int:
    """Modules quantized by the calibrated pass (GPTQ/AWQ), written from the spool."""
    read = 0
    for it in u.items:
        meta = {**_item_meta(u, it, u.group.method, 0.0), **ctx.sp.spool.modules.get(it.module, {})}
        specs = module_tensors(it.module, it.shape, u.scheme, u.src_dtype)
        for name, dtype, shape in specs:
            if not ctx.sp.has(name):
                raise CalibratedResultError(f"{it.module}: the calibrated pass produced no {name.rsplit('.', 1)[1]}",
                                            hint="re-run with --overwrite; if it persists, report it")
        tensors = {name: ctx.sp.get(name) for name, _, _ in specs}
        problem = check_module(specs, tensors)
        if problem:
            raise CalibratedResultError(f"calibrated result {problem}")
        for name, dtype, shape in specs:
            ctx.write(name, tensors[name], tensor_entry(shape, dtype, **meta))
        read += it.shape[0] * it.shape[1] * 2
    ctx.schemes[u.scheme.label] = scheme_config(u.scheme)
    return read


def _fp8(u: FP8Unit, ctx: _Context) -> int:
    w = _read_batch(u, ctx)
    res = fp8.quantize_fp8(w, u.layout)
    if not bool(res.finite.all()):
        bad = int((~res.finite).nonzero()[0])
        raise NonFiniteWeight(f"{u.items[bad].module}: weight holds NaN or Inf values")
    sqnr = res.sqnr_db().tolist()
    for b, it in enumerate(u.items):
        meta = _item_meta(u, it, "rtn", sqnr[b])
        (wn, wd, ws), (sn, sd, ss) = module_tensors(it.module, it.shape, u.scheme, u.src_dtype)
        ctx.write(wn, res.q[b], tensor_entry(ws, wd, **meta))
        ctx.write(sn, res.scale[b].reshape(ss), tensor_entry(ss, sd, **meta))
    ctx.schemes[u.scheme.label] = scheme_config(u.scheme)
    return int(w.numel() * w.element_size())


def _rtn(u: RTNUnit, ctx: _Context) -> int:
    s = u.scheme
    w = (_mapped_views(u, ctx) if s.num_bits == 4 and s.scale_search != "mse" else None) or _read_batch(u, ctx)
    for b, (it, res) in enumerate(_rtn_items(u, w, pack=True)):
        # NaN/Inf anywhere in a matrix makes its sum of squares non-finite (a NaN group would otherwise
        # quantize silently with scale 1): free to check here; the exact test runs only on the failure path
        if not bool(torch.isfinite(res.signal).all()):
            if not bool(torch.isfinite(w[b]).all()):
                raise NonFiniteWeight(f"{it.module}: weight holds NaN or Inf values")
        meta = _item_meta(u, it, "rtn", float(res.sqnr_db()))
        if s.scale_search == "mse":
            meta["scale_search"] = "mse"
        tensors = int4_module(it.module, res.q, res.qparams.scale, res.qparams.zero_point, it.shape, s, u.src_dtype)
        for (name, t), (_, dtype, shape) in zip(tensors, module_tensors(it.module, it.shape, s, u.src_dtype)):
            ctx.write(name, t, tensor_entry(shape, dtype, **meta))
    ctx.schemes[s.label] = scheme_config(s)
    return sum(int(x.numel() * x.element_size()) for x in w)


def _fp4(u: FP4Unit, ctx: _Context) -> int:
    """NVFP4 / MXFP4 round-to-nearest (quant/fp4.py). An NVFP4 gate/up pair gets one global scale, from the
    amax over both halves; a half whose partner is not in this batch (a shard boundary fell between them)
    reads the partner just for its amax."""
    s = u.scheme
    # default: fitted NVFP4 scales for INT4 sources (docs/recipes.md: MXFP4's powers of two gain nothing)
    search = s.scale_search or ("mse" if s.fp4 == "nvfp4" and all(it.source.encoding == "int4" for it in u.items)
                                else "amax")
    w = _read_batch(u, ctx)  # [B, N, K]
    read = int(w.numel() * w.element_size())
    if s.fp4 == "nvfp4":
        index = {it.module: b for b, it in enumerate(u.items)}
        gs = []
        for b, it in enumerate(u.items):
            if it.partner is None:
                gs.append(fp4.choose_global_scale(w[b]))
                continue
            j = index.get(it.partner.module)
            if j is not None:
                other = w[j]
            else:
                other = torch.empty(it.partner.shape, dtype=u.src_dtype)
                _read_2d(ctx, it.partner.source, other)
                read += int(other.numel() * other.element_size())
            gs.append(fp4.choose_global_scale(w[b], other))
        res = fp4.rtn_nvfp4(w, torch.stack(gs), search)  # global scales [B, 1]
    else:
        res = fp4.rtn_mxfp4(w, search)
    if not bool(res.finite.all()):
        bad = int((~res.finite).nonzero()[0])
        raise NonFiniteWeight(f"{u.items[bad].module}: weight holds NaN or Inf values")
    sqnr = res.sqnr_db().tolist()
    sqnr_amax = res.sqnr_amax_db().tolist() if res.noise_amax is not None else None
    for b, it in enumerate(u.items):
        meta = _item_meta(u, it, "rtn", sqnr[b])
        if sqnr_amax is not None:  # fitted scales: what amax scales would have given, for comparison
            meta |= {"scale_search": search, "sqnr_amax_db": round(sqnr_amax[b], 4)}
        values = dict(fp4_module(it.module, res.packed[b], res.scale[b],
                                 None if res.global_scale is None else res.global_scale[b]))
        if s.w4a4:  # NVFP4 W4A4: the input scale the calibrated pass measured (calib/emit.py)
            values[INPUT_SCALE.of(it.module)], extra = _input_scale(ctx, it.module)
            meta |= extra
        for name, dtype, shape in module_tensors(it.module, it.shape, s, u.src_dtype):
            ctx.write(name, values[name], tensor_entry(shape, dtype, **meta))
    ctx.schemes[s.label] = scheme_config(s)
    return read


def _input_scale(ctx: _Context, module: str) -> tuple[torch.Tensor, dict]:
    """An NVFP4 W4A4 module's calibrated `input_global_scale` [1] from the spool and its manifest record."""
    name = INPUT_SCALE.of(module)
    if not ctx.sp.has(name):
        raise CalibratedResultError(f"{module}: the calibrated pass produced no {INPUT_SCALE}",
                                    hint="re-run with --overwrite; if it persists, report it")
    t = ctx.sp.get(name).float().reshape(1)
    if not (bool(torch.isfinite(t).all()) and float(t) > 0):
        raise CalibratedResultError(f"{name}: holds {float(t)!r}, not a finite positive scale")
    meta = ctx.sp.spool.modules.get(module, {})
    return t, {"input_scale": meta["input_scale"]} if "input_scale" in meta else {}


def _decode(u: DecodeUnit, ctx: _Context) -> int:
    """A stored-quantized module written as its BF16 values (block-FP8 with a partial block along K), with
    its SQNR against the exact (float32) dequantized values."""
    it = u.item
    exact = torch.empty(it.shape, dtype=torch.float32)
    _read_2d(ctx, it.source, exact)
    w = exact.to(torch.bfloat16)
    sqnr = float(sqnr_db(exact, w.float()))
    entry = tensor_entry(it.shape, torch.bfloat16, source_tensor=it.source.tensor, method="dequantized",
                         reason=u.reason, source_scheme=u.label, source_encoding=it.source.encoding,
                         sqnr_db=round(min(sqnr, 300.0), 4))
    ctx.write(f"{it.module}.weight", w, entry)
    return it.shape[0] * it.shape[1]


HANDLERS: dict[type, Callable] = {CopyUnit: _copy, PassUnit: _passthrough, CalibratedUnit: _calibrated,
                                  FP8Unit: _fp8, FP4Unit: _fp4, RTNUnit: _rtn, DecodeUnit: _decode}


# ---- reading a batch ---------------------------------------------------------------------------------
def _read_2d(ctx: _Context, ref, out: torch.Tensor) -> None:
    """Write the weight `ref` names into `out` [N, K] (dequantizing FP8 into it directly)."""
    if ref.layout is not None:
        scale = read_scale(ctx.r.get, ref.scale, ref.layout, ref.scale_fmt, ctx.notes)
        rot = ctx.r.rotation
        if rot is not None and rot.touches(ref.tensor):  # decoded in float32, turned, cast once
            w = fp8.dequantize(ctx.r.get(ref.tensor), scale, ref.layout, torch.float32)
            out.copy_(ctx.r.turned(ref.tensor, w, out.dtype))
            return
        fp8.dequantize(ctx.r.get(ref.tensor), scale, ref.layout, out.dtype, out=out)
    elif ref.stored is not None:  # an FP4 / INT4 source: decoded as compressed-tensors decompresses it
        w = ctx.r.decode(ref.stored, out.dtype)
        if tuple(w.shape) != tuple(out.shape):  # INT4: weight_shape says less than the packed words hold
            raise SourceFormatError(f"{ref.stored.module}: weight_shape {list(w.shape)} is not the packed shape "
                                    f"{list(out.shape)}", hint="FP4 re-quantization needs in_features a multiple "
                                    "of 8 and of the FP4 group size; keep this module INT4 (ignore it)")
        out.copy_(w)
    else:
        ctx.r.read_into(ref.tensor, out, ref.expert, ref.rows)


def _read_batch(u, ctx: _Context) -> torch.Tensor:
    n, k = u.items[0].shape
    w = ctx.batch((len(u.items), n, k), u.src_dtype)  # [B, N, K] in the source (or dequantized) dtype
    for b, it in enumerate(u.items):
        if it.source.expert is None and ctx.sp.has(it.source.tensor):
            w[b].copy_(ctx.sp.get(it.source.tensor))  # modified by the calibrated pass (AWQ folding)
        else:
            _read_2d(ctx, it.source, w[b])
    return w


def _rtn_items(u: RTNUnit, w, pack: bool):
    """(item, RTNResult of that one matrix) for each item of an RTN unit: `w` is the unit's [B, N, K]
    batch, or a list of B zero-copy [N, K] views of the mapped source (see `_mapped_views`)."""
    s = u.scheme
    sd = scale_dtype(u.src_dtype)
    search = s.scale_search or "amax"  # symmetric INT4 may search its group scales (docs/recipes.md)
    if isinstance(w, torch.Tensor):
        res = rtn(w, s.num_bits, s.group_size, s.symmetric, sd, pack=pack, scale_search=search)
        zp = res.qparams.zero_point
        for b, it in enumerate(u.items):
            yield it, RTNResult(res.q[b], QParams(res.qparams.scale[b], None if zp is None else zp[b]),
                                res.signal[b], res.noise[b])
    else:
        for it, x in zip(u.items, w):
            yield it, rtn(x, s.num_bits, s.group_size, s.symmetric, sd, pack=pack, scale_search=search)


def _mapped_views(u: RTNUnit, ctx: _Context) -> list[torch.Tensor] | None:
    """The unit's weights as [N, K] views of this shard's mapping (no copy: the fused kernel reads the
    page cache directly), when every item is a dense tensor (or expert rows) of the unit's dtype stored
    in this shard and untouched by the calibrated pass; else None (the caller reads a batch)."""
    if u.src_dtype not in (torch.bfloat16, torch.float32) or not native_available():
        return None
    views = []
    for it in u.items:
        ref = it.source
        if (ref.layout is not None or ref.stored is not None or ctx.r.location.get(ref.tensor) != ctx.own
                or (ref.expert is None and ctx.sp.has(ref.tensor)) or ctx.r.turns(ref.tensor)):
            return None  # (a turned tensor is turned into the reused batch: no fresh pages per expert)
        t = ctx.r.view(ref.tensor, ref.expert, ref.rows)  # this shard's own tensor: a view of its mapping
        if t.dtype != u.src_dtype or not t.is_contiguous() or tuple(t.shape) != tuple(it.shape):
            return None
        views.append(t)
    return views


_WORKER_BATCHES: BatchBuffer | None = None  # a worker process's, kept from one shard to the next


def worker(args):
    global _WORKER_BATCHES
    plan, src_path, out_dir, threads, spool, rotation = args
    _WORKER_BATCHES = _WORKER_BATCHES or BatchBuffer()
    res = run_shard(plan, src_path, out_dir, threads, spool=spool, batches=_WORKER_BATCHES, rotation=rotation)
    wait_durable()  # this process's shards are on disk before the parent journals them
    return res
