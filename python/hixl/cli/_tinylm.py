"""A tiny decoder-only transformer in numpy, for the prefill/decode demo.

Deterministic seeded weights, RMS norms, multi-head causal attention, a ReLU MLP and an output
projection; float32 compute with the KV cache kept in float16 in a paged ``KVLayout``
(layers, K/V, blocks, block_tokens, heads, padded head row). Prefill covers the prompt
except its last token; the first decode step runs that last token. This is how a decode
worker can start its first step on layer k as soon as KV layer k has arrived: it needs no
hidden state from the prefill worker, only the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._layout import KVLayout

BLOCK_TOKENS = 16


@dataclass
class Weights:
    emb: np.ndarray
    out: np.ndarray
    layers: list[dict[str, np.ndarray]]


class TinyLM:
    """The model: ``layers`` blocks of ``heads`` x ``head_dim`` attention, vocabulary 512."""

    def __init__(self, layers: int, heads: int, head_dim: int, seed: int = 0, vocab: int = 512):
        self.L, self.H, self.D, self.vocab = layers, heads, head_dim, vocab
        d = heads * head_dim
        rng = np.random.default_rng(seed)

        def w(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.w = Weights(
            emb=w(vocab, d) * np.float32(np.sqrt(vocab)),
            out=w(d, vocab),
            layers=[
                {
                    "q": w(d, d),
                    "k": w(d, d),
                    "v": w(d, d),
                    "o": w(d, d),
                    "up": w(d, 2 * d),
                    "down": w(2 * d, d),
                }
                for _ in range(layers)
            ],
        )

    def layout(self, tokens: int) -> KVLayout:
        blocks = -(-tokens // BLOCK_TOKENS)
        return KVLayout(self.L, self.H, self.D, np.float16, BLOCK_TOKENS, max(1, blocks))

    @staticmethod
    def _norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5))

    def _kv(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self._norm(h)
        p = self.w.layers[layer]
        shape = (h.shape[0], self.H, self.D)
        k = (x @ p["k"]).reshape(shape).astype(np.float16)
        v = (x @ p["v"]).reshape(shape).astype(np.float16)
        return k, v

    def _attend(
        self, layer: int, h: np.ndarray, k: np.ndarray, v: np.ndarray, first_pos: int
    ) -> np.ndarray:
        """h: (T, d) at positions first_pos.. ; k, v: (S, H, D) float16 for positions 0..S-1."""
        p = self.w.layers[layer]
        t = h.shape[0]
        q = (self._norm(h) @ p["q"]).reshape(t, self.H, self.D)
        kf, vf = k.astype(np.float32), v.astype(np.float32)
        scores = q.transpose(1, 0, 2) @ kf.transpose(1, 2, 0) / np.float32(np.sqrt(self.D))
        pos_q = first_pos + np.arange(t)[:, None]
        scores = np.where(np.arange(k.shape[0])[None, :] <= pos_q, scores, np.float32(-1e30))
        scores = scores - scores.max(axis=-1, keepdims=True)
        att = np.exp(scores)
        att /= att.sum(axis=-1, keepdims=True)
        out = (att @ vf.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(t, self.H * self.D)
        h = h + out @ p["o"]
        return h + np.maximum(self._norm(h) @ p["up"], 0) @ p["down"]

    @staticmethod
    def cache_kv(cache: np.ndarray, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of K and V of `layer` for the first `tokens` positions: (tokens, H, D)."""
        _, _, blocks, bt, heads, _ = cache.shape
        flat = cache[layer].reshape(2, blocks * bt, heads, cache.shape[-1])
        return flat[0, :tokens], flat[1, :tokens]

    def prefill(
        self, prompt: np.ndarray, cache: np.ndarray, layer_done: Callable[[int], None] | None = None
    ) -> None:
        """Computes KV of every prompt token but the last into `cache`, layer by layer,
        calling `layer_done(k)` as soon as layer k is stored."""
        toks = prompt[:-1]
        h = self.w.emb[toks]
        n = len(toks)
        for layer in range(self.L):
            k, v = self._kv(layer, h)
            ck, cv = self.cache_kv(cache, layer, n)
            ck[..., : self.D] = k
            cv[..., : self.D] = v
            if layer_done is not None:
                layer_done(layer)
            if layer + 1 < self.L:
                h = self._attend(layer, h, ck[..., : self.D], cv[..., : self.D], 0)

    def decode(
        self,
        prompt: np.ndarray,
        cache: np.ndarray,
        new_tokens: int,
        layer_wait: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Generates `new_tokens` greedily. The first step runs the prompt's last token and
        calls `layer_wait(k)` before it reads KV layer k of `cache`."""
        n = len(prompt) - 1
        own_k: list[list[np.ndarray]] = [[] for _ in range(self.L)]
        own_v: list[list[np.ndarray]] = [[] for _ in range(self.L)]
        token, out = int(prompt[-1]), []
        for step in range(new_tokens):
            h = self.w.emb[[token]]
            pos = n + step
            for layer in range(self.L):
                if step == 0 and layer_wait is not None:
                    layer_wait(layer)
                k, v = self._kv(layer, h)
                own_k[layer].append(k)
                own_v[layer].append(v)
                ck, cv = self.cache_kv(cache, layer, n)
                kk = np.concatenate([ck[..., : self.D], *own_k[layer]])
                vv = np.concatenate([cv[..., : self.D], *own_v[layer]])
                h = self._attend(layer, h, kk, vv, pos)
            logits = self._norm(h) @ self.w.out
            token = int(np.argmax(logits[0]))
            out.append(token)
        return out

    def prompt(self, length: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed + 1).integers(0, self.vocab, length)

    def reference(self, prompt: np.ndarray, new_tokens: int) -> list[int]:
        """The single-process run: prefill and decode on one cache, no transfer."""
        cache = self.layout(len(prompt) - 1).array()
        self.prefill(prompt, cache)
        return self.decode(prompt, cache, new_tokens)
