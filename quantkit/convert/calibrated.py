"""What `convert` needs from calibration: the token samples for GPTQ/AWQ groups, the calibrated pass
itself (quantkit.calib, spooled under the journal, resumable per layer), and the FP8 KV-cache scales to
ship (a file from `quantkit calibrate`, or calibrated here when the recipe has a `kv_cache` section)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..arch import text_config
from ..errors import CalibrationNeeded, KVScalesError, QuantkitError
from ..match.recipe import CalibrationSpec, Recipe
from ..pack import kv as kvrules
from ..read.checkpoint import Checkpoint, read_json_file
from ..read.kv_scales import read_kv_scales
from ..write.writer import ShardWriter, sha256_file, write_json_atomic
from .run import Spool


def calibration_data(src: Checkpoint, recipe: Recipe, dataset: str | None, num_samples: int | None,
                     seq_len: int | None):
    """Token samples for the calibrated groups: the options first, then the recipe's calibration section,
    then the defaults (match.recipe.CalibrationSpec)."""
    from ..calib.data import load_calibration_data, load_tokenizer

    cal = recipe.calibration or CalibrationSpec()
    vocab = text_config(src.config)[0].get("vocab_size")
    n = num_samples or cal.num_samples
    return load_calibration_data(dataset or cal.dataset, tokenizer=load_tokenizer(src.root),
                                 vocab_size=vocab if isinstance(vocab, int) else None,
                                 num_samples=n, seq_len=seq_len or cal.seq_len, pool_samples=recipe.balance_pool(n))


def calibrated_pass(src: Checkpoint, recipe: Recipe, data, spool_dir: Path, log, device: str | None = None,
                    report: dict | None = None, world=None, dtype: str | None = None) -> Spool:
    """GPTQ/AWQ layer by layer (quantkit.calib) on `device` (cpu, cuda, cuda:N, auto; None: the default) in
    the compute dtype `dtype` (auto, float32, bfloat16; None: the default),
    spooled under the journal. A spool left by an interrupted run of the same identity is reused when it is
    complete, and continued from the last finished layer when it is not. `report` (a dict) receives the
    device and its memory plan (calib/device.py) of the pass that made the spool.

    `world` (quantkit.dist.World; None: one process): under torchrun every rank calls this; the pass runs
    data and expert parallel over the ranks (calib/parallel.py), rank 0 writes the spool, and every rank
    returns the same Spool. Failures on any rank are raised on every rank (World.step)."""
    from ..calib.device import Placement
    from ..calib.spool import PROGRESS_NAME, index_problem, run_calibrated
    from ..dist import World

    w = world if world is not None else World()
    done = spool_dir / "index.json"

    def look():  # rank 0: the finished spool's index, or None (an unusable partial spool removed)
        if done.is_file():
            try:
                index = read_json_file(done, "calibration spool index")
            except QuantkitError as e:
                problem = e.message
            else:
                problem = index_problem(index, spool_dir)
                if problem is None:
                    return index
            if log:
                log(f"resume: the finished calibration spool is not usable ({problem}); calibrating again")
            shutil.rmtree(spool_dir)
            return None
        if spool_dir.exists() and not (spool_dir / PROGRESS_NAME).is_file():
            shutil.rmtree(spool_dir)
        return None

    # the checkpoint itself when the recipe rotates it (its readers turn what the layers load); else its directory
    model = src if getattr(src, "rotation", None) is not None else src.root
    index = w.broadcast(w.step(lambda: look() if w.leader else None, "reading the calibration spool"))
    if index is None:
        if log and w.leader:
            what = sorted({g.method for g in recipe.groups if g.method != "rtn"})
            what += ["NVFP4 input scales"] if any(g.scheme.w4a4 for g in recipe.groups) else []
            log(f"calibrating {', '.join(what)} on "
                f"{data.num_samples} samples x {data.seq_len} tokens, layer by layer"
                + (f" (and a top-up pool of {data.pool} samples)" if data.pool else "")
                + (f", over {w.size} ranks" if w.size > 1 else ""))
        if w.size == 1:
            index = run_calibrated(model, recipe, data.samples, spool_dir, log=log or (lambda m: None),
                                   placement=Placement(device, dtype), pool=data.pool)
            write_json_atomic(done, index)
        else:
            index = run_calibrated(model, recipe, data.samples, spool_dir, log=log or (lambda m: None),
                                   placement=Placement(device, dtype), world=w, pool=data.pool)

            def finish():
                if w.leader:
                    write_json_atomic(done, index)
                    return index
                return None

            index = w.broadcast(w.step(finish, "writing the calibration spool index"))
    if report is not None and "device" in index:
        report.update(device=index["device"], memory=index.get("memory"))

    def spool():
        files = {}
        for layer in index["layers"]:
            meta = read_json_file(spool_dir / f"{layer}.json", f"{layer}.json")
            for name in meta["tensors"] + meta["overrides"]:
                files[name] = str(spool_dir / f"{layer}.safetensors")
        return Spool(files, index["modules"])

    return w.step(spool, "reading the calibration spool")


def preflight(src: Checkpoint, recipe: Recipe, data, device: str, ranks: int = 1, dtype: str | None = None) -> None:
    """Plan the calibrated pass's device memory (calib/device.py) on `ranks` ranks before any work, so that a
    layer that cannot fit on the device stops the conversion before KV calibration or anything else runs."""
    from ..calib.executor import LayerExecutor
    from ..calib.layer import statistics_bytes

    ex = LayerExecutor(src.root, device=device, dtype=dtype)
    lengths = [int(len(x)) for x in data.samples]
    ex.plan_memory(lengths, statistics=lambda i, layer: statistics_bytes(
        ex.ckpt, recipe, i, layer, ex.device, ex.dtype, ex.call_tokens(lengths), lengths, ranks))


def kv_scales(src: Checkpoint, recipe: Recipe, opts, report: dict | None = None, world=None) -> kvrules.KVScales:
    """The KV scales to ship, checked against the source model (`opts`: the convert's ConvertOptions): from the
    file `opts.kv_scales`, or calibrated now (recipe `kv_cache` section, on `opts.device` in `opts.compute_dtype`)
    on the same data as the calibrated groups: the options first, then the recipe's calibration section, then the
    defaults. `report` (a dict) receives the calibration's device and memory plan when it ran. `world`
    (quantkit.dist.World): under torchrun every rank calls this and the calibration runs data parallel over the
    ranks (calib/kv_dist.py), with the same result on every rank."""
    want = recipe.kv_cache.strategy if recipe.kv_cache is not None else None
    path, device, dtype = opts.kv_scales, opts.device, opts.compute_dtype
    if path is not None:
        scales = read_kv_scales(path)
        origin = {"file": str(path), "sha256": sha256_file(path)}
    else:
        calibrate = _find_calibrate()
        if calibrate is None:
            raise CalibrationNeeded(f"recipe {recipe.name!r} asks for FP8 KV-cache scales (kv_cache), which need "
                                    "calibration on real activations; no --kv-scales file was given")
        cal = recipe.calibration or CalibrationSpec()
        data = {"dataset": opts.dataset or cal.dataset, "num_samples": opts.num_samples or cal.num_samples,
                "seq_len": opts.seq_len or cal.seq_len}
        if world is not None and world.size > 1:
            from ..calib.kv_dist import calibrate_ranks

            res = calibrate_ranks(str(src.root), world, **data, strategy=want, device=device, dtype=dtype)
        else:
            from ..calibrate import CalibrateOptions

            res = calibrate(str(src.root), CalibrateOptions(**data, strategy=want, dtype=dtype,
                                                            **({} if device is None else {"device": device})))
        if report is not None and getattr(res, "device", None) is not None:
            report.update(device=res.device, memory=res.memory)
        scales = {n: t.detach().cpu() for n, t in dict(res.scales).items()}
        origin = {"calibrate": data}
    cfg, prefix = text_config(src.config)
    mla = "kv_lora_rank" in cfg
    if mla:
        scales = kvrules.normalize_mla(scales)
        want = kvrules.shipped_strategy(want, True) if want else want
    n_layers = cfg.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise KVScalesError("config.json has no num_hidden_layers to check the KV scales against")
    attn = {int(m[1]) for n in src.location if (m := kvrules.ATTN_TENSOR.match(n))}
    strategy = kvrules.validate(scales, num_layers=n_layers, attn_layers=[a for a in attn if a < n_layers],
                                kv_heads=cfg.get("num_key_value_heads") or cfg.get("num_attention_heads"), mla=mla,
                                strategy=want)
    return kvrules.KVScales(scales, strategy, origin, prefix)


def _find_calibrate():
    """`quantkit.calibrate.calibrate` when that module exists (it is optional); None otherwise."""
    try:
        from .. import calibrate as mod
    except ModuleNotFoundError as e:
        if e.name == "quantkit.calibrate":
            return None
        raise
    return getattr(mod, "calibrate", None)


def write_kv_scales(out: Path, kv: kvrules.KVScales) -> dict:
    """The extra shard holding the scales; returns its {name, sha256, size}."""
    items = kv.ordered()
    writer = ShardWriter(out / kvrules.KV_SHARD_NAME, [(n, t.dtype, tuple(t.shape)) for n, t in items],
                         metadata={"format": "pt"})
    try:
        for n, t in items:
            writer.write(n, t.contiguous())
        sha, size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"name": kvrules.KV_SHARD_NAME, "sha256": sha, "size": size}
