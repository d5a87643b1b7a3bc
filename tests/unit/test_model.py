"""GPT-2 matches Hugging Face's, never predicts the padding tokens, and counts its FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from helpers import make_cfg
from model import GPT, GPTConfig
from train import build_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory):
    """A randomly initialised Hugging Face GPT-2 with GPT-2's vocabulary, saved to disk."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257)
    hf = GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("hf-gpt2")
    hf.save_pretrained(folder)
    return folder, hf


def test_from_pretrained_matches_transformers(hf_dir) -> None:
    folder, hf = hf_dir
    model = GPT.from_pretrained(folder).eval()
    assert model.config.block_size == 128 and model.config.padded_vocab_size == 50304
    idx = torch.randint(0, 50257, (2, 37))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert ours.shape == theirs.shape == (2, 37, 50257)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_from_pretrained_explains_a_missing_model(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="neither a directory written by `save_pretrained`"):
        GPT.from_pretrained(tmp_path / "nowhere")


def test_pretrained_block_size_cannot_exceed_positions(hf_dir) -> None:
    folder, _ = hf_dir
    cfg = make_cfg(f"model.pretrained={folder}", "model.block_size=256")
    with pytest.raises(ValueError, match="exceeds the 128 positions"):
        build_model(cfg.model)


def _small(vocab_size: int = 50) -> GPT:
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=vocab_size))


def test_padding_tokens_are_never_predicted_nor_counted() -> None:
    model = _small(vocab_size=50)  # padded to 64 rows
    assert model.transformer.wte.weight.shape[0] == 64
    with torch.no_grad():  # make the padding rows as attractive as possible
        model.transformer.wte.weight[50:] = 5.0
    idx = torch.randint(0, 50, (3, 8))
    logits, _ = model(idx)
    assert logits.shape == (3, 8, 50)
    no_logits, loss = model(idx, idx)
    assert no_logits is None
    # The loss is the cross-entropy over the real vocabulary only.
    assert loss.item() == pytest.approx(
        F.cross_entropy(logits.reshape(-1, 50), idx.reshape(-1)).item(), rel=1e-6
    )
    out = model.generate(idx[:, :1], max_new_tokens=30, generator=torch.Generator().manual_seed(0))
    assert out.max().item() < 50


def test_tied_embeddings_and_gpt2_init() -> None:
    model = _small()
    assert model.lm_head.weight is model.transformer.wte.weight
    proj = model.transformer.h[0].attn.c_proj.weight
    assert proj.std().item() == pytest.approx(0.02 / 2**0.5, rel=0.3)  # 1/sqrt(2 * n_layer)


def test_flops_per_token_matches_the_book() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig())  # GPT-2 124M
    # 6N + 6*L*C*T, N = 123.57M weights that multiply (the tied head once; no embedding lookup,
    # LayerNorm or bias), causal attention half of PaLM's 12*L*C*T: ~798 MFLOP (PaLM's 855.3).
    assert model.num_params() / 1e6 == pytest.approx(123.69, abs=0.01)
    assert model.flops_per_token(1024) / 1e6 == pytest.approx(798.0, abs=0.1)
