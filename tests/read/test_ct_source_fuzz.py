"""Fuzzing what convert reads from a compressed-tensors source (issue 26): hypothesis builds a one-module
checkpoint of each kind (INT4 symmetric / asymmetric / actorder, NVFP4, MXFP4, FP8 tensor / channel /
block), sound, then breaks it: hostile values for the config group's args (num_bits, type, strategy,
group_size, symmetric, actorder, block_structure, format), and for its tensors (dropped, added, other dtypes,
other shapes, NaN / Inf / 0 / negative / 1e30 / 1e-45 / E8M0 255 poked into a scale, weight_shape lies).

`detect_format` -> `scan` -> `validate` (what convert runs before writing) may raise only QuantkitError
subclasses, each one line; whatever they accept must be a module compressed-tensors' own decompressor
decodes to exactly our decoding, [N, K] as stated, finite and within the plausible range. Bounded: a few
hundred examples, seconds in all.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.errors import QuantkitError
from quantkit.pack.checks import MAX_WEIGHT, fp8_nan_codes
from quantkit.pack.int4 import pack_int4, pack_zero_point
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.sources import detect_format, group_kind, scan, validate
from quantkit.read.tensors import TensorReader
from quantkit.verify.format import Judge, _Group
from quantkit.write.writer import write_safetensors

M = "model.layers.0.mlp.experts.0.down_proj"
N_EXAMPLES = 300
JUDGE = Judge()

FORMATS = {"int4": "pack-quantized", "nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized",
           "fp8": "float-quantized"}
HOSTILE_ARGS = {
    "num_bits": [0, 1, 3, 4, 8, 16, -4, 4.0, "4", None, True, 2 ** 64],
    "type": ["int", "float", "INT", "", None, 4],
    "strategy": ["group", "channel", "tensor", "block", "tensor_group", "token", "bogus", None, ["group"]],
    "group_size": [0, 7, -32, 16, 32, 64, 128, 2 ** 40, 32.0, "32", None, True],
    "symmetric": [True, False, "false", 0, None],
    "actorder": [None, "group", "weight", "bogus"],
    "block_structure": [[8, 8], [16, 32], [0, 8], [-8, 8], [8], "8x8", [8.0, 8], None],
}
POKES = [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30, 1e-45, 3.4e38, 1.0]


def sound_module(kind: str, variant: str, n: int, k: int, g: torch.Generator) -> tuple[dict, dict]:
    """(weights args, tensors) of one sound module of `kind` with weight [n, k]."""
    if kind == "int4":
        gs = 32
        w = {"num_bits": 4, "type": "int", "symmetric": variant != "asym", "strategy": "group", "group_size": gs,
             "actorder": "group" if variant == "actorder" else None}
        q = torch.randint(-8, 8, (n, k), generator=g)
        t = {"weight_packed": pack_int4(q), "weight_scale": (torch.rand(n, k // gs, generator=g) * 0.02 + 1e-3).bfloat16(),
             "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if variant == "asym":
            t["weight_zero_point"] = pack_zero_point(torch.randint(-8, 8, (n, k // gs), generator=g))
        if variant == "actorder":
            t["weight_g_idx"] = torch.randint(0, k // gs, (k,), generator=g, dtype=torch.int32)
        return w, t
    if kind in ("nvfp4", "mxfp4"):
        gs = 16 if kind == "nvfp4" else 32
        w = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group" if kind == "nvfp4" else "group",
             "group_size": gs}
        t = {"weight_packed": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)}
        if kind == "nvfp4":
            t["weight_scale"] = (torch.rand(n, k // gs, generator=g) * 400 + 1).to(torch.float8_e4m3fn)
            t["weight_global_scale"] = torch.tensor([448.0 * 6 / 0.05])
        else:
            t["weight_scale"] = torch.randint(110, 128, (n, k // gs), generator=g, dtype=torch.uint8)
        return w, t
    strategy = variant
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
         "block_structure": [8, 16] if strategy == "block" else None}
    shape = {"tensor": (1,), "channel": (n, 1), "block": (-(-n // 8), -(-k // 16))}[strategy]
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, {"weight": q, "weight_scale": torch.rand(shape, generator=g) * 1e-3 + 1e-4}


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["int4", "nvfp4", "mxfp4", "fp8"]))
    variant = draw(st.sampled_from({"int4": ["sym", "asym", "actorder"], "fp8": ["tensor", "channel", "block"]}
                                   .get(kind, ["-"])))
    n = draw(st.sampled_from([16, 24]))  # N = 8: one row of zero points, which compressed-tensors cannot view
    k = draw(st.sampled_from([32, 64, 96]))
    seed = draw(st.integers(0, 2 ** 16))
    w, tensors = sound_module(kind, variant, n, k, torch.Generator().manual_seed(seed))
    fmt = FORMATS[kind]
    edits = draw(st.lists(st.sampled_from(["arg", "format", "drop", "add", "dtype", "shape", "poke", "byte",
                                           "weight_shape"]), max_size=3))
    for e in edits:
        names = sorted(tensors)
        if e == "arg":
            key = draw(st.sampled_from(sorted(HOSTILE_ARGS)))
            w[key] = draw(st.sampled_from(HOSTILE_ARGS[key]))
        elif e == "format":
            fmt = draw(st.sampled_from(sorted(FORMATS.values()) + ["naive-quantized", "marlin-24", "dense"]))
        elif e == "drop" and names:
            tensors.pop(draw(st.sampled_from(names)))
        elif e == "add":
            extra = draw(st.sampled_from(["weight_zero_point", "weight_g_idx", "weight_global_scale", "weight_shape",
                                          "weight_scale", "input_scale"]))
            tensors[extra] = torch.ones(draw(st.sampled_from([(1,), (2,), (n, 1), (k,)])),
                                        dtype=draw(st.sampled_from([torch.int32, torch.float32, torch.int64])))
        elif e == "dtype" and names:
            name = draw(st.sampled_from(names))
            dt = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.float64,
                                       torch.bfloat16, torch.float16, torch.float8_e4m3fn]))
            try:
                tensors[name] = tensors[name].to(dt)
            except (RuntimeError, TypeError):
                pass
        elif e == "shape" and names:
            name = draw(st.sampled_from(names))
            how = draw(st.sampled_from(["flat", "3d", "halve", "empty"]))
            t = tensors[name]
            tensors[name] = (t.reshape(-1) if how == "flat" else t.reshape(1, *t.shape) if how == "3d"
                             else t[: max(1, t.shape[0] // 2)] if how == "halve" and t.dim() else t.reshape(-1)[:0])
        elif e == "poke" and names:
            name = draw(st.sampled_from(names))
            t = tensors[name].clone()
            if t.numel() and t.dtype.is_floating_point:
                t.reshape(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(POKES))
            tensors[name] = t
        elif e == "byte" and names:
            name = draw(st.sampled_from(names))
            t = tensors[name]
            if t.numel():
                flat = t.reshape(-1).clone()  # 1-D, stride 1: viewable as bytes
                flat.view(torch.uint8)[draw(st.integers(0, t.numel() * t.element_size() - 1))] = \
                    draw(st.sampled_from([0, 0x7F, 0x80, 0xFF, 0xF8, 254]))
                tensors[name] = flat.reshape(t.shape)
        elif e == "weight_shape" and "weight_shape" in tensors:
            tensors["weight_shape"] = torch.tensor(draw(st.sampled_from(
                [[n, k + 8], [n + 1, k], [-n, k], [0, 0], [n, -k], [n, k, 1], [2 ** 40, k], [n, k - 1]])),
                dtype=torch.int64)
    return fmt, w, tensors


def _write(d: Path, fmt: str, w, tensors: dict, module: str = M) -> None:
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": qc}))
    names = {f"{module}.{s}": t.contiguous() for s, t in tensors.items()}
    names["model.embed_tokens.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    write_safetensors(d / "model.safetensors", names, metadata={"format": "pt"})


def _accepted_module_is_sound(ck: Checkpoint, stored: dict) -> None:
    """What the source checks let through decodes (ours and compressed-tensors' alike) to finite weights
    of the stated shape within the plausible range."""
    with TensorReader.of(ck) as r:
        for m, sw in stored.items():
            if sw.encoding == "fp8" and fp8_nan_codes(r.get(sw.primary)):
                continue  # NaN codes in the FP8 payload: refused as the weight is copied (test_hostile_sources)
            mine = r.decode(sw, torch.float32)
            assert bool(torch.isfinite(mine).all()), m
            assert float(mine.abs().max()) <= MAX_WEIGHT * 1.01 if mine.numel() else True
            if sw.encoding == "int4":
                assert list(mine.shape) == r.get(f"{m}.weight_shape").tolist()
            else:
                assert tuple(mine.shape) == tuple(sw.shape)
            if JUDGE.ct is None or JUDGE.args_error(sw.weights):
                continue  # no judge here, or args this compressed-tensors no longer takes (actorder "group")
            local = {s: r.get(t) for s, t in sw.tensors}
            kind = "fp8" if sw.encoding == "fp8" else sw.encoding
            group = _Group("group_0", ("Linear",), sw.weights, True, kind, sw.format, sw.input_activations)
            inputs = {s: local[s] for s in ("weight", "weight_scale")} if kind == "fp8" else local
            theirs = Judge().decompress(inputs, group)  # a fresh judge: it caches each group's scheme by name
            assert tuple(theirs.shape) == tuple(mine.shape)
            assert torch.equal(theirs, mine.to(theirs.dtype)), (m, sw.label)


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases())
def test_source_checks_accept_only_sound_modules(case):
    fmt, w, tensors = case
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        _write(d, fmt, w, tensors)
        try:
            ck = Checkpoint.open(d)
            stored = scan(ck, detect_format(ck.config))
            validate(ck, stored)
        except QuantkitError as e:
            assert "\n" not in e.message and len(e.message) < 400, e.message
            return
        _accepted_module_is_sound(ck, stored)


def test_sound_modules_are_accepted():
    """The generator's unbroken modules pass the checks and the judge (else the fuzzer tests nothing)."""
    g = torch.Generator().manual_seed(0)
    for kind, variants in (("int4", ["sym", "asym", "actorder"]), ("nvfp4", ["-"]), ("mxfp4", ["-"]),
                           ("fp8", ["tensor", "channel", "block"])):
        for v in variants:
            w, t = sound_module(kind, v, 16, 64, g)
            with tempfile.TemporaryDirectory() as d:
                _write(Path(d), FORMATS[kind], w, t)
                ck = Checkpoint.open(d)
                fmt = detect_format(ck.config)
                assert group_kind(fmt.groups[0]["format"]) == kind
                stored = scan(ck, fmt)
                validate(ck, stored)
                assert list(stored) == [M]
                _accepted_module_is_sound(ck, stored)


@pytest.mark.parametrize("module", ["model.layers.0.mlp.experts.0.x\nerror: forged", "m" * 20_000, "\x1b[31mred"])
def test_hostile_module_names_stay_one_short_line(module):
    """Module names come from tensor names, which are any string: the errors that quote them stay one line."""
    w, t = sound_module("int4", "sym", 16, 64, torch.Generator().manual_seed(0))
    t["weight_scale"][0, 0] = float("nan")
    with tempfile.TemporaryDirectory() as d:
        _write(Path(d), FORMATS["int4"], w, t, module)
        ck = Checkpoint.open(d)
        with pytest.raises(QuantkitError) as e:
            validate(ck, scan(ck, detect_format(ck.config)))
    assert "\n" not in e.value.message and "\x1b" not in e.value.message and len(e.value.message) < 400
