"""A lean forward pass for Llama-architecture models on CPU, with fused projections.

Why: a batch-32 decode step of SmolLM2-135M through transformers' modules runs
~1,500 small tensor ops and 211 matmuls (30 layers x 7 + the LM head), and its
attention goes through the CPU flash-attention kernel, which is slow for one
query per row. Measured per CPU-second on the 2-core machine of
``benches/engine.py`` (one thread, under load; see benches/README.md): the
linears took ~60% of the step, attention ~15%, the rest was elementwise ops,
dispatch and sampling. This module computes the same function with:

1. q/k/v fused into one matmul and gate/up into another (4 matmuls per layer
   instead of 7), each weight packed once for oneDNN (as ``linear.py`` does),
   except that one or two rows use ``F.linear`` (``_Packed``);
2. decode attention (one query per row) as two batched matmuls over the KV
   slab, each query head grouped with its key/value head (no ``repeat_kv``
   copy), the padding columns masked to -inf before the softmax;
3. one ``torch.rms_norm`` per norm instead of five ops; and no per-layer
   module dispatch, mask building or output dataclasses.

It is exact in the engine's sense: the same products and reductions in
float32, in another order (a fused matmul sums each output over the same
inputs; the grouped attention is ``eager_attention_forward`` without the
copy), so logprobs match a plain transformers forward within 1e-4
(tests/engine/test_engine_fused.py checks logits and the engine end to end).
Prefill (``prefill``) runs the chunks of several prompts in one forward: their
rows share every matmul (one 39-token prompt at a time multiplies 39 rows by
every weight, streaming the whole model each time) while each chunk attends
only to its own cache, through ``scaled_dot_product_attention`` with an
explicit causal mask, as transformers' ``sdpa`` path does.

Supported: ``model_type == "llama"`` without attention/MLP biases, SiLU MLP,
one RoPE table from the model's own ``rotary_emb`` (so every rope scaling
transformers implements is used as is). Anything else runs through
transformers unchanged (``supports``).

The fused and packed weights are derived state: ``refresh`` rebuilds them
after the model's weights change in place (``Engine.weights_changed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning.engine import kv, linear


def supports(model: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``FusedLlama`` computes exactly what ``model`` does, and faster."""
    config = model.config
    return (
        linear.available(device, dtype)
        and getattr(config, "model_type", None) == "llama"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", None) == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
        and hasattr(model, "model")
        and hasattr(model.model, "rotary_emb")
    )


# Up to this many rows, ``_Packed`` multiplies with ``F.linear`` (see there).
SMALL_ROWS = 2


class _Packed:
    """Weights [N_i, K], concatenated and packed once for oneDNN: ``__call__(x
    [.., K]) -> [.., sum N_i]``. One or two rows go through ``F.linear`` on the
    original weights instead: there the product is a matrix-vector read of
    every weight, which MKL's kernel streams faster than oneDNN's packed one
    (1.5x at one row, 1.3x at two; from four rows oneDNN is faster:
    benches/README.md), and the originals are the model's own parameters, so
    that path costs no memory."""

    def __init__(self, parts: Sequence[torch.Tensor], batch_hint: int) -> None:
        self.parts = [w.detach() for w in parts]
        self.out_features = sum(w.shape[0] for w in self.parts)
        whole = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(whole.contiguous(), batch_hint)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= SMALL_ROWS * x.shape[-1]:
            outs = [F.linear(x, w) for w in self.parts]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class _Layer:
    def __init__(self, layer: Any, batch_hint: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in = layer.input_layernorm.weight.detach()
        self.eps_in = float(layer.input_layernorm.variance_epsilon)
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)
        # Rows [q | k | v] and [gate | up]: one matmul each, split by columns after.
        self.qkv = _Packed([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], batch_hint)
        self.q_width = attn.q_proj.weight.shape[0]
        self.kv_width = attn.k_proj.weight.shape[0]
        self.o = _Packed([attn.o_proj.weight], batch_hint)
        self.gate_up = _Packed([mlp.gate_proj.weight, mlp.up_proj.weight], batch_hint)
        self.inner = mlp.gate_proj.weight.shape[0]
        self.down = _Packed([mlp.down_proj.weight], batch_hint)
        self.scaling = float(attn.scaling)


class FusedLlama:
    """The model's forward for the engine: ``decode`` (one token per row of the
    batch's slab) and ``prefill`` (chunks of several prompts in one pass), each
    returning last-position logits as the model would."""

    def __init__(self, model: Any, batch_hint: int) -> None:
        self.model = model
        self.batch_hint = batch_hint
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused, packed weights from the model's current parameters."""
        inner = self.model.model
        with torch.no_grad():
            self.layers = [_Layer(layer, self.batch_hint) for layer in inner.layers]
            self.embed = inner.embed_tokens.weight.detach()
            self.norm = inner.norm.weight.detach()
            self.eps = float(inner.norm.variance_epsilon)
            self.head = _Packed([self.model.lm_head.weight], self.batch_hint)

    def decode(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: kv.SlabCache,
    ) -> torch.Tensor:
        """One decode step of every row of the batch's slab.

        input_ids, position_ids: [B, 1]; attention_mask: [B, 1, 1, T] bool (True =
        attend), T = the slab's length + 1. Returns float32 logits [B, V].
        """
        b = input_ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        groups = heads // kv_heads
        # A -inf bias on every row's padding columns, built once for all layers.
        bias = torch.zeros(attention_mask.shape, dtype=self.embed.dtype)
        bias.masked_fill_(~attention_mask, float("-inf"))  # [B, 1, 1, T]

        def attend(layer: _Layer, slab: kv.SlabLayer, qs, ks, vs) -> torch.Tensor:
            keys, values = slab.update(ks, vs)  # [B, Hkv, T, D]
            # Query head j reads key/value head j // groups (transformers' repeat_kv),
            # so the G query heads of a group are G query rows of one matmul.
            grouped = qs.reshape(b, kv_heads, groups, dim)  # [B, Hkv, G, D]
            scores = torch.matmul(grouped, keys.transpose(2, 3))  # [B, Hkv, G, T]
            scores = scores.mul_(layer.scaling).add_(bias)
            out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, Hkv, G, D]
            return out.reshape(b, 1, heads * dim)

        h = self._layers(input_ids, position_ids, [(0, 1, cache, attend)])
        return self._logits(h[:, -1])

    def prefill(self, chunks: Sequence[tuple[Sequence[int], int, kv.SlabCache]]) -> torch.Tensor:
        """Prefill chunks of several prompts in one forward: each chunk is (its
        token ids, the position of its first token, the one-row cache that holds
        the prompt's keys/values before it). The chunks' rows go through every
        matmul together (a few hundred rows use the machine far better than
        one prompt of a few dozen); attention stays within each chunk's own
        cache. Returns float32 logits of each chunk's last token [len(chunks), V].
        """
        ids = torch.tensor([[t for chunk, _, _ in chunks for t in chunk]])  # [1, N]
        positions = torch.cat(
            [torch.arange(start, start + len(chunk)) for chunk, start, _ in chunks]
        )[None]  # [1, N]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        parts = []
        offset = 0
        for chunk, start, cache in chunks:
            q, end = len(chunk), start + len(chunk)
            # [1, 1, q, end] True = attend: query i (position start + i) sees columns <= it.
            mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).view(
                1, 1, q, end
            )

            def attend(layer: _Layer, slab: kv.SlabLayer, qs, ks, vs, mask=mask, q=q):
                keys, values = slab.update(ks, vs)  # [1, Hkv, end, D]
                out = F.scaled_dot_product_attention(
                    qs,
                    keys,
                    values,
                    attn_mask=mask,
                    scale=layer.scaling,
                    enable_gqa=heads != kv_heads,
                )  # [1, H, q, D]
                return out.transpose(1, 2).reshape(1, q, heads * dim)

            parts.append((offset, q, cache, attend))
            offset += q
        h = self._layers(ids, positions, parts)  # [1, N, E]
        last = torch.tensor([offset + q - 1 for offset, q, _, _ in parts])
        return self._logits(h[0, last])

    def _layers(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, parts: list[tuple[Any, ...]]
    ) -> torch.Tensor:
        """The decoder stack over input_ids [B, N]; ``parts`` split the N positions
        into (offset, length, cache, attend) runs that attend separately."""
        b = input_ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(input_ids, self.embed)  # [B, N, E]
        # The model's own RoPE module: cos/sin [B, N, D] for every rope type it implements.
        cos, sin = self.model.model.rotary_emb(h, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, N, D]
        hidden = (h.shape[-1],)
        for index, layer in enumerate(self.layers):
            x = torch.rms_norm(h, hidden, layer.norm_in, layer.eps_in)
            qkv = layer.qkv(x)  # [B, N, (H + 2 Hkv) D]
            outs = []
            for offset, length, cache, attend in parts:
                rows = qkv[:, offset : offset + length] if len(parts) > 1 else qkv
                c, s = cos[:, :, offset : offset + length], sin[:, :, offset : offset + length]
                qk, vs = rows.split([layer.q_width + layer.kv_width, layer.kv_width], dim=-1)
                # RoPE on the query and key heads together: one set of ops, not two.
                qk = _rope(qk.view(b, length, heads + kv_heads, dim).transpose(1, 2), c, s)
                qs, ks = qk.split([heads, kv_heads], dim=1)  # [B, H, q, D], [B, Hkv, q, D]
                vs = vs.view(b, length, kv_heads, dim).transpose(1, 2)  # [B, Hkv, q, D]
                outs.append(attend(layer, cache.slabs[index], qs, ks, vs))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [B, N, H D]
            h = h + layer.o(attn)
            x = torch.rms_norm(h, hidden, layer.norm_post, layer.eps_post)
            gate, up = layer.gate_up(x).split([layer.inner, layer.inner], dim=-1)
            h = h + layer.down(F.silu(gate).mul_(up))
        return h

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """[R, E] hidden states of the last positions -> float32 logits [R, V]."""
        x = torch.rms_norm(last, (last.shape[-1],), self.norm, self.eps)
        return self.head(x).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
