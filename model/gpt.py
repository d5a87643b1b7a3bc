"""GPT-2, as in the paper and Hugging Face's `GPT2LMHeadModel`, in one readable file.

Module names follow the GPT-2 checkpoint (`wte`, `c_attn`, `c_proj`, ...) so that importing
Hugging Face weights is a straight copy. Attention goes through
`F.scaled_dot_product_attention`, whose dispatcher picks the kernel (cuDNN's, flash,
memory-efficient or the plain math); +opt=attention chooses it (opt/attention.py).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from base.errors import ConfigError, Unusable

# A fused head + loss: (hidden (N, C), head weight (V, C), targets (N,)) -> the mean loss.
FusedLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The weights Hugging Face's GPT-2 stores as Conv1D, i.e. transposed relative to nn.Linear.
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal attention: (q, k, v, each (B, n_head, T, head_dim); the dropout probability) -> (B,
# n_head, T, head_dim).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float
) -> torch.Tensor:
    """PyTorch's causal scaled-dot-product attention, the kernel left to its dispatcher."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024  # the longest sequence the position embedding covers
    vocab_size: int = 50257  # real tokens; the embedding is padded beyond this for speed
    pad_vocab_to: int = 64  # embedding rows are rounded up to a multiple of this (50257 -> 50304)
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.pad_vocab_to) * self.pad_vocab_to


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # +opt=attention: one SDPA backend, or FlexAttention (opt/attention.py).
        self.attend: Attend = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Thirds and -1, not C: under +opt=tp, c_attn's output holds this rank's heads only
        # (n_head of them, opt/tp.py), and y their width.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    vocab_pad_mask: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # type: ignore[assignment]  # tied
        # The padding rows must never be predicted nor share probability mass: in the loss, a
        # -inf bias on their logits (as the bias of the head's matmul it rides in the GEMM
        # epilogue for free); the logits returned without targets leave those rows out.
        pad_mask = torch.zeros(config.padded_vocab_size)
        pad_mask[config.vocab_size :] = float("-inf")
        self.register_buffer("vocab_pad_mask", pad_mask, persistent=False)
        # +opt=custom_op: one fused operator in place of the logits and the cross-entropy when
        # there are targets (opt/custom_op.py). None: the plain head.
        self.fused_loss: FusedLoss | None = None
        # +opt=amp with opt.amp.residual=compute: the residual stream (the running sum of the
        # blocks' outputs) in the compute dtype instead of the weights' float32. None: as is.
        self.residual_dtype: torch.dtype | None = None
        # +opt=ac: the Linear weights and attention layers whose forward backward runs again
        # (mark_recomputed), for HFU.
        self.recomputed: tuple[int, int] = (0, 0)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) at init.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Without targets: the logits over the real vocabulary (B, T, vocab_size) and no loss.
        With targets: no logits (training and evaluation never read them, and returning them
        would keep the (B, T, vocab) tensor alive through backward) and the mean cross-entropy.
        """
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.head(x, targets)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings: the residual stream's start (B, T, C)."""
        T = idx.shape[1]
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        return x if self.residual_dtype is None else x.to(self.residual_dtype)

    def head(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The final norm and the tied vocabulary projection: logits, or the loss given targets."""
        x = self.transformer.ln_f(x)
        if targets is not None and self.fused_loss is not None:
            return None, self.fused_loss(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        if targets is None:
            # The real vocabulary's rows only: a new tensor, not a view (a slice of the padded
            # logits is one, and FSDP warns about views returned by the modules it wraps).
            return F.linear(x, self.lm_head.weight[: self.config.vocab_size]), None
        logits = F.linear(x, self.lm_head.weight, self.vocab_pad_mask.to(x.dtype))
        # In float32 whatever the compute dtype (autocast would upcast it too).
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return None, loss

    def num_params(self, exclude_positions: bool = True) -> int:
        """Parameters, the tied embedding counted once. The position table is a lookup with no
        matmul, so it is left out by default."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_positions:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Model FLOPs per trained token, MFU's numerator: a forward, and a backward that does
        twice its matmuls (the inputs' gradients and the weights'). That is 6N + 6·L·C·T with N
        the Linear weights: PaLM's appendix B with causal attention counted half."""
        return 3 * self.forward_flops(self.modules(), seq_len)

    def forward_flops(self, modules: Iterable[nn.Module], seq_len: int | None = None) -> float:
        """Forward FLOPs per token of `modules` (a block's, the head's): as `_forward_flops`."""
        return self._forward_flops(self._work(modules), seq_len)

    def recompute_flops_per_token(self, seq_len: int | None = None) -> float:
        """The FLOPs per trained token that backward adds by recomputing (+opt=ac's regions,
        `mark_recomputed`): HFU's, not MFU's."""
        return self._forward_flops(self.recomputed, seq_len)

    def mark_recomputed(self, regions: Sequence[str], reruns_projections: bool) -> None:
        """+opt=ac: backward recomputes a forward of each region (a submodule's name) but its
        output projection (its last Linear) unless `reruns_projections`: backward needs none of
        that matmul's output, and PyTorch's non-reentrant checkpoint stops recomputing once it
        has what backward needs (the reentrant one reruns the whole forward). Counted now, while
        every block is in the model (+opt=pp then keeps only its rank's)."""
        modules: list[nn.Module] = []
        for name in regions:
            region = list(self.get_submodule(name).modules())
            if not reruns_projections:
                region.remove([m for m in region if isinstance(m, nn.Linear)][-1])
            modules += region
        self.recomputed = self._work(modules)

    @staticmethod
    def _work(modules: Iterable[nn.Module]) -> tuple[int, int]:
        """The weights of the Linear layers among `modules` (the tied head once, as a module
        holds it once) and the number of attention layers."""
        modules = list(modules)
        weights = sum(m.weight.numel() for m in modules if isinstance(m, nn.Linear))
        return weights, sum(isinstance(m, CausalSelfAttention) for m in modules)

    def _forward_flops(self, work: tuple[int, int], seq_len: int | None) -> float:
        """Forward FLOPs per token of `work` (`_work`'s): 2 per Linear weight (a multiply and an
        add; the embedding lookups do none), and per attention layer the scores and values, 2·C·T:
        half of the T×T products, as a causal kernel (flash, cuDNN) computes only the lower
        triangle. LayerNorm, GELU, softmax and the bias adds are left out (FLOP counters skip
        them too; well under 1% of the work)."""
        weights, attention = work
        T = seq_len or self.config.block_size
        return 2 * weights + 2 * attention * self.config.n_embd * T

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Samples `max_new_tokens` tokens after the prompt `idx` (B, T)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = float("-inf")
            probs = F.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    @classmethod
    def from_pretrained(cls, name_or_dir: str | Path, **overrides: Any) -> GPT:
        """Loads Hugging Face GPT-2 weights from a hub name (`gpt2`, `gpt2-medium`, ...; needs
        the network) or a local directory written by `save_pretrained`. `overrides` may set
        `dropout`."""
        from transformers import GPT2LMHeadModel, PretrainedConfig

        try:
            model_type = PretrainedConfig.get_config_dict(str(name_or_dir))[0].get("model_type")
            if model_type != "gpt2":
                raise ConfigError(
                    f"model.pretrained={name_or_dir}: its config.json has model_type="
                    f"{model_type!r}, not 'gpt2': this recipe trains GPT-2 only; give a GPT-2 "
                    "folder or hub name (gpt2, gpt2-medium, ...)"
                )
            loaded: Any = GPT2LMHeadModel.from_pretrained(  # with the info: a pair
                str(name_or_dir), output_loading_info=True, ignore_mismatched_sizes=True
            )
            hf, info = loaded
        except pickle.UnpicklingError as e:  # torch.load's weights_only refusal: no code ran
            raise Unusable(
                f"model.pretrained={name_or_dir}: its weights file holds more than tensors "
                f"({_refusal(e)}): refusing to load it; use a folder written by "
                "`save_pretrained` (model.safetensors), from a source you trust"
            ) from None
        except OSError as e:
            raise Unusable(
                f"could not load GPT-2 weights from {name_or_dir!r}: it is neither a directory "
                "written by `save_pretrained` nor a hub model reachable from here (offline?). "
                "Save the model on a machine with network access and pass its directory."
            ) from e
        _check_loading_info(name_or_dir, info)
        hc = hf.config
        config = GPTConfig(
            n_layer=hc.n_layer,
            n_head=hc.n_head,
            n_embd=hc.n_embd,
            block_size=hc.n_positions,
            vocab_size=hc.vocab_size,
            **overrides,
        )
        model = cls(config)
        ours = model.state_dict()
        theirs = hf.state_dict()
        with torch.no_grad():
            for name, param in ours.items():
                if name == "lm_head.weight":
                    continue  # tied to transformer.wte.weight
                src = theirs[name]
                if name.endswith(HF_TRANSPOSED):
                    src = src.t()
                if name == "transformer.wte.weight":
                    param[: src.shape[0]].copy_(src)  # the padding rows stay as initialised
                else:
                    param.copy_(src)
        return model


def _refusal(e: pickle.UnpicklingError) -> str:
    """What torch.load(weights_only=True) refused, from its several paragraphs of advice."""
    lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
    advice = ("Check the documentation", "Please file an issue")
    return next((line for line in lines if not line.startswith(advice)), "not a torch file")


def _check_loading_info(name_or_dir: str | Path, info: dict) -> None:
    """Refuses Hugging Face weights that do not fit their config.json (transformers would fill
    the gaps with random weights, or drop what does not fit), naming the first keys, or the key
    and both shapes."""
    fix = "fix its config.json, or use the folder exactly as `save_pretrained` wrote it"
    if info["mismatched_keys"]:
        key, saved, expected = sorted(info["mismatched_keys"])[0][:3]
        raise ConfigError(
            f"model.pretrained={name_or_dir}: {key} has shape {tuple(saved)} in the weights but "
            f"{tuple(expected)} by config.json: {fix}"
        )
    for kind, what in (
        ("missing_keys", "lack part of what config.json describes"),
        ("unexpected_keys", "hold more than config.json describes"),
    ):
        keys = sorted(info[kind])
        if keys:
            first = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise ConfigError(
                f"model.pretrained={name_or_dir}: the weights {what} ({kind.replace('_', ' ')}: "
                f"{first}): {fix}"
            )
