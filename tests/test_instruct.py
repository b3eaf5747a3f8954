"""Instruction data (data/instruct.py, data/chat_template.py, engine/training/finetune.py): the
loss counts the responses only (against a written-out reference), an example never shares a row,
bad files get one line naming the place, over-long examples are cut, dropped or refused, the
template and the grown vocabulary travel with the checkpoint, and a run resumes bit for bit."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from config import ConfigError, ModelConfig, load_config
from data.chat_template import ChatTemplate, TemplateError, from_meta
from data.dataset import DataError
from data.instruct import IGNORE, InstructBatches, InstructionData, read_records, to_messages
from data.bpe import GPT2Tokenizer
from data.tokenizer import CharTokenizer
from engine import checkpoint, saving
from engine.loading import load_model
from model import GPT

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?\n"))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reverse_records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefgh"), size=rng.integers(3, 6))) for _ in range(n)]
    return [{"instruction": f"Reverse: {w}", "output": w[::-1]} for w in words]


@pytest.fixture
def tok():
    return CharTokenizer(CHARS, eot=True)


def test_template_counts_the_replies_and_their_end(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ok"}]
    template = ChatTemplate()
    ids, counted = template.render(tok, messages)
    assert tok.decode(ids) == ("System: Be brief.\nUser: Hi\nAssistant: Hello<|endoftext|>\n"
                               "User: Bye\nAssistant: Ok<|endoftext|>\n")
    assert tok.decode([i for i, c in zip(ids, counted) if c]) == \
        "Hello<|endoftext|>Ok<|endoftext|>"
    assert all(template.render(tok, messages, every_token=True)[1])
    prompt = template.prompt(tok, messages[:2])
    assert tok.decode(prompt) == "System: Be brief.\nUser: Hi\nAssistant: "
    assert from_meta(json.loads(json.dumps(template.meta()))) == template
    with pytest.raises(TemplateError, match="unknown role 'bot'"):
        template.render(tok, [{"role": "bot", "content": "x"}])
    with pytest.raises(TemplateError, match="ends with an assistant message"):
        template.prompt(tok, messages)


def test_gpt2_template_uses_gpt2s_own_end_of_text():
    tok = GPT2Tokenizer()
    ids, counted = ChatTemplate().render(tok, [{"role": "user", "content": "<|endoftext|>"},
                                              {"role": "assistant", "content": "ok"}])
    assert ids.count(50256) == 1 and counted[ids.index(50256)]  # the user's text stays text
    assert tok.with_eot() is tok
    assert CharTokenizer(CHARS).with_eot().vocab_size == len(CHARS) + 1


def test_masked_loss_equals_a_written_out_reference(tok, tmp_path):
    records = reverse_records(12)
    path = write_jsonl(tmp_path / "d.jsonl", records)
    data = InstructionData.read(str(path), tok, ChatTemplate(), block_size=64, val_fraction=0.2)
    meta = data.meta(tok, ChatTemplate())
    batches = InstructBatches(meta, "train", batch_size=4, block_size=64, seed=0)
    picked = batches.draw()
    x, y = batches.windows(picked)
    torch.manual_seed(0)
    model = GPT(tiny_cfg(tok.vocab_size))
    _, loss = model(x, y)
    # the reference: each example's reply found by encoding its parts apart, scored by hand
    logits = model(x)[0].float()
    total, count = 0.0, 0
    for row, i in enumerate(picked):
        example = data.splits["train"][i]
        text = tok.decode(example.ids.tolist())
        reply = text.split("Assistant: ")[1].split("<|endoftext|>")[0]
        start = len(tok.encode("User: ")) + len(text.split("\n")[0]) - len("User: ") + 1 \
            + len(tok.encode("Assistant: "))
        targets = tok.encode(reply) + [tok.eot_id]
        assert example.ids[start:start + len(targets)].tolist() == targets
        for k, target in enumerate(targets):  # token start+k is predicted at start+k-1
            total -= F.log_softmax(logits[row, start + k - 1], -1)[target].item()
            count += 1
    assert int((y != IGNORE).sum()) == count
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def tiny_cfg(vocab_size: int):
    from conftest import tiny_model_config
    return tiny_model_config(vocab_size=vocab_size, block_size=64)


def test_rows_hold_one_example_each_padded_and_never_mixed(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", reverse_records(30))
    data = InstructionData.read(str(path), tok, ChatTemplate(), block_size=64)
    batches = InstructBatches(data.meta(tok, ChatTemplate()), "train", 8, 64, seed=1)
    seen = []
    for _ in range(10):  # past an epoch: every example once before any twice
        picked = batches.draw()
        x, y = batches.windows(picked)
        assert x.shape[1] % 16 == 0 and x.shape == y.shape
        for row, i in enumerate(picked):
            e = data.splits["train"][i]
            n = len(e.targets)
            assert x[row, :n].tolist() == e.ids[:-1].tolist()
            assert (y[row, n:] == IGNORE).all() and tok.decode(x[row, :n].tolist()).count(
                "User:") == 1
        seen += picked.tolist()
    n_train = len(data.splits["train"])
    assert sorted(seen[:n_train]) == list(range(n_train))


def test_loader_position_resumes_exactly(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", reverse_records(30))
    data = InstructionData.read(str(path), tok, ChatTemplate(), block_size=64)
    meta = data.meta(tok, ChatTemplate())
    a = InstructBatches(meta, "train", 8, 64, seed=3)
    for _ in range(5):
        a.next()
    b = InstructBatches(meta, "train", 8, 64, seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(6):
        assert all(torch.equal(p, q) for p, q in zip(a.next(), b.next()))


@pytest.mark.parametrize("content, suffix, message", [
    ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n', ".jsonl",
     r"d.jsonl:2: not valid JSON"),
    ("  \n", ".jsonl", "is empty: it holds no examples"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', ".jsonl",
     r"d.jsonl:1: messages\[0\] has the unknown role 'robot'"),
    ('{"instruction": "a"}\n', ".jsonl", r"d.jsonl:1: has 'instruction' but no \"output\""),
    ('{"messages": [{"role": "user", "content": "x"}]}\n', ".jsonl", "no assistant message"),
    ('{"a": 1}', ".json", "holds a JSON dict, not a list of examples"),
    ('[{"text": "x"}]', ".json", r"d.json example 0: an example needs \"messages\""),
])
def test_bad_files_get_one_line_naming_the_place(tok, tmp_path, content, suffix, message):
    path = tmp_path / f"d{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        InstructionData.read(str(path), tok, ChatTemplate(), block_size=64)


def test_alpaca_input_and_system_become_the_conversation():
    messages = to_messages({"instruction": "Translate", "input": "chat", "output": "cat",
                            "system": "Be exact."}, "x")
    assert messages == [{"role": "system", "content": "Be exact."},
                        {"role": "user", "content": "Translate\n\nchat"},
                        {"role": "assistant", "content": "cat"}]


def test_over_long_examples_are_cut_dropped_or_refused(tok, tmp_path):
    records = reverse_records(9) + [{"instruction": "Reverse: " + "ab" * 10, "output": "ba" * 10},
                                    {"instruction": "x" * 80, "output": "y"}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(DataError, match=r"2 of 11 training examples are longer than the context "
                                        r"\(block_size \+ 1 = 49 tokens; the longest 101, first "
                                        r".*d.jsonl:10\); pass --overlength=truncate"):
        InstructionData.read(str(path), tok, ChatTemplate(), 48, overlength="error")
    dropped = InstructionData.read(str(path), tok, ChatTemplate(), 48, overlength="drop")
    assert sum(map(len, dropped.splits.values())) == 9 and "dropped" in dropped.notes[0]
    cut = InstructionData.read(str(path), tok, ChatTemplate(), 48, overlength="truncate")
    assert sum(map(len, cut.splits.values())) == 10  # the one whose prompt fills it is dropped
    assert "1 of them dropped: no response token within the context" in cut.notes[0]
    assert max(len(e.ids) for s in cut.splits.values() for e in s) == 49


def test_a_file_that_is_not_utf8_is_reported_by_line_and_byte(tmp_path):
    """A Latin-1 word on the third line: the error names that line, not only a byte offset."""
    path = tmp_path / "d.jsonl"
    lines = ['{"instruction": "a", "output": "b"}', '{"instruction": "c", "output": "d"}',
             '{"instruction": "Reverse: caf\xe9", "output": "\xe9fac"}']
    path.write_bytes("\n".join(lines).encode("latin-1"))
    offset = len(lines[0]) + len(lines[1]) + 2 + lines[2].index("\xe9")
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(e.value) == (f"{path}:3: not UTF-8 text (byte 0xe9, byte "
                            f"{lines[2].index(chr(0xe9)) + 1} of line 3; offset {offset} in the "
                            "file); save it as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8)")


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """U+2028 and U+0085 may stand unescaped in a JSON string; they do not end a line."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "one\u2028two", "output": "x\u0085y"}\n{"a": 1}\n',
                    encoding="utf-8")
    assert [(w.rsplit(":", 1)[1], r) for w, r in read_records(path)] == [
        ("1", {"instruction": "one\u2028two", "output": "x\u0085y"}), ("2", {"a": 1})]


def test_read_records_numbers_jsonl_lines_skipping_blank_ones(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{"b": 2}\n')
    assert [w.rsplit(":", 1)[1] for w, _ in read_records(path)] == ["1", "3"]


@pytest.fixture(scope="module")
def base_run(char_dataset, tmp_path_factory):
    """A tiny character model trained a few steps: the model finetunes start from."""
    out = tmp_path_factory.mktemp("base")
    cfg, _ = load_config(["--config", "tiny", f"--dataset={char_dataset}", f"--out_dir={out}",
                          "--device=cpu", "--max_iters=20", "--eval_interval=20",
                          "--block_size=32"])
    train.train(cfg)
    return out


def finetune_cfg(base, tmp_path, out, *extra):
    words = "abcdefgh"  # letters the Shakespeare alphabet has
    rng = np.random.default_rng(0)
    records = [{"instruction": f"Reverse: {w}", "output": w[::-1]}
               for w in ("".join(rng.choice(list(words), size=4)) for _ in range(40))]
    data = write_jsonl(tmp_path / "task.jsonl", records)
    cfg, _ = load_config(["--config", "tiny", f"--dataset={data}", f"--init_from={base}",
                          f"--out_dir={out}", "--device=cpu", "--block_size=32",
                          "--batch_size=4", "--max_iters=8", "--eval_interval=4",
                          "--eval_iters=2", "--dropout=0.1", *extra])
    return cfg


def test_finetune_keeps_template_and_grown_vocab_and_resumes_bit_for_bit(base_run, tmp_path):
    whole = train.train(finetune_cfg(base_run, tmp_path, tmp_path / "whole"))
    ckpt = checkpoint.latest_checkpoint(tmp_path / "whole")
    model, cfg, meta = load_model(ckpt)
    assert from_meta(meta["template"]) == ChatTemplate()
    assert meta["tokenizer"]["eot"] and model.vocab_size == len(meta["tokenizer"]["chars"]) + 1
    split = tmp_path / "split"
    train.train(finetune_cfg(base_run, tmp_path, split, "--stop_after_iters=3"))
    resumed = train.train(finetune_cfg(base_run, tmp_path, split, "--init_from=resume"))
    assert resumed["final"] == whole["final"]
    a = load_model(ckpt)[0].state_dict()
    b = load_model(checkpoint.latest_checkpoint(split))[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_instruction_data_needs_a_model_to_start_from(tmp_path):
    data = write_jsonl(tmp_path / "task.jsonl", reverse_records(4))
    cfg, _ = load_config(["--config", "tiny", f"--dataset={data}", f"--out_dir={tmp_path}/o",
                          "--device=cpu"])
    with pytest.raises(ConfigError, match="instruction data finetunes a trained model"):
        train.train(cfg)


def test_masked_loss_counts_only_replies_in_training(base_run, tmp_path):
    """The same run with --loss_on=all counts more targets: its first loss differs."""
    masked = finetune_cfg(base_run, tmp_path, tmp_path / "m", "--max_iters=0")
    every = finetune_cfg(base_run, tmp_path, tmp_path / "a", "--max_iters=0", "--loss_on=all")
    assert train.train(masked)["final"] != train.train(every)["final"]


def test_head_at_counted_positions_gives_the_full_heads_loss_and_gradients(tok, tmp_path):
    from engine.training.finetune import head_at_counted_positions

    path = write_jsonl(tmp_path / "d.jsonl", reverse_records(12))
    data = InstructionData.read(str(path), tok, ChatTemplate(), block_size=64)
    x, y = InstructBatches(data.meta(tok, ChatTemplate()), "train", 6, 64, seed=0).next()
    torch.manual_seed(0)
    full = GPT(tiny_cfg(tok.vocab_size))
    counted = GPT(tiny_cfg(tok.vocab_size))
    counted.load_state_dict(full.state_dict())
    head_at_counted_positions(counted)
    losses = []
    for model in (full, counted):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
    for (name, a), b in zip(full.named_parameters(), counted.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_gpt2_tokens_need_no_new_row_and_lora_trains_on_them(tmp_path):
    """A GPT-2-vocabulary model: <|endoftext|> is its own, the vocabulary stays 50257, and a
    LoRA finetune on conversations runs and samples through the template."""
    import generate
    from config import Config
    from conftest import tiny_model_config

    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=50257, block_size=64, vocab_pad_multiple=64)
    torch.manual_seed(0)
    base = saving.save(tmp_path / "base", 1, GPT(cfg.model), cfg, {"tokenizer": {"kind": "gpt2"}})
    chat = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"Say {w}"},
                          {"role": "assistant", "content": w}]}
            for w in ("yes", "no", "maybe", "never", "always", "often")]
    data = write_jsonl(tmp_path / "chat.jsonl", chat)
    run, _ = load_config(["--config", "tiny", f"--dataset={data}", f"--init_from={base}",
                          f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--block_size=64",
                          "--batch_size=2", "--max_iters=2", "--eval_interval=2",
                          "--eval_iters=1", "--lora.rank=2", "--val_fraction=0.3"])
    train.train(run)
    ckpt = checkpoint.latest_checkpoint(tmp_path / "run")
    model, _, meta = load_model(base)
    assert model.vocab_size == 50257 and meta["tokenizer"] == {"kind": "gpt2"}
    assert json.loads((ckpt / "meta.json").read_text())["template"] == ChatTemplate().meta()
    assert generate.main(["--checkpoint", str(ckpt), "--chat", "--prompt", "Say yes",
                          "--max_new_tokens=3", "--device=cpu"]) == 0


def test_mean_row_length_follows_the_padding_of_the_batches(tok, tmp_path):
    """Rows are padded to their batch's longest example, rounded up to 16: the time estimate
    counts that length, not block_size."""
    path = write_jsonl(tmp_path / "d.jsonl", reverse_records(40))
    data = InstructionData.read(str(path), tok, ChatTemplate(), block_size=128,
                                val_fraction=0.1)
    batches = InstructBatches(data.meta(tok, ChatTemplate()), "train", 8, 128, seed=0)
    drawn = [batches.next()[0].size(1) for _ in range(40)]
    estimate = data.mean_row_length(8, 128)
    assert 16 < estimate < 128 and min(drawn) <= estimate <= max(drawn)
    assert data.mean_row_length(8, 16) == 16  # never past block_size


def test_the_estimate_counts_padded_rows_and_says_when_the_machine_is_busy(
        base_run, tmp_path, monkeypatch, capsys):
    from engine.training import finetune

    monkeypatch.setattr(finetune, "cpus_busy_elsewhere", lambda: float(os.cpu_count()))
    train.train(finetune_cfg(base_run, tmp_path, tmp_path / "busy", "--max_iters=0"))
    out = capsys.readouterr().out
    assert f"note: the machine is busy: other processes kept {os.cpu_count():.1f} of its " in out
    assert "the time estimate below assumes it has them and may be several times short" in out
    assert "rows are padded" not in out  # every row fills block_size 32 here
    monkeypatch.setattr(finetune, "cpus_busy_elsewhere", lambda: 0.0)
    train.train(finetune_cfg(base_run, tmp_path, tmp_path / "idle", "--max_iters=0"))
    assert "the machine is busy" not in capsys.readouterr().out


def test_estimate_line_counts_the_rows_the_data_gives():
    from config import Config
    from engine import device
    from engine.training.metrics import estimate_line

    cfg = Config()
    cfg.model = ModelConfig(n_layer=2, n_head=4, n_embd=256, block_size=128, vocab_size=66)
    cfg.train.batch_size = 32
    rt = device.Runtime(device=torch.device("cpu"), dtype=torch.float32, tf32=False, notes=[])
    model = GPT(cfg.model)

    def gflop(meta: dict) -> float:
        line = estimate_line(cfg, model, rt, 1, meta)
        return float(line.split(" GFLOP per step")[0].rsplit("(", 1)[1])

    assert gflop({"row_tokens": 64}) == pytest.approx(gflop({}) / 2, rel=0.05)


def test_cpus_busy_elsewhere_sees_another_busy_process():
    import subprocess
    import sys

    from engine.training.finetune import cpus_busy_elsewhere

    if not Path("/proc/stat").is_file():
        assert cpus_busy_elsewhere() is None
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = cpus_busy_elsewhere(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.4
