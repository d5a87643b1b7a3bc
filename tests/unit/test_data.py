"""The tokenizer, corpus preparation, the loaders and the data order."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

import data
from data.prepare import DOC_SEPARATOR, cache_folder, prepare
from data.preprocess import preprocess
from data.sources import load_documents
from data.tokenizer import EOT, gpt2_encoding, verify_vocab, vocab_dir
from helpers import ROOT, make_cfg, python


def test_tokenizer_is_gpt2() -> None:
    enc = gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256


def test_tokenizer_refuses_a_tampered_vocabulary(tmp_path) -> None:
    shutil.copytree(vocab_dir(), tmp_path / "vocab")
    with open(tmp_path / "vocab" / "vocab.bpe", "a") as f:
        f.write("x y\n")
    with pytest.raises(RuntimeError, match="vocab.bpe has sha256 .* not GPT-2's vocabulary"):
        verify_vocab(tmp_path / "vocab")


@pytest.fixture(scope="module")
def shakespeare():
    cfg = make_cfg().data
    return cfg, prepare(cfg)


def test_preparation_round_trip(shakespeare, tmp_path) -> None:
    """Both splits' tokens decode back to the corpus, and the text files hold the same split."""
    cfg, folder = shakespeare
    enc = gpt2_encoding()
    docs = load_documents(cfg, num_proc=1, scratch=tmp_path)["text"]
    corpus = "".join(doc + DOC_SEPARATOR for doc in docs)
    texts = {s: (folder / f"{s}.txt").read_text(encoding="utf-8") for s in ("train", "val")}
    # The play the cut falls in becomes two documents: one separator more, nothing else.
    assert texts["train"][:-1] + texts["val"] == corpus
    assert len(texts["val"]) / len(corpus) == pytest.approx(0.1, abs=0.01)
    for split, text in texts.items():
        tokens = np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="r")
        decoded = enc.decode(tokens.tolist()).replace("<|endoftext|>", DOC_SEPARATOR)
        assert decoded == text
    meta = json.loads((folder / "meta.json").read_text())
    assert (
        meta["splits"]["train"]["tokens"] > 1_000_000 and meta["splits"]["train"]["documents"] == 35
    )


def test_plays_are_plain_text(shakespeare) -> None:
    _, folder = shakespeare
    head = (folder / "train.txt").read_text(encoding="utf-8")[:5000]
    assert "HIPPOLYTA:\n" in head or ":\n" in head
    assert "**" not in head and "  \n" not in head


def test_a_single_text_file_prepares_and_splits(tmp_path) -> None:
    lines = [
        f"line {i} of a small corpus with enough words to fill some windows" for i in range(800)
    ]
    (tmp_path / "notes.txt").write_text("\n".join(lines))
    cfg = make_cfg("data=text", f"data.files={tmp_path}/*.txt", "data.val_fraction=0.2").data
    folder = prepare(cfg)
    val = (folder / "val.txt").read_text()
    assert val.startswith("line ") and len(val) / (
        len(val) + (folder / "train.txt").stat().st_size
    ) == pytest.approx(0.2, abs=0.01)
    splits = data.load_splits(cfg, block_size=16, seed=0)
    assert splits["train"][0].shape == (17,)


def test_preparing_local_files_writes_nothing_to_the_shared_datasets_cache(
    tmp_path, monkeypatch
) -> None:
    """Local files are read into the preparation's own folder, which goes with it: two
    preparations of one file at once once collided in `datasets`' shared cache (one found its
    temporary file gone)."""
    shared = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", shared)
    (tmp_path / "notes.txt").write_text("\n".join(f"line {i} " + "word " * 12 for i in range(300)))
    folder = prepare(make_cfg("data=text", f"data.files={tmp_path}/*.txt").data)
    assert not shared.exists()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_text_source_needs_files() -> None:
    with pytest.raises(ValueError, match="data=text needs data.files"):
        cache_folder(make_cfg("data=text").data)


def test_hub_source_offline_says_what_to_do() -> None:
    cfg = make_cfg("data=openwebtext", "data.num_proc=1").data  # HF_DATASETS_OFFLINE=1 in tests
    with pytest.raises(
        RuntimeError, match="(?s)Skylion007/openwebtext.*offline mode.*needs network"
    ):
        prepare(cfg)


def test_hub_source_on_a_local_dataset_folder(tmp_path) -> None:
    """The hub code path, run on a folder in the hub's layout (what `load_dataset` also reads)."""
    rows = [{"content": f"document {i}: " + "some words " * 40} for i in range(50)]
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = make_cfg(
        "data=fineweb-edu", f"data.hub.path={tmp_path / 'ds'}", "data.hub.name=null",
        "data.hub.text_field=content", "data.val_fraction=0.1", "data.num_proc=1",
    ).data  # fmt: skip
    folder = prepare(cfg)
    assert json.loads((folder / "meta.json").read_text())["splits"]["train"]["documents"] == 46


def test_corrupt_or_missing_token_files_say_how_to_fix(shakespeare, tmp_path) -> None:
    cfg, folder = shakespeare
    cfg = cfg.copy()
    cfg.cache_dir = str(tmp_path)
    copy = cache_folder(cfg)
    shutil.copytree(folder, copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(RuntimeError, match=f"train.bin is corrupt.*delete {copy}"):
        data.load_splits(cfg, block_size=32, seed=0)
    (copy / "train.bin").unlink()
    with pytest.raises(FileNotFoundError, match="train.bin is missing.*prepared automatically"):
        data.load_splits(cfg, block_size=32, seed=0)


def _batches(dataset, batch_size, steps, *, rank=0, world_size=1, start_sample=0, workers=0):
    options = data.LoaderOptions(num_workers=workers, prefetch_factor=2 if workers else None)
    loader = data.build_loader(
        dataset, batch_size, rank=rank, world_size=world_size, seed=3, options=options,
        start_sample=start_sample, num_steps=steps,
    )  # fmt: skip
    return list(loader)


@pytest.mark.parametrize("loader", ["memmap", "text"])
def test_batches_do_not_depend_on_the_number_of_ranks(shakespeare, loader: str) -> None:
    cfg = shakespeare[0].copy()
    cfg.loader = loader
    train = data.load_splits(cfg, block_size=32, seed=3)["train"]
    single = _batches(train, 8, steps=3)
    ranks = [_batches(train, 4, steps=3, rank=r, world_size=2) for r in range(2)]
    for step in range(3):
        assert torch.equal(torch.cat([ranks[0][step], ranks[1][step]]), single[step])
    assert single[0].shape == (8, 33) and single[0].dtype == torch.int64


def test_resuming_from_a_step_continues_the_same_order(shakespeare) -> None:
    train = data.load_splits(shakespeare[0], block_size=32, seed=3)["train"]
    full = _batches(train, 4, steps=6)
    resumed = _batches(train, 4, steps=3, start_sample=3 * 4)
    assert all(torch.equal(a, b) for a, b in zip(full[3:], resumed, strict=True))


def test_a_resume_with_another_batch_or_rank_count_continues_the_same_stream(shakespeare) -> None:
    """The position is samples consumed: 12 samples read as 3 steps of 4 on one rank continue
    as steps of 2 x 3 on two ranks, then of 8 on one, reading each sample of the stream once."""
    train = data.load_splits(shakespeare[0], block_size=32, seed=3)["train"]
    stream = torch.cat(_batches(train, 4, steps=9))  # 36 samples, one rank
    two = [_batches(train, 3, steps=2, rank=r, world_size=2, start_sample=12) for r in range(2)]
    resumed = [torch.cat([two[0][k], two[1][k]]) for k in range(2)]  # samples 12..23
    resumed += _batches(train, 8, steps=1, start_sample=24)  # samples 24..31
    assert torch.equal(torch.cat(resumed), stream[12:32])


def test_epochs_reshuffle_and_shift_windows() -> None:
    sampler = data.StepSampler(10, 5, seed=1)
    epoch0 = sampler.batch_ids(0) + sampler.batch_ids(1)
    epoch1 = sampler.batch_ids(2) + sampler.batch_ids(3)
    assert sorted(epoch0) == list(range(10)) and sorted(epoch1) == list(range(10, 20))
    assert [i - 10 for i in epoch1] != epoch0


def test_windows_are_consecutive_tokens(shakespeare) -> None:
    cfg, folder = shakespeare
    train = data.load_splits(cfg, block_size=32, seed=3)["train"]
    tokens = np.memmap(folder / "train.bin", dtype=np.uint16, mode="r")
    window = train[5].numpy()
    starts = np.flatnonzero(tokens[: 10 * 32] == window[0])
    assert any(np.array_equal(tokens[s : s + 33], window) for s in starts)


def test_synthetic_tokens_are_seeded_and_in_range() -> None:
    cfg = make_cfg("data=synthetic").data
    splits = data.load_splits(cfg, block_size=16, seed=0)
    a, b = splits["train"][7], splits["train"][7]
    assert torch.equal(a, b) and a.shape == (17,) and a.min() >= 0 and a.max() < 50257
    assert not torch.equal(splits["train"][7], splits["val"][7])


def test_book_style_preprocessing_is_deterministic_per_sample() -> None:
    cfg = make_cfg("data.preprocess.enabled=true", "data.preprocess.word_drop=0.3").data.preprocess
    text = "**HAMLET**  To be, or NOT to be: that is the question. " * 5
    out = preprocess(text, cfg, np.random.default_rng(7))
    assert out == preprocess(text, cfg, np.random.default_rng(7))
    assert out == out.lower() and "*" not in out
    assert 0.4 < len(out.split()) / len(text.split()) < 0.95  # about 30% of words dropped


def test_text_loader_preprocesses_in_the_dataset(shakespeare) -> None:
    cfg = shakespeare[0].copy()
    cfg.loader = "text"
    plain = data.load_splits(cfg, block_size=64, seed=0)["train"][3]
    cfg.preprocess.enabled = True
    cooked = data.load_splits(cfg, block_size=64, seed=0)["train"][3]
    enc = gpt2_encoding()
    assert enc.decode(cooked.tolist()) == enc.decode(cooked.tolist()).lower()
    assert enc.decode(plain.tolist()) != enc.decode(plain.tolist()).lower()


def test_smoke_prepare_script(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("some text to prepare\n" * 500)
    out = subprocess.run(
        [python(), "scripts/prepare_data.py", "data=text", f"data.files={tmp_path}/a.txt"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert (folder / "meta.json").exists() and (folder / "val.bin").stat().st_size > 0


@pytest.mark.parametrize(
    ("split", "advice"), [("train", "lower data.val_fraction"), ("val", "raise data.val_fraction")]
)
def test_a_split_too_short_for_three_windows_says_what_to_change_for_that_split(
    tmp_path, split, advice
) -> None:
    from base.errors import ConfigError

    tokens = tmp_path / f"{split}.bin"
    np.zeros(20, dtype=np.uint16).tofile(tokens)
    text = tmp_path / f"{split}.txt"
    text.write_text("a few words")
    made = (
        lambda: data.TokenWindows(tokens, 8, 0, 20, 50257),
        lambda: data.TextWindows(text, 8, 0, 11, 4.0, make_cfg().data.preprocess),
    )
    for windows in made:
        with pytest.raises(
            ConfigError, match=rf"too few for three windows of 9 tokens: .*{advice}"
        ):
            windows()
