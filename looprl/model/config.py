"""Model configuration of a looped (Ouro-style) decoder: dataclass, presets, HF config I/O.

Source: the Ouro configs published with Ouro-1.4B / Ouro-2.6B (HF `config.json`, model_type
`ouro`). Special token ids follow the SmolLM2 tokenizer: 0 `<|endoftext|>`, 1 `<|im_start|>`,
2 `<|im_end|>` (some shipped configs wrongly say bos = eos = pad = 0, hence the overrides).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from looprl.errors import CheckpointError, ConfigError


@dataclasses.dataclass(frozen=True)
class OuroConfig:
    """Architecture of a looped decoder: `num_layers` shared layers applied `total_ut_steps` times.

    Attributes use HF names where one exists. `head_dim` defaults to hidden_size // num_heads.
    """

    vocab_size: int = 49152
    hidden_size: int = 2048
    num_layers: int = 24
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 128
    intermediate_size: int = 5632
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    total_ut_steps: int = 4
    max_position_embeddings: int = 65536
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "total_ut_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"OuroConfig.{name} must be a positive int, found {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"OuroConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.tie_word_embeddings:
            raise ConfigError("OuroConfig.tie_word_embeddings=True is not supported: Ouro's "
                              "lm_head is untied from the embedding")

    @property
    def T(self) -> int:  # noqa: N802 - the paper's letter for the number of loops
        return self.total_ut_steps

    @property
    def num_params(self) -> int:
        D, F, V, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = D * q + 2 * D * kv + q * D + 3 * D * F + 4 * D
        return V * D * 2 + L * per_layer + D + D + 1

    def replace(self, **kw) -> "OuroConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "OuroConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown OuroConfig keys {unknown}")
        return cls(**d)

    # --- HF config.json ---------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "total_ut_steps": self.total_ut_steps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any] | str | Path,
                       token_ids: dict[str, int] | None = None) -> "OuroConfig":
        """Build from an HF `config.json` (dict or path). Extra keys the upstream code writes
        (`layer_types`, `sliding_window: null`, ...) are ignored; `model_type` must be `ouro`.

        `token_ids` overrides `bos_token_id`/`eos_token_id`/`pad_token_id` (shipped configs
        sometimes say 0 for all three; Ouro's end of turn is id 2).

        Raises:
          CheckpointError: unreadable file, wrong `model_type`, missing required key.
        """
        source = "config.json"
        if not isinstance(hf, dict):
            source = str(hf)
            try:
                hf = json.loads(Path(hf).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{source}: cannot read HF config: {e}") from e
        if hf.get("model_type") != "ouro":
            raise CheckpointError(
                f"{source}: model_type must be 'ouro', found {hf.get('model_type')!r}")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            kw = dict(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                intermediate_size=int(hf["intermediate_size"]),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                total_ut_steps=int(hf.get("total_ut_steps", 4)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 65536)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from e
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = hf.get(name)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                kw[name] = int(value)
        if token_ids:
            for name, value in token_ids.items():
                if name not in ("bos_token_id", "eos_token_id", "pad_token_id"):
                    raise ConfigError(f"unknown token id override {name!r}")
                kw[name] = int(value)
        try:
            return cls(**kw)
        except ConfigError as e:
            raise CheckpointError(f"{source}: {e}") from e


PRESETS: dict[str, OuroConfig] = {
    "ouro-1.4b": OuroConfig(),
    "ouro-2.6b": OuroConfig(num_layers=48),
    # Trains on a 2-core CPU in minutes; vocab is set from the task tokenizer at build time.
    "tiny": OuroConfig(vocab_size=64, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                       head_dim=32, intermediate_size=384, rope_theta=10000.0,
                       max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0),
}


def preset(name: str, **overrides) -> OuroConfig:
    """A named preset (`ouro-1.4b`, `ouro-2.6b`, `tiny`) with field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)


SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "total_ut_steps")


def shape_note(section, cfg: OuroConfig) -> str | None:
    """None when `cfg` (a loaded checkpoint's config) has the shape the `model` section names
    (`SHAPE_KEYS` plus the head layout; the vocabulary is the checkpoint's), else the one-line
    note that the checkpoint's shape is used: both shapes, `key preset->checkpoint`. The
    checkpoint is the model, and the note keeps a preset from passing silently as another
    shape."""
    named = from_model_section(section)
    keys = SHAPE_KEYS + ("num_kv_heads", "head_dim")
    diff = [f"{k} {getattr(named, k)}->{getattr(cfg, k)}" for k in keys
            if getattr(named, k) != getattr(cfg, k)]
    if not diff:
        return None
    return (f"note: model.checkpoint's shape differs from model.preset {section.preset!r} "
            f"({', '.join(diff)}): the checkpoint's shape is used ({cfg.num_params:,} params)")


def from_model_section(section, vocab_size: int | None = None) -> OuroConfig:
    """The `OuroConfig` an experiment's `model` section (`looprl.config.ModelConfig`) describes:
    its preset with the section's shape overrides (`SHAPE_KEYS`; None keeps the preset's).

    Overriding `num_heads` sets `num_kv_heads` to it (multi-head attention, as the released
    models), and overriding `hidden_size` or `num_heads` sets `head_dim = hidden_size //
    num_heads`. `vocab_size`, when given, replaces the preset's (`looprl verify` sizes the
    vocabulary to its task tokenizer). Every command that builds a model from a config uses this
    one function (`looprl train`'s and `looprl verify --config`'s models once differed in
    `head_dim` and `num_kv_heads`). Raises ConfigError for an unknown preset.
    """
    over = {k: getattr(section, k) for k in SHAPE_KEYS if getattr(section, k) is not None}
    if "num_heads" in over:
        over["num_kv_heads"] = over["num_heads"]
    if "hidden_size" in over or "num_heads" in over:
        base = preset(section.preset)
        over["head_dim"] = over.get("hidden_size", base.hidden_size) // over.get(
            "num_heads", base.num_heads)
    if vocab_size is not None:
        over["vocab_size"] = vocab_size
    return preset(section.preset, **over)

