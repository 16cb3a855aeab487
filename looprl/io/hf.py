"""HF-format Ouro checkpoints (`config.json` + safetensors) <-> looprl parameter dicts.

Source convention (DESIGN.md §1): HF names `model.embed_tokens.weight` `[V, D]`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`
(PyTorch Linear weights, `[out, in]`), `model.layers.{i}.{input_layernorm, input_layernorm_2,
post_attention_layernorm, post_attention_layernorm_2}.weight` `[D]`, `model.norm.weight` `[D]`,
`model.early_exit_gate.weight` `[1, D]` and `.bias` `[1]`, `lm_head.weight` `[V, D]`.

looprl convention (`looprl.model.looped.param_dict`): `embed_tokens` `[V, D]`,
`layers.{q_proj, ...}` stacked and transposed to `[L, in, out]`, norms `[L, D]`, `norm` `[D]`,
`early_exit_gate.kernel` `[D, 1]`, `.bias` `[1]`, `lm_head` `[D, V]`.

Safetensors files are read and written by `looprl.io.safetensors_file`. Both directions
stream: a tensor is read from its byte range when it is converted and dropped after,
straight into the preallocated fp32 leaf it belongs to, and an export writes the header (known
from the shapes) and then one tensor at a time. Peak host memory is the fp32 tree plus one
tensor, never two trees. F32, BF16 and F16 tensors are read; widening to fp32 is exact, so
export back to the source dtype is bit-identical.

Every malformed input raises `CheckpointError` naming the file or tensor and the expected and
found values; writers build into a temporary sibling directory and rename it into place, so a
failure leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from looprl.errors import CheckpointError
from looprl.io.safetensors_file import (
    _NAME_TO_NP,
    TensorEntry,
    dtype_name,
    mapped_views,
    safetensors_index,
    write_safetensors,
)
from looprl.io.slabs import LeafSlabs
from looprl.model.config import OuroConfig
from looprl.model.layers import LAYER_KEYS
from looprl.model.looped import model_from_params
from looprl.tokenizer import coverage_note

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# what a checkpoint records for its use (`train.setup.checkpoint_task_meta`): an HF
# `config.json` keeps it under "looprl", so a converted model answers as its source
USAGE_KEY = "looprl"
USAGE_KEYS = ("prompt_style", "stop_ids", "task", "eval")

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = LAYER_KEYS[7:]


# --- names and shapes ---------------------------------------------------------------------
def _hf_layer_name(i: int, key: str) -> str:
    if key in _ATTN:
        return f"model.layers.{i}.self_attn.{key}.weight"
    if key in _MLP:
        return f"model.layers.{i}.mlp.{key}.weight"
    return f"model.layers.{i}.{key}.weight"


def hf_tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name an Ouro checkpoint of `cfg` holds, with its HF shape (`[out, in]`)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = {"q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D), "o_proj": (D, q),
                 "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F),
                 **{n: (D,) for n in _NORMS}}
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(cfg.num_layers):
        for key in LAYER_KEYS:
            shapes[_hf_layer_name(i, key)] = per_layer[key]
    shapes.update({"model.norm.weight": (D,), "model.early_exit_gate.weight": (1, D),
                   "model.early_exit_gate.bias": (1,), "lm_head.weight": (V, D)})
    return shapes


def hf_tensor_index(hf_dir: str | Path) -> dict[str, TensorEntry]:
    """Where every tensor of an HF directory lies: `model.safetensors`, else the sharded index.
    Reads headers only.

    Returns: `{name: TensorEntry}` (its `path` is the file the tensor came from).
    Raises: CheckpointError for a missing directory/file, a shard the index lists that is
      missing, a tensor the index maps to a shard that lacks it, a tensor in two files, or any
      `safetensors_index` error.
    """
    hf_dir = Path(hf_dir)
    single, index = hf_dir / SAFETENSORS_FILE, hf_dir / SAFETENSORS_INDEX
    if single.exists():
        return safetensors_index(single)
    if not index.exists():
        raise CheckpointError(f"{hf_dir}: neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX} "
                              f"found")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: cannot read the shard index (needs a 'weight_map'): "
                              f"{e!r}") from e
    entries: dict[str, TensorEntry] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = hf_dir / shard
        if not shard_path.exists():
            names = sorted(n for n, s in weight_map.items() if s == shard)
            raise CheckpointError(f"{index}: shard {shard!r} is listed (for {len(names)} "
                                  f"tensors, e.g. {names[0]!r}) but {shard_path} is missing")
        for name, entry in safetensors_index(shard_path).items():
            if name in entries:
                raise CheckpointError(f"{shard_path}: tensor {name!r} also in "
                                      f"{entries[name].path}")
            entries[name] = entry
    for name, shard in weight_map.items():
        if name not in entries:
            raise CheckpointError(f"{index}: tensor {name!r} is mapped to {shard!r}, which "
                                  f"does not hold it")
    return entries


def read_hf_state_dict(hf_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of an HF directory as memory-mapped views (`hf_tensor_index`).

    Returns: (`{name: array}` in the file dtypes, `{name: file path it came from}`).
    Raises: CheckpointError as `hf_tensor_index`.
    """
    entries = hf_tensor_index(hf_dir)
    state: dict[str, np.ndarray] = {}
    for path in sorted({e.path for e in entries.values()}):
        state.update(mapped_views(path, {n: e for n, e in entries.items() if e.path == path}))
    return ({n: state[n] for n in entries}, {n: str(e.path) for n, e in entries.items()})


# --- HF state dict <-> looprl params --------------------------------------------------------
def params_from_hf_state(state: dict[str, np.ndarray | TensorEntry], cfg: OuroConfig,
                         source: str = "HF state dict", origin: dict[str, str] | None = None,
                         leaf_fn=None) -> dict[str, Any]:
    """Map an HF state dict onto the looprl parameter dict, in fp32 (exact widening).

    Each leaf is allocated once in fp32 and filled tensor by tensor (a `TensorEntry` is read
    when its turn comes and dropped after), so the peak is the fp32 tree plus one tensor.

    Args:
      state: `{hf_name: array or TensorEntry}` (float32 / bfloat16 / float16), HF shapes
        `[out, in]`.
      cfg: the architecture the tensors must match.
      source: where the tensors came from, for messages; origin: per-tensor file (default:
        each `TensorEntry`'s own path).
      leaf_fn: `leaf_fn(keys, LeafSlabs) -> array` replaces each leaf, given as its fp32 slabs
        (one layer per slab for the layer stacks, one slab otherwise), so the fp32 tree, and a
        fp32 layer stack, never exist at once (`looprl.sampling.resident`'s bf16 weights).
    Returns: nested dict of fp32 numpy arrays (see module docstring for shapes), or of what
      `leaf_fn` returned.
    Raises: CheckpointError naming the tensor (and file) for a missing tensor (including
      `lm_head.weight`: Ouro's head is untied and is never invented), an unexpected tensor, or
      a wrong shape (expected vs found).
    """
    if origin is None:
        origin = {n: str(x.path) for n, x in state.items() if isinstance(x, TensorEntry)}
    expected = hf_tensor_shapes(cfg)
    missing = [n for n in expected if n not in state]
    if missing:
        extra = ""
        if "lm_head.weight" in missing:
            extra = (" (tie_word_embeddings is false, so lm_head.weight must be present; "
                     "looprl never builds a random or tied head)")
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} (expected shape "
                              f"{list(expected[missing[0]])}){extra}"
                              + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else ""))
    unexpected = sorted(n for n in state if n not in expected)
    if unexpected:
        n = unexpected[0]
        raise CheckpointError(f"{origin.get(n, source)}: unexpected tensor {n!r} (shape "
                              f"{list(state[n].shape)}) for a {cfg.num_layers}-layer Ouro model"
                              + (f"; {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    for n, shape in expected.items():
        if tuple(state[n].shape) != shape:
            raise CheckpointError(f"{origin.get(n, source)}: tensor {n!r} has shape "
                                  f"{list(state[n].shape)}, expected {list(shape)}")
        dtype_name(state[n].dtype)  # F32 / BF16 / F16 only

    def read(name):
        x = state[name]
        return x.read() if isinstance(x, TensorEntry) else np.asarray(x)

    def stacked(names, transpose):
        """`[len(names), ...]` fp32, filled one tensor at a time (the widening is exact)."""
        shape = tuple(state[names[0]].shape)
        out = np.empty((len(names), *(shape[::-1] if transpose else shape)), np.float32)
        for i, name in enumerate(names):
            w = read(name)
            out[i] = w.T if transpose else w
        return out

    def layer_stack(keys, names, transpose):  # with leaf_fn: one slab per layer
        if leaf_fn is None:
            return stacked(names, transpose)
        shape = tuple(state[names[0]].shape)
        return leaf_fn(keys, LeafSlabs.along((len(names), *(shape[::-1] if transpose else shape)),
                                             0, 1, lambda i, j: stacked(names[i:j], transpose)))

    def single(keys, name, transpose=False):
        leaf = stacked([name], transpose)[0]
        return leaf if leaf_fn is None else leaf_fn(keys, LeafSlabs.whole(leaf))

    return {
        "embed_tokens": single(("embed_tokens",), "model.embed_tokens.weight"),
        "layers": {key: layer_stack(("layers", key), [_hf_layer_name(i, key) for i in
                                                      range(cfg.num_layers)], key not in _NORMS)
                   for key in LAYER_KEYS},
        "norm": single(("norm",), "model.norm.weight"),
        "early_exit_gate": {
            "kernel": single(("early_exit_gate", "kernel"), "model.early_exit_gate.weight",
                             transpose=True),
            "bias": single(("early_exit_gate", "bias"), "model.early_exit_gate.bias")},
        "lm_head": single(("lm_head",), "lm_head.weight", transpose=True),
    }


def hf_tensors(params: dict[str, Any], cfg: OuroConfig, dtype: str | dict[str, str] = "float32"):
    """The inverse of `params_from_hf_state`, one tensor at a time: yields `(hf_name, C-contiguous
    numpy array)` in `hf_tensor_shapes(cfg)` order, each made only when it is asked for.

    Args:
      params: looprl parameter dict (numpy or jax arrays, any float dtype).
      dtype: the written dtype (`float32`/`bfloat16`/`float16`), or a per-HF-name dict of them
        (a mixed-dtype source's own dtypes). Narrowing rounds to nearest even; values that
        came from that dtype are reproduced bit for bit.
    """
    def cast(name, a, transpose=False):
        a = np.asarray(a)
        return name, (a.T if transpose else a).astype(_NAME_TO_NP[hf_dtype(dtype, name)],
                                                      order="C")

    layers, gate = params["layers"], params["early_exit_gate"]
    yield cast("model.embed_tokens.weight", params["embed_tokens"])
    for i in range(cfg.num_layers):
        for key in LAYER_KEYS:
            yield cast(_hf_layer_name(i, key), layers[key][i], transpose=key not in _NORMS)
    yield cast("model.norm.weight", params["norm"])
    yield cast("model.early_exit_gate.weight", gate["kernel"], transpose=True)
    yield cast("model.early_exit_gate.bias", gate["bias"])
    yield cast("lm_head.weight", params["lm_head"], transpose=True)


def hf_dtype(dtype: str | dict[str, str], name: str) -> str:
    """The dtype name tensor `name` is written in: `dtype` itself, or its entry for `name`."""
    return dtype_name(dtype[name] if isinstance(dtype, dict) else dtype)


def hf_state_from_params(params: dict[str, Any], cfg: OuroConfig,
                         dtype: str | dict[str, str] = "float32") -> dict[str, np.ndarray]:
    """`{hf_name: contiguous numpy array}`: every tensor of `hf_tensors` at once."""
    return dict(hf_tensors(params, cfg, dtype))


# --- directories ------------------------------------------------------------------------------
class HFCheckpoint(NamedTuple):
    """An HF directory read into looprl form.

    params: fp32 numpy parameter dict; cfg: its `OuroConfig`; source_dtype: the tensors' dtype
    name when uniform, else the most common one; source_dtypes: `{hf_name: dtype name}`;
    tokenizer_json: the text of `tokenizer.json` if the directory has one, else None.
    """
    params: dict[str, Any]
    cfg: OuroConfig
    source_dtype: str
    source_dtypes: dict[str, str]
    tokenizer_json: str | None


def check_not_run_directory(path: str | Path) -> None:
    """Raise CheckpointError "RUN is a run directory; its checkpoint is RUN/checkpoint" when
    `path` is a `looprl train` run directory (a `checkpoint/` holding a looprl checkpoint)
    rather than a checkpoint: its config.json is the experiment's, not a model's."""
    path = Path(path)
    ckpt = path / "checkpoint"
    if (ckpt / "looprl_meta.json").is_file() and not (path / "looprl_meta.json").exists():
        raise CheckpointError(f"{path} is a run directory; its checkpoint is {ckpt}")


def read_hf(hf_dir: str | Path, token_ids: dict[str, int] | None = None,
            leaf_fn=None) -> HFCheckpoint:
    """Read `config.json` + safetensors (single or sharded) of an HF Ouro directory.

    `token_ids` overrides the config's bos/eos/pad ids (see `OuroConfig.from_hf_config`);
    `leaf_fn(keys, LeafSlabs)` replaces each fp32 leaf (`params_from_hf_state`).
    Raises: CheckpointError (unknown `model_type`, missing/extra/misshapen tensor, truncated
      file, missing shard, a run directory given for its checkpoint, ...), naming the file or
      tensor.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir}: not a directory (expected an HF model directory)")
    check_not_run_directory(hf_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path}: missing (an HF directory needs config.json)")
    cfg = OuroConfig.from_hf_config(cfg_path, token_ids=token_ids)
    entries = hf_tensor_index(hf_dir)
    params = params_from_hf_state(entries, cfg, source=str(hf_dir), leaf_fn=leaf_fn)
    source_dtypes = {n: dtype_name(e.dtype) for n, e in entries.items()}
    counts: dict[str, int] = {}
    for d in source_dtypes.values():
        counts[d] = counts.get(d, 0) + 1
    source_dtype = max(counts, key=counts.get)
    tok_path = hf_dir / "tokenizer.json"
    tokenizer_json = tok_path.read_text() if tok_path.exists() else None
    return HFCheckpoint(params, cfg, source_dtype, source_dtypes, tokenizer_json)


def load_hf(path: str | Path, dtype="float32", token_ids: dict[str, int] | None = None):
    """Load an HF Ouro directory as a `LoopedLM` with parameters and compute in `dtype`.

    `model(tokens_BxS)` (int32 `[B, S]`) returns `.logits` `[T, B, S, V]` fp32 and
    `.exit_lambda` `[T, B, S]` fp32. The returned module carries `source_dtype` (the HF
    tensors' dtype name) so that an export defaults to it. A `tokenizer.json` whose id count
    differs from the model's vocabulary gives a UserWarning naming both
    (`looprl.tokenizer.coverage_note`). Raises CheckpointError (see `read_hf`).
    """
    ckpt = read_hf(path, token_ids=token_ids)
    note = ckpt.tokenizer_json and coverage_note(ckpt.tokenizer_json, ckpt.cfg.vocab_size)
    if note:
        warnings.warn(f"{path}: {note}", stacklevel=2)
    model = model_from_params(ckpt.params, ckpt.cfg, dtype)
    model.source_dtype = ckpt.source_dtype
    return model


def _atomic_dir(out_dir: Path):
    """A fresh temporary sibling of `out_dir` (same filesystem, so the final rename is atomic).
    Refuses an existing non-empty `out_dir`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir}: already exists and is not an empty directory; "
                              f"refusing to overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def _commit_dir(tmp: Path, out_dir: Path):
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked by _atomic_dir)
    os.replace(tmp, out_dir)


def usage_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """The `USAGE_KEYS` a checkpoint's meta records (prompt style, stop ids, task, the
    evaluation's sampling settings): what `generate` and `eval` take from a checkpoint."""
    return {k: meta[k] for k in USAGE_KEYS if meta.get(k) is not None}


def hf_usage_settings(hf_dir: str | Path) -> dict[str, Any]:
    """The usage settings an HF directory's `config.json` keeps under "looprl" (written by
    `looprl convert --to-hf`); {} when it keeps none or cannot be read."""
    try:
        hf_cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    rec = hf_cfg.get(USAGE_KEY) if isinstance(hf_cfg, dict) else None
    return usage_settings(rec) if isinstance(rec, dict) else {}


def save_hf(params: dict[str, Any], cfg: OuroConfig, out_dir: str | Path,
            dtype: str | dict[str, str] = "float32", tokenizer_json: str | None = None,
            usage: dict[str, Any] | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ `tokenizer.json` if given) into `out_dir`;
    `usage` (`usage_settings` of a looprl checkpoint) goes into `config.json` under "looprl".

    Tensors are written in `dtype` (a name, or `{hf_name: name}` to restore a mixed source),
    one at a time (`write_safetensors`: the host holds `params` plus one tensor);
    `config.json` records it as `torch_dtype`. Written atomically: built in a temporary
    sibling directory and renamed; an existing non-empty `out_dir` is a CheckpointError.
    """
    out_dir = Path(out_dir)
    shapes = {n: (shape, hf_dtype(dtype, n)) for n, shape in hf_tensor_shapes(cfg).items()}
    tmp = _atomic_dir(out_dir)
    try:
        hf_cfg = cfg.to_hf_config()
        hf_cfg["torch_dtype"] = hf_dtype(dtype, "model.embed_tokens.weight")
        if usage:
            hf_cfg[USAGE_KEY] = usage
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        write_safetensors(tmp / SAFETENSORS_FILE, shapes, hf_tensors(params, cfg, dtype),
                          metadata={"format": "pt"})
        if tokenizer_json is not None:
            (tmp / "tokenizer.json").write_text(tokenizer_json)
        _commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
