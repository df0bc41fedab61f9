"""The EAGLE-style draft head (PyTorch side: training and reference forward).

Notation (as in :mod:`export.draft.data`): h_j is the target's normalised last hidden state at
position j, e(x) the target's (frozen) token embedding, W the target's LM head restricted to the
reduced vocabulary (frozen). The head is one decoder layer:

    z_j   = fc([e(x_{j+1}), h_j])                       # [H]   from [2H]
    u_j   = DecoderLayer(z_<=j)                          # causal attention over the head's cache
    g_j   = RMSNorm(u_j)                                 # prediction of h_{j+1}
    q_j   = softmax(g_j W^T)                             # draft distribution of x_{j+2}, [V']

Drafting continues from its own prediction: the next step's input is [e(d), g_j] where d is the
token drafted from q_j. Training unrolls ``depth`` such steps with the attention mask the
inference cache produces (true-feature keys for committed positions, predicted-feature keys for
the drafted ones), so depth 2 and 3 are trained on the inputs they will see (HASS / EAGLE-3).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HeadConfig", "EagleHead"]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    draft_vocab: int  # V', the reduced output vocabulary

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float, weight: torch.Tensor | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(weight.clone() if weight is not None else torch.ones(n))

    def forward(self, x: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """HF non-interleaved rotary: x [B, n, T, d], cos/sin [T, d/2]."""
    d = x.shape[-1] // 2
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # [T, d]
    x1, x2 = x[..., :d], x[..., d:]
    return x * c + torch.cat([-x2, x1], -1) * s


class EagleHead(nn.Module):
    """Trainable: fc, one decoder layer, the output norm. Frozen buffers: ``embed`` [V, H],
    ``lm_head`` [V', H] (rows of the target's head for the reduced vocabulary), ``cos``/``sin``
    [P, d/2] (the target's rotary tables)."""

    embed: Any
    lm_head: Any
    cos: Any
    sin: Any

    def __init__(
        self,
        cfg: HeadConfig,
        embed: Any,
        lm_head: Any,
        cos: Any,
        *,
        sin: Any,
        norm_weight: Any = None,
        init_layer: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.cfg = c = cfg
        H, nh, kv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.ln1 = RMSNorm(H, c.rms_eps)
        self.q = nn.Linear(H, nh * d, bias=False)
        self.k = nn.Linear(H, kv * d, bias=False)
        self.v = nn.Linear(H, kv * d, bias=False)
        self.o = nn.Linear(nh * d, H, bias=False)
        self.ln2 = RMSNorm(H, c.rms_eps)
        self.gate = nn.Linear(H, c.intermediate_size, bias=False)
        self.up = nn.Linear(H, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, H, bias=False)
        self.norm = RMSNorm(H, c.rms_eps, norm_weight)
        with torch.no_grad():  # fc starts as "take the feature": the head begins near identity
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H) * 0.5
            self.fc.weight[:, :H] = torch.eye(H) * 0.5
        if init_layer is not None:  # a target layer's weights (nn.Linear layout) as the start
            for name, w in init_layer.items():
                getattr(self, name).weight.data.copy_(w)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    # ---- pieces shared by training and the reference forward -------------------------------
    def _qkv(self, z: Any, pos: Any) -> tuple[Any, Any, Any]:
        """z [B, T, H], pos [T] -> q [B, nh, T, d], k/v [B, kv, T, d] (rotary applied)."""
        c, (B, T, _) = self.cfg, z.shape
        x = self.ln1(z)
        q = self.q(x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[pos], self.sin[pos]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _finish(self, z: Any, attn: Any) -> Any:
        """Residual + MLP + output norm: z [B, T, H], attn [B, nh, T, d] -> g [B, T, H]."""
        B, T, _ = z.shape
        u = z + self.o(attn.transpose(1, 2).reshape(B, T, -1))
        x = self.ln2(u)
        u = u + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.norm(u)

    def logits(self, g: Any) -> Any:
        """g [..., H] -> logits over the reduced vocabulary [..., V']."""
        return g @ self.lm_head.T

    def unrolled(self, tokens: Any, feats: Any, depth: int) -> list[Any]:
        """Training forward. tokens [B, T] (x_0..x_{T-1}), feats [B, T-1, H] (h_0..h_{T-2}).

        Returns ``depth`` tensors g^(s) [B, T-1, H]: g^(s)[:, j] predicts h_{j+1} at draft depth
        s, i.e. when the inputs at positions j-s+2..j were the head's own predictions. Positions
        j < s-1 have no such history (callers mask them).
        """
        c = self.cfg
        B, T1, H = feats.shape
        pos = torch.arange(T1, device=feats.device)
        emb = self.embed[tokens[:, 1:]]  # [B, T-1, H]: e(x_{j+1}) at position j
        rep = c.num_heads // c.num_kv_heads
        ks: list[Any] = []
        vs: list[Any] = []
        outs: list[Any] = []
        f = feats
        j = pos[:, None]
        i = pos[None, :]
        for s in range(1, depth + 1):
            z = self.fc(torch.cat([emb, f], -1))  # [B, T-1, H]
            q, k, v = self._qkv(z, pos)
            ks.append(k)
            vs.append(v)
            scores: list[Any] = []
            values: list[Any] = []
            for t in range(1, s + 1):  # keys of depth t
                if t == 1:
                    allowed = i <= j - s + 1  # committed positions: true features
                else:
                    allowed = i == j - (s - t)  # the drafted positions of this chain
                kt = ks[t - 1].repeat_interleave(rep, 1)  # [B, nh, T-1, d]
                sc = q @ kt.transpose(-1, -2) / math.sqrt(c.head_dim)  # [B, nh, T-1, T-1]
                scores.append(sc.masked_fill(~allowed, float("-inf")))
                values.append(vs[t - 1].repeat_interleave(rep, 1))
            w = torch.softmax(torch.cat(scores, -1), -1).nan_to_num(0.0)  # [B, nh, T-1, s(T-1)]
            attn = w @ torch.cat(values, 2)  # [B, nh, T-1, d]
            g = self._finish(z, attn)
            outs.append(g)
            # next depth's input feature at j is this depth's prediction made at j-1
            f = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1)
        return outs

    @torch.no_grad()
    def step(
        self, tokens_next: Any, feats: Any, past: tuple[Any, Any] | None, start: int
    ) -> tuple[Any, tuple[Any, Any]]:
        """Reference incremental forward (what the ONNX graph computes).

        tokens_next [S] (x_{j+1}), feats [S, H] (h_j) for positions start..start+S-1;
        past: (k, v) [kv, start, d] or None. Returns (g [S, H], (k, v))."""
        c = self.cfg
        S = tokens_next.shape[0]
        pos = torch.arange(start, start + S)
        z = self.fc(torch.cat([self.embed[tokens_next], feats], -1))[None]  # [1, S, H]
        q, k, v = self._qkv(z, pos)
        if past is not None:
            k, v = torch.cat([past[0][None], k], 2), torch.cat([past[1][None], v], 2)
        rep = c.num_heads // c.num_kv_heads
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        sc = q @ kk.transpose(-1, -2) / math.sqrt(c.head_dim)  # [1, nh, S, start+S]
        mask = torch.arange(start + S)[None, :] <= pos[:, None]
        w = torch.softmax(sc.masked_fill(~mask, float("-inf")), -1)
        g = self._finish(z, w @ vv)[0]
        return g, (k[0], v[0])
