"""A checkpoint read as if its residual stream were rotated: the recipe's `rotate:` (quant/rotate.py's Q) fused
into each tensor as the one tensor reader (read/tensors.py) hands it out, so that everything downstream (RTN,
the calibrated pass, KV calibration, plain copies) sees the rotated model and needs no change of its own.

`Rotation.plan` decides everything before a byte is written: each tensor's role (arch/residual.py), and the
gains of the norms the readers fold in, read up front (a few KB a layer). A tensor the rotation cannot turn
exactly is a RotationError naming it: tied embeddings, an MTP layer, an unknown tensor of the hidden width, a
module the source stores INT4 / FP4 (rotating it would re-quantize it). Block-FP8 modules are decoded to floats
and then turned (the output stores them as the recipe says, or as BF16).

Each tensor is turned in float32 from its source values (an FP8 module from its decoded values) and cast to
its dtype once; a fused expert tensor is turned one expert at a time when read an expert at a time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..arch import text_config
from ..arch.residual import EMBEDDING, NORM, READER, WRITER, WRITER_BIAS, Role, residual_roles
from ..errors import RotationError
from ..quant.rotate import Hadamard, RotationSpec

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
CHUNK = 1 << 22  # elements of one float32 strip turned at a time (16 MiB)


@dataclass(frozen=True)
class Rotation:
    """The rotation of one checkpoint: Q, every turned tensor's role, and the readers' norm gains."""

    spec: RotationSpec
    hidden: int
    roles: Mapping[str, Role]
    gains: Mapping[str, torch.Tensor] = field(repr=False)  # norm weight tensor -> its gain, float32 [H]

    @property
    def q(self) -> Hadamard:
        return Hadamard(self.hidden, self.spec.seed, self.spec.block)

    @classmethod
    def plan(cls, ckpt, spec: RotationSpec, stored: Mapping | None = None) -> "Rotation":
        """The rotation of `ckpt` (a read.checkpoint.Checkpoint; `stored`: read.sources.scan's modules the
        source stores quantized). RotationError, naming the tensor, for anything it cannot turn."""
        from .tensors import TensorReader

        stored = stored or {}
        cfg, prefix = text_config(ckpt.config)
        hidden, layers = cfg.get("hidden_size"), cfg.get("num_hidden_layers")
        if not (isinstance(hidden, int) and isinstance(layers, int)) or hidden <= 0 or layers < 0:
            raise RotationError("config.json gives no hidden_size / num_hidden_layers to rotate by")
        tied = bool(cfg.get("tie_word_embeddings", False)) or bool(ckpt.config.get("tie_word_embeddings", False))
        companions = {t for sw in stored.values() for _, t in sw.tensors}
        names = [n for n in ckpt.location if n not in companions] + [f"{m}.weight" for m in stored]
        shapes = {m + ".weight": tuple(sw.shape) for m, sw in stored.items()}
        rmap = residual_roles(names, lambda n: shapes.get(n) or tuple(ckpt.info(n).shape), prefix=prefix,
                              hidden=hidden, num_layers=layers, tied=tied)
        if rmap.refused:
            name, why = rmap.refused[0]
            more = f" (and {len(rmap.refused) - 1} more)" if len(rmap.refused) > 1 else ""
            raise RotationError(f"cannot rotate {name[:120]}: {why}{more}")
        for m, sw in sorted(stored.items()):
            if m + ".weight" in rmap.roles and not sw.encoding.startswith("fp8"):
                raise RotationError(f"cannot rotate {m[:120]}: the source stores it {sw.encoding}, and turning it "
                                    "would re-quantize it")
        for name in rmap.roles:
            if name in ckpt.location and name not in shapes and ckpt.info(name).dtype not in FLOATS:
                raise RotationError(f"cannot rotate {name[:120]}: dtype {ckpt.info(name).dtype} is not a float")
        gains = {}
        with TensorReader.of(ckpt, mapped=False) as r:  # unrotated: the norms as stored
            for norm in sorted({role.norm for role in rmap.roles.values() if role.norm is not None}):
                g = r.get(norm).to(torch.float32)
                if tuple(g.shape) != (hidden,) or not bool(torch.isfinite(g).all()):
                    raise RotationError(f"cannot rotate by {norm[:120]}: shape {list(g.shape)}, not [{hidden}] and "
                                        "finite")
                gains[norm] = g.clone()
        return cls(spec, hidden, dict(rmap.roles), gains)

    def touches(self, name: str) -> bool:
        return name in self.roles

    def turn(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Tensor `name` (or one expert [N, K] of a fused 3-D tensor) as the rotated model holds it, float32."""
        return self.rotated(name, t, torch.float32)

    def by_rows(self, name: str) -> bool:
        """Whether each row of tensor `name` is turned on its own (a reader, an embedding: W Q), so that rows
        r0:r1 of the turned tensor are the turned rows r0:r1; a writer's rows (Q^T W) each depend on all rows."""
        return self.roles[name].kind in (READER, EMBEDDING)

    def rotated(self, name: str, t: torch.Tensor, dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (or one expert of a fused tensor) turned in float32 and cast once to `dtype` (default: t's
        own): a fresh tensor, or written into `out` (contiguous, t's shape: a reused buffer, no fresh pages to
        fault in) and returned. Turned in strips of CHUNK elements (rows of a reader or an embedding, columns of
        a writer, one expert of a fused tensor at a time): the float32 temporaries stay small whatever the tensor
        (a 160k x 7168 embedding), and a row's or column's result does not depend on the strip it was in."""
        role = self.roles[name]
        dtype = dtype or (t.dtype if out is None else out.dtype)
        if out is not None and (tuple(out.shape) != tuple(t.shape) or out.dtype != dtype or not out.is_contiguous()):
            raise ValueError(f"cannot turn {name[:120]} into a {list(out.shape)} {out.dtype} buffer")
        if role.kind == NORM:
            return torch.ones(t.shape, dtype=dtype) if out is None else out.fill_(1)
        out = torch.empty(t.shape, dtype=dtype) if out is None else out
        for src, dst in zip(t.reshape(-1, *t.shape[-2:]) if t.dim() >= 2 else [t],
                            out.reshape(-1, *t.shape[-2:]) if t.dim() >= 2 else [out]):
            self._strips(role, src, dst)
        return out

    def _strips(self, role: Role, t: torch.Tensor, out: torch.Tensor) -> None:
        q = self.q
        step = max(1, CHUNK // self.hidden)
        if role.kind == WRITER:  # [H, K]: Q^T W, column strips (one strip, in place, where the tensor fits it)
            for k in range(0, t.shape[-1], step):
                q.turned_cols(t[:, k:k + step], out.dtype, out=out[:, k:k + step])
            return
        gain = self.gains[role.norm] if role.kind == READER else None
        if role.kind not in (READER, WRITER_BIAS, EMBEDDING):
            raise AssertionError(role.kind)
        if t.dim() == 1:  # a writer's bias b Q
            out.copy_(q.turned(t[None], gain, out.dtype)[0])
            return
        for r in range(0, t.shape[0], step):  # row strips of a contiguous `out` are contiguous: written in place
            q.turned(t[r:r + step], gain, out.dtype, out=out[r:r + step])

    def manifest(self) -> dict:
        """The manifest's record of the rotation."""
        counts: dict[str, int] = {}
        for role in self.roles.values():
            counts[role.kind] = counts.get(role.kind, 0) + 1
        return {"kind": self.spec.kind, "seed": self.spec.seed, "hidden_size": self.hidden,
                "block_size": self.q.block, "blocks": self.hidden // self.q.block, "signs": "torch.Generator(cpu)",
                "tensors": dict(sorted(counts.items()))}
