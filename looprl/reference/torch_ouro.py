"""An independent PyTorch forward of Ouro (docs/DESIGN.md §1): the parity oracle of the Flax model.

Written from the architecture description, not from `looprl.model`, the way a PyTorch user
would write it (`torch.inference_mode`, `F.linear` on `[out, in]` weights,
`scaled_dot_product_attention`, whole-sequence tensors, no per-position Python loops):

  h0 = Emb(ids); for t = 1..T: x = h(t-1); for each of the L shared layers:
      a = x + N_in2(Attn(N_in(x)));  x = a + N_post2(W_down(silu(W_gate z) * W_up z)), z = N_post(a)
  h(t) = N_final(x);  logits_t = W_lm h(t) (fp32);  lambda_t = sigmoid(w . h(t) + b) (fp32)

RMSNorm (eps from the config) normalises in fp32, casts back to the input dtype, then
multiplies by the weight (Ouro's / Llama's HF code). RoPE is the rotate-half form with cos/sin
computed in fp32 and cast to the compute dtype; attention is causal with scale 1/sqrt(head_dim),
GQA through `enable_gqa`. Every (loop, layer) pair has its own KV cache slot in
`generate_greedy`. Loads the same HF state dict (`config.json` + `model.safetensors` or a
sharded index) with `safetensors.torch`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from looprl.model.config import OuroConfig

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_state_dict_torch(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory via `safetensors.torch` (single file or sharded index)."""
    hf_dir = Path(hf_dir)
    if (hf_dir / "model.safetensors").exists():
        return load_file(str(hf_dir / "model.safetensors"))
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for shard in sorted(set(weight_map.values())):
        state.update(load_file(str(hf_dir / shard)))
    return state


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOuro:
    """Ouro forward in PyTorch, holding HF-named weights in the compute `dtype`.

    Args:
      cfg: the architecture. state_dict: `{hf_name: tensor}` in HF shapes (`[out, in]`).
      dtype: compute dtype (`float32` / `bfloat16`); the exit gate runs in fp32.
    """

    def __init__(self, cfg: OuroConfig, state_dict: dict[str, torch.Tensor],
                 dtype: str | torch.dtype = "float32"):
        self.cfg = cfg
        self.dtype = _TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
        sd = {k: (torch.from_numpy(np.asarray(v)) if not torch.is_tensor(v) else v)
              for k, v in state_dict.items()}
        w = lambda name: sd[name].to(self.dtype).contiguous()  # noqa: E731
        self.embed = w("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                **{k: w(p + f"self_attn.{k}.weight") for k in ("q_proj", "k_proj", "v_proj",
                                                               "o_proj")},
                **{k: w(p + f"mlp.{k}.weight") for k in ("gate_proj", "up_proj", "down_proj")},
                **{k: w(p + f"{k}.weight") for k in ("input_layernorm", "input_layernorm_2",
                                                      "post_attention_layernorm",
                                                      "post_attention_layernorm_2")},
            })
        self.norm = w("model.norm.weight")
        self.gate_w = sd["model.early_exit_gate.weight"].to(torch.float32)
        self.gate_b = sd["model.early_exit_gate.bias"].to(torch.float32)
        self.lm_head = w("lm_head.weight")
        K = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, K, 2, dtype=torch.float32) / K))

    @classmethod
    def from_hf(cls, hf_dir: str | Path, dtype: str = "float32") -> "TorchOuro":
        """Load `config.json` + safetensors of an HF Ouro directory."""
        cfg = OuroConfig.from_hf_config(Path(hf_dir) / "config.json")
        return cls(cfg, load_hf_state_dict_torch(hf_dir), dtype)

    # --- pieces -------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor):
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _layer(self, lw, x, cos, sin, cache=None, pos0: int = 0):
        """One decoder layer on `x` `[B, S, D]`. With `cache` = (k, v) `[B, Hkv, Smax, K]`, the
        chunk's keys/values are written at [pos0, pos0 + S) and attention runs over [0, pos0+S)
        (S > 1 only at pos0 = 0, i.e. prefill)."""
        cfg = self.cfg
        B, S, _ = x.shape
        H, Hkv, K, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        h = _rms_norm(x, lw["input_layernorm"], eps)
        q = F.linear(h, lw["q_proj"]).view(B, S, H, K).transpose(1, 2)
        k = F.linear(h, lw["k_proj"]).view(B, S, Hkv, K).transpose(1, 2)
        v = F.linear(h, lw["v_proj"]).view(B, S, Hkv, K).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k_cache, v_cache = cache
            k_cache[:, :, pos0:pos0 + S] = k
            v_cache[:, :, pos0:pos0 + S] = v
            k, v = k_cache[:, :, :pos0 + S], v_cache[:, :, :pos0 + S]
        assert pos0 == 0 or S == 1, "chunked decode is not supported by the reference"
        o = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=Hkv != H)
        o = o.transpose(1, 2).reshape(B, S, H * K)
        a = x + _rms_norm(F.linear(o, lw["o_proj"]), lw["input_layernorm_2"], eps)
        z = _rms_norm(a, lw["post_attention_layernorm"], eps)
        m = F.linear(F.silu(F.linear(z, lw["gate_proj"])) * F.linear(z, lw["up_proj"]),
                     lw["down_proj"])
        return a + _rms_norm(m, lw["post_attention_layernorm_2"], eps)

    def _loops(self, ids: torch.Tensor, caches=None, pos0: int = 0):
        """Yield h(t) `[B, S, D]` for t = 1..T; caches[t][l] = (k, v) when given."""
        S = ids.shape[1]
        cos, sin = self._rope(torch.arange(pos0, pos0 + S))
        h = F.embedding(ids, self.embed)
        for t in range(self.cfg.total_ut_steps):
            for layer_idx, lw in enumerate(self.layers):
                cache = None if caches is None else caches[t][layer_idx]
                h = self._layer(lw, h, cos, sin, cache, pos0)
            h = _rms_norm(h, self.norm, self.cfg.rms_norm_eps)
            yield h

    def _heads(self, h):
        logits = F.linear(h, self.lm_head).to(torch.float32)
        gate = torch.sigmoid(F.linear(h.to(torch.float32), self.gate_w, self.gate_b))[..., 0]
        return logits, gate

    # --- public ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Every loop's logits `[T, B, S, V]` fp32 and exit gate `[T, B, S]` fp32 for int
        token ids `[B, S]` (no padding; positions 0..S-1)."""
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        outs = [self._heads(h) for h in self._loops(ids)]
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])

    __call__ = forward

    @torch.inference_mode()
    def expected_logits(self, ids) -> torch.Tensor:
        """The exit-distribution-weighted mixture of logits `[B, S, V]` fp32 that the upstream HF
        Ouro forward computes when given labels: `sum_t p_t logits_t` with `p_t = lambda_t *
        remaining` for t < T and `p_T = remaining` (`remaining` starts at 1 and is multiplied by
        `1 - lambda_t`), each loop's logits weighted in turn."""
        logits, gate = self.forward(ids)
        remaining = torch.ones_like(gate[0])
        mix = torch.zeros_like(logits[0])
        T = logits.shape[0]
        for t in range(T):
            p = gate[t] * remaining if t < T - 1 else remaining
            remaining = remaining * (1.0 - gate[t])
            mix = mix + p[..., None] * logits[t]
        return mix

    @torch.inference_mode()
    def generate_greedy(self, prompt_ids, max_new_tokens: int,
                        timings: dict | None = None) -> np.ndarray:
        """Greedy decoding from the last loop's logits with a KV cache of one slot per
        (loop, layer): prefill the prompt, then one token per step through all T loops.

        Args: prompt_ids int `[B, P]` (no padding: all prompts the same length); `timings`
          (optional dict) receives `prefill_s` (the prompt's pass, which emits the first token)
          and `decode_s` (the other max_new_tokens - 1 steps), wall seconds, as
          `looprl.sampling.sampler.generate(timings=)` reports them.
        Returns: int64 `[B, P + max_new_tokens]` (prompt followed by the generated tokens).
        """
        cfg = self.cfg
        ids = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.long)
        B, P = ids.shape
        s_max = P + max_new_tokens
        shape = (B, cfg.num_kv_heads, s_max, cfg.head_dim)
        caches = [[(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                   for _ in range(cfg.num_layers)] for _ in range(cfg.total_ut_steps)]
        out = [ids]
        pos0, step_ids = 0, ids
        t0 = t_first = time.perf_counter()
        for i in range(max_new_tokens):
            *_, h = self._loops(step_ids, caches, pos0)
            nxt = F.linear(h[:, -1], self.lm_head).to(torch.float32).argmax(-1, keepdim=True)
            out.append(nxt)
            pos0 += step_ids.shape[1]
            step_ids = nxt
            if i == 0:
                t_first = time.perf_counter()
        if timings is not None:
            timings.update(prefill_s=t_first - t0, decode_s=time.perf_counter() - t_first)
        return torch.cat(out, dim=1).numpy()
