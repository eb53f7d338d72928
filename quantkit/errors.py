"""Named errors. Every failure a user can cause or meet has its own class, a one-line message and a
hint; the CLI maps them to `error: <message>` + `hint: <hint>` and exit code 1 (never a traceback unless
QUANTKIT_DEBUG=1). Library code raises these; it never prints."""

from __future__ import annotations


class QuantkitError(Exception):
    """Base of every domain failure (exit code 1)."""

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


# --- reading checkpoints ---------------------------------------------------------------------------
class CheckpointNotFound(QuantkitError):
    hint = "pass a local directory holding config.json and *.safetensors shards"


class ConfigError(QuantkitError):
    hint = "config.json must be a JSON object as written by transformers' save_pretrained"


class ConfigMissing(ConfigError):
    hint = "a checkpoint directory needs the model's config.json next to its shards"


class UnsafeCheckpoint(QuantkitError):
    hint = ("quantkit reads safetensors only and never unpickles; convert .bin/.pt files first, e.g. "
            "load them in a trusted environment and call model.save_pretrained(dir, safe_serialization=True)")


class HeaderError(QuantkitError):
    """A safetensors header is malformed, oversized, or inconsistent with the file."""

    hint = "the shard is corrupt or was not written by a safetensors writer; re-download or re-export it"


class TruncatedShard(HeaderError):
    hint = "the shard is shorter than its header says; the download or copy was probably interrupted"


class HeaderTooLarge(HeaderError):
    hint = ("the 8-byte header length is beyond the 100 MB cap the safetensors format allows; the file is "
            "corrupt or not a safetensors file")


class HeaderNotJSON(HeaderError):
    hint = "the shard's header is not a UTF-8 JSON object; the file is corrupt or not a safetensors file"


class DuplicateKey(HeaderError):
    hint = ("a JSON object in the header repeats a key, so readers could disagree on which entry wins; "
            "re-export the shard with a safetensors writer")


class InvalidOffsets(HeaderError):
    hint = ("tensor data_offsets must be non-negative integers that tile the data buffer exactly (no overlap, "
            "no hole, no trailing bytes); re-export the shard with a safetensors writer")


class TensorSizeMismatch(HeaderError):
    hint = "a tensor's dtype and shape do not match the size of its data; re-export the shard with a safetensors writer"


class IndexError_(QuantkitError):
    hint = "model.safetensors.index.json must map tensor names to shard files inside the checkpoint directory"


class MissingShard(IndexError_):
    hint = "the index names a shard file that is not in the directory; the download is incomplete, fetch the missing shard"


class UnsafeShardName(IndexError_):
    hint = ("shard names must be plain file names inside the checkpoint directory (no path separators, no '..', "
            "no symlinks pointing elsewhere); the index is corrupt or hostile")


class DuplicateTensor(QuantkitError):
    hint = "a tensor name appears in two shards; the checkpoint is inconsistent, re-export it"


class UnsupportedDtype(QuantkitError):
    hint = "supported weight dtypes: bfloat16, float16, float32, float8_e4m3fn (with block scales)"


# --- recipes and quantization ----------------------------------------------------------------------
class RecipeError(QuantkitError):
    hint = "see docs/recipes.md for the schema, or pass a shipped recipe name such as int4-experts-rtn"


class GroupSizeError(QuantkitError):
    hint = ("choose a group_size that divides in_features, or set `fallback: channel` (or another group "
            "size) in the recipe's scheme")


class NonFiniteWeight(QuantkitError):
    hint = "the source weight holds NaN/Inf values; fix or re-export the checkpoint, or add the module to the recipe's ignore list"


class QuantizationError(QuantkitError):
    hint = "run with QUANTKIT_DEBUG=1 for the traceback and report it"


# --- writing ---------------------------------------------------------------------------------------
class OutputExists(QuantkitError):
    hint = "choose an empty directory, pass --overwrite to replace it, or --resume to continue a conversion"


class OutputBusy(OutputExists):
    hint = "wait for the other conversion to finish, or choose another directory"


class ResumeMismatch(QuantkitError):
    hint = "the output was started with another source, recipe or quantkit version; use --overwrite to start over"


class DiskFull(QuantkitError):
    hint = "free disk space (or choose another output directory) and re-run: finished shards are kept and --resume continues"


class VerificationFailed(QuantkitError):
    hint = "see the report above; re-run convert or inspect the named tensors"
