"""A lean forward pass for Llama-family weights (LlamaForCausalLM, Qwen2ForCausalLM).

Same maths as transformers' modeling_llama / modeling_qwen2, with far fewer small operations
per decode step, because on small models the per-operation overhead, not arithmetic, sets the
speed:

- q, k and v come from one fused matmul (Qwen2's q/k/v biases fused the same way); gate and up
  projections likewise; the fused matrices share storage with the HF module's parameters
  (the HF ``q_proj.weight`` etc. become views into them), so no weight is held twice;
- rotary cos/sin tables are precomputed once per length from the model's own ``inv_freq``
  (and ``attention_scaling``), and q and k are rotated in one pass;
- keys and values go into caches preallocated for the whole generation, [B, Hkv, T, d] per
  layer; decode attention reads slots 0 .. start, and grouped-query heads are handled by
  reshaping q instead of repeating k/v.

Per layer, with x the residual stream [B, S, hidden]:

    h = RMSNorm(x) ; q,k,v = split(h W_qkv^T + b_qkv) ; q,k = rope(q), rope(k)
    x = x + softmax(q k^T / sqrt(d) + mask) v W_o^T
    x = x + (silu(g) * u) W_down^T   with  g,u = split(RMSNorm(x) W_gate_up^T)

and the output is RMSNorm_final(x) (the LM-head input). ``supports`` lists the configurations
handled; anything else goes through ``HFBackbone``.

Knows nothing about sampling or batching policy: it computes hidden states and logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from swarmrl.inference.backbone import LogitsAt

_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def supports(model: PreTrainedModel) -> bool:
    """True when ``LlamaBackbone`` computes exactly what the HF model computes."""
    cfg = model.config
    if cfg.model_type not in ("llama", "qwen2"):
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in _STATIC_ROPE:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if cfg.model_type == "qwen2" and getattr(cfg, "use_sliding_window", False):
        return False
    return not getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"


@dataclass
class KVCache:
    """Preallocated keys and values: k, v [layers, B, Hkv, max_len, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class _Layer:
    in_norm: torch.Tensor  # [hidden]
    qkv_w: torch.Tensor  # [(H + 2 Hkv) d, hidden]
    qkv_b: torch.Tensor | None  # [(H + 2 Hkv) d]
    o_w: torch.Tensor  # [hidden, H d]
    post_norm: torch.Tensor  # [hidden]
    gate_up_w: torch.Tensor  # [2 I, hidden]
    down_w: torch.Tensor  # [hidden, I]


def _fuse(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate one parameter of several Linears along dim 0 and make each a view into it."""
    parts = [getattr(lin, attr) for lin in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for p in parts:
        n = p.shape[0]
        p.data = fused[offset : offset + n]
        offset += n
    return fused


class LlamaBackbone:
    """Llama/Qwen2 forward over the weights of an HF model (see module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        if not supports(model):
            raise ValueError(f"LlamaBackbone cannot run model_type {model.config.model_type!r}")
        cfg = model.config
        self.model = model
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self._rope_len = 0
        self.reload()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def reload(self) -> None:
        """Fuse the projections again (cheap) and drop cached rotary tables."""
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = self.model.lm_head.weight
        self.layers = []
        for block in inner.layers:
            att, mlp = block.self_attn, block.mlp
            projections = [att.q_proj, att.k_proj, att.v_proj]
            self.layers.append(
                _Layer(
                    in_norm=block.input_layernorm.weight,
                    qkv_w=_fuse(projections, "weight"),
                    qkv_b=_fuse(projections, "bias"),
                    o_w=att.o_proj.weight,
                    post_norm=block.post_attention_layernorm.weight,
                    gate_up_w=_fuse([mlp.gate_proj, mlp.up_proj], "weight"),
                    down_w=mlp.down_proj.weight,
                )
            )
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().to(self.device, torch.float32)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope_len = 0
        self._storage = self._parameter_pointers()

    def _parameter_pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def stale(self) -> bool:
        """True when a parameter no longer lives where ``reload`` found it.

        That happens when the model was moved (``.to``) or loaded with ``assign=True`` behind
        the engine's back; in-place updates (optimizer steps, ``load_state_dict``) keep the
        fused tensors current by themselves.
        """
        return self._parameter_pointers() != self._storage

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] in the model dtype, computed as HF does."""
        if length > self._rope_len:
            size = max(length, 2 * self._rope_len, 256)
            pos = torch.arange(size, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]  # [size, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [size, d]
            self._cos = (emb.cos() * self.attention_scaling).to(self.dtype)
            self._sin = (emb.sin() * self.attention_scaling).to(self.dtype)
            self._rope_len = size
        return self._cos, self._sin

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (len(self.layers), batch, self.n_kv, max_len, self.head_dim)
        return KVCache(
            k=torch.empty(shape, dtype=self.dtype, device=self.device),
            v=torch.empty(shape, dtype=self.dtype, device=self.device),
        )

    def select_rows(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        return KVCache(k=cache.k.index_select(1, rows), v=cache.v.index_select(1, rows))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor | None,
        cache: KVCache | None,
        start: int,
        logits_at: LogitsAt,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See ``Backbone.forward``; ``cache=None`` runs one uncached pass from position 0."""
        batch, seq = tokens.shape
        total = start + seq
        if start == 0 and self.stale():
            self.reload()
        if cache is None and start != 0:
            raise ValueError("an uncached forward must start at position 0")
        cos_t, sin_t = self._rope_tables(int(positions.max()) + 1)
        cos = cos_t[positions][:, None]  # [B, 1, S, d]
        sin = sin_t[positions][:, None]
        mask = self._mask(key_valid, start, seq)  # [B, 1, S, total] bool, or None
        h, hk, d = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [B, S, hidden]
        for i, layer in enumerate(self.layers):
            a = self._norm(x, layer.in_norm)
            qkv = F.linear(a, layer.qkv_w, layer.qkv_b)  # [B, S, (H + 2 Hkv) d]
            qk = qkv[..., : (h + hk) * d].view(batch, seq, h + hk, d).transpose(1, 2)
            half = d // 2
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = torch.addcmul(qk * cos, rotated, sin)  # [B, H + Hkv, S, d]
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[..., (h + hk) * d :].view(batch, seq, hk, d).transpose(1, 2)
            if cache is not None:
                cache.k[i, :, :, start:total] = k
                cache.v[i, :, :, start:total] = v
                k, v = cache.k[i, :, :, :total], cache.v[i, :, :, :total]
            attn = self._attend(q, k, v, mask)  # [B, S, H d]
            x = x + F.linear(attn, layer.o_w)
            gate_up = F.linear(self._norm(x, layer.post_norm), layer.gate_up_w)
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_w)
        hidden = self._norm(x, self.final_norm)  # [B, S, hidden]
        if logits_at == "none":
            return hidden, None
        last = hidden[:, -1] if logits_at == "last" else hidden
        return hidden, F.linear(last, self.lm_head).float()

    def _mask(self, key_valid: torch.Tensor | None, start: int, seq: int) -> torch.Tensor | None:
        """bool [B, 1, S, start+S]: causal, padding keys hidden, each query sees itself.

        Letting a padding query see itself keeps its softmax finite, so no NaN reaches the
        cache (a masked NaN value would still poison the weighted sum). None (no padding)
        means plain causal attention, left to the attention kernel.
        """
        total = start + seq
        if key_valid is None:
            if start != 0 and seq > 1:
                raise ValueError("an unpadded multi-token step must start at position 0")
            return None
        if seq == 1:
            return key_valid[:, None, None, :total]
        q_pos = torch.arange(start, total, device=key_valid.device)[:, None]  # [S, 1]
        k_pos = torch.arange(total, device=key_valid.device)[None, :]  # [1, total]
        causal = k_pos <= q_pos  # [S, total]
        allowed = (causal[None] & key_valid[:, None, :total]) | (k_pos == q_pos)[None]
        return allowed[:, None]  # [B, 1, S, total]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, H, S, d], k/v [B, Hkv, T, d], mask [B, 1, S, T] or None (causal) -> [B, S, H d]."""
        batch, heads, seq, d = q.shape
        groups = heads // self.n_kv
        if groups > 1 and seq == 1:
            # Each kv head serves `groups` consecutive query heads: fold them into the query axis.
            out = F.scaled_dot_product_attention(
                q.reshape(batch, self.n_kv, groups, d), k, v, attn_mask=mask
            )  # [B, Hkv, groups, d]
            return out.reshape(batch, 1, heads * d)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        causal = mask is None and seq > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return out.transpose(1, 2).reshape(batch, seq, heads * d)
