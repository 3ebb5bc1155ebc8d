"""Built-in synthetic tasks and the parallel-text loader (gradscope.train.tasks / .text)."""

from __future__ import annotations

import pytest
import torch

from gradscope.train import BOS, EOS, TASKS, load_parallel_text, make_task
from gradscope.train.text import SPECIALS, Vocab

VOCAB, MAX_LEN, B = 16, 10, 8


def _task(name: str, **kw):
    return make_task(name, vocab=VOCAB, max_len=MAX_LEN, seed=kw.pop("seed", 0), **kw)


def _rows(batch):
    """Per row: (src content, y) for seq2seq batches, checking the BOS/EOS/pad layout on the way."""
    src, tgt_in, tgt_out = batch
    out = []
    for i in range(src.shape[0]):
        s = src[i][src[i] != 0]
        assert torch.all(src[i, len(s):] == 0), "source padding must be trailing"
        n = int((tgt_out[i] != 0).sum()) - 1
        assert tgt_in[i, 0] == BOS and tgt_out[i, n] == EOS
        assert torch.equal(tgt_in[i, 1 : n + 1], tgt_out[i, :n])
        assert torch.all(tgt_in[i, n + 1 :] == 0) and torch.all(tgt_out[i, n + 1 :] == 0)
        out.append((s, tgt_out[i, :n]))
    return out


@pytest.mark.parametrize("name", sorted(TASKS))
def test_batches_are_pure_functions_of_seed_split_step(name):
    task = _task(name)
    a = task.batch("train", 5, B)
    assert all(torch.equal(x, y) for x, y in zip(a, _task(name).batch("train", 5, B)))
    assert all(torch.equal(x, y) for x, y in zip(a, task.batch("train", 5, B)))  # no hidden state
    for other in (task.batch("train", 6, B), task.batch("valid", 5, B), _task(name, seed=1).batch("train", 5, B)):
        assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, other))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_layout_dtypes_and_interface(name):
    task = _task(name)
    batch = task.batch("train", 0, B)
    assert all(t.dtype == torch.long and t.shape[0] == B and t.shape[1] <= MAX_LEN for t in batch)
    assert len(batch) == {"encoder_decoder": 3, "decoder": 2, "encoder": 2}[task.arch]
    assert task.model_inputs(batch) == batch[:-1] and task.targets(batch) is batch[-1]
    assert int(torch.cat([t.flatten() for t in batch]).max()) < VOCAB


def test_reverse_targets_are_reversed_sources_of_varied_length():
    rows = _rows(_task("reverse").batch("train", 3, 64))
    assert all(torch.equal(y, s.flip(0)) for s, y in rows)
    assert all(int(s.min()) >= 3 for s, _ in rows)
    assert len({len(s) for s, _ in rows}) > 3


def test_sort_noisy_drops_noise_and_sorts():
    task = _task("sort_noisy", noise=0.3, n_noise=2)
    noise = set(range(VOCAB - 2, VOCAB))
    rows = _rows(task.batch("train", 0, 64))
    for s, y in rows:
        assert y.tolist() == sorted(t for t in s.tolist() if t not in noise)
    assert sum(len(s) - len(y) for s, y in rows) > 0, "some noise must appear"


def test_markov_lm_follows_chain():
    task = _task("markov_lm", branching=2)
    tokens_in, tokens_out = task.batch("train", 0, 32)
    allowed = {int(task.content_ids[i]): {int(task.content_ids[j]) for j in task.successors[i]}
               for i in range(len(task.content_ids))}
    for i in range(32):
        n = int((tokens_out[i] != 0).sum())
        seq = tokens_out[i, : n - 1].tolist()
        assert tokens_in[i, 0] == BOS and tokens_out[i, n - 1] == EOS
        assert tokens_in[i, 1:n].tolist() == seq
        assert all(b in allowed[a] for a, b in zip(seq, seq[1:]))


def test_markov_mlm_masks_content_only():
    task = make_task("markov_mlm", vocab=VOCAB, max_len=42, mask_prob=0.15, min_len=20)
    masked, labels = task.batch("train", 0, 256)
    assert masked.shape[1] <= 42
    is_masked = labels != 0
    assert torch.all(masked[is_masked] == task.mask_id) and torch.all(masked[~is_masked] != task.mask_id)
    assert torch.all(is_masked.any(-1)), "every row has a label"
    assert not torch.isin(labels[is_masked], torch.tensor([BOS, EOS, task.mask_id])).any()
    content = ((masked != 0) & (masked != BOS) & (masked != EOS)) | is_masked
    assert 0.13 < is_masked.sum() / content.sum() < 0.17
    assert torch.all(masked[:, 0] == BOS)
    short = _task("markov_mlm", min_len=1).batch("train", 1, 256)[1]
    assert torch.all((short != 0).any(-1)), "short rows get a forced mask"


def test_make_task_errors():
    with pytest.raises(ValueError, match="reverse"):
        make_task("nope", vocab=VOCAB, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="min_len"):
        make_task("reverse", vocab=VOCAB, max_len=3, min_len=5)
    with pytest.raises(ValueError, match="split"):
        _task("reverse").batch("dev", 0, 2)
    with pytest.raises(ValueError, match="pad_id"):
        make_task("reverse", vocab=VOCAB, max_len=MAX_LEN, pad_id=1)


# --- parallel text -------------------------------------------------------------------

SRC = ["a b c", "b c", "c a a b", "d", "a a", "b d c", "c c", "d a"]
TGT = ["x y", "y", "z x x", "w w", "x", "y w z", "z", "w x y"]


def _write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    return (_write(tmp_path, "train.src", SRC), _write(tmp_path, "train.tgt", TGT),
            _write(tmp_path, "valid.src", ["a b", "e"]), _write(tmp_path, "valid.tgt", ["x", "q y"]))


def test_parallel_text_round_trip_and_vocab(files):
    task = load_parallel_text(*files[:2], valid_src=files[2], valid_tgt=files[3], max_len=8, seed=0)
    vocab = task.vocab_table
    assert vocab.itos[:4] == SPECIALS and task.vocab == len(vocab) == 4 + 4 + 4  # a-d, w-z
    assert task.arch == "encoder_decoder" and task.pad_id == 0
    seen = set()
    for step in range(2):  # one epoch with batch 4: every pair exactly once
        for s, y in _rows(task.batch("train", step, 4)):
            seen.add((" ".join(vocab.decode(s.tolist())), " ".join(vocab.decode(y.tolist()))))
    assert seen == set(zip(SRC, TGT))
    src, _, tgt_out = task.batch("valid", 0, 2)
    assert vocab.decode(src[1, :1].tolist()) == ["<unk>"]  # "e" never appears in training
    assert vocab.decode(tgt_out[1, :3].tolist()) == ["<unk>", "y", "</s>"]


def test_parallel_text_shuffle_is_seeded(files):
    def order(seed, epoch=0):
        task = load_parallel_text(*files[:2], valid_src=files[2], valid_tgt=files[3], seed=seed)
        return [" ".join(task.vocab_table.decode(task.batch("train", step, 1)[0][0].tolist()))
                for step in range(8 * epoch, 8 * epoch + 8)]

    assert order(0) == order(0) and sorted(order(0)) == sorted(SRC)
    assert order(0) != order(1), "another seed, another order"
    assert order(0, epoch=1) != order(0) and sorted(order(0, epoch=1)) == sorted(SRC), "reshuffled every epoch"


def test_parallel_text_holdout_and_truncation(tmp_path):
    src = _write(tmp_path, "s", [" ".join(["a"] * 20)] + SRC)
    tgt = _write(tmp_path, "t", [" ".join(["x"] * 20)] + TGT)
    task = load_parallel_text(src, tgt, max_len=5, valid_fraction=0.25, seed=3)
    assert len(task.pairs["valid"]) == 2 and len(task.pairs["train"]) == 7
    for split in ("train", "valid"):
        assert all(t.shape[1] <= 5 for t in task.batch(split, 0, 9))


def test_parallel_text_errors(tmp_path, files):
    short = _write(tmp_path, "short.tgt", TGT[:5])
    with pytest.raises(ValueError, match=r"train\.src.*8 lines.*short\.tgt.*5") as err:
        load_parallel_text(files[0], short)
    assert "short.tgt" in str(err.value)
    empty = _write(tmp_path, "empty.src", [])
    with pytest.raises(ValueError, match="empty"):
        load_parallel_text(empty, files[1])
    with pytest.raises(ValueError, match="valid_src and valid_tgt"):
        load_parallel_text(files[0], files[1], valid_src=files[2])


def test_vocab_min_freq_and_order():
    vocab = Vocab.build([["b", "a", "a"], ["c", "a", "b"]], min_freq=2)
    assert vocab.itos == SPECIALS + ("a", "b")
    assert vocab.encode(["b", "c"]) == [5, 3]
