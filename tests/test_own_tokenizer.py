"""A tokenizer trained here (data/train_tokenizer.py) from text to served model: exact round trips
in any script, fewer tokens than GPT-2's on the language it was trained on, the data prepared and
checked with it, bits per byte, and every consumer of a checkpoint (generate, serve, the HF
export, HellaSwag) reading it from the checkpoint alone."""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import train_tokenizer as tt
from data.dataset import token_bytes
from data.writing import write_dataset
from data.bpe import GPT2Tokenizer
from data.tokenizer import TokenizerError, from_meta

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
# strings a byte-level BPE must give back exactly, whatever it was trained on
MULTILINGUAL = [
    "plain ASCII, with  double spaces\tand tabs\n\n",
    "Ελληνικά: η γρήγορη καφέ αλεπού", "Русский текст: съешь же ещё этих мягких булок",
    "العربية: النص من اليمين إلى اليسار", "हिन्दी: देवनागरी लिपि में पाठ",
    "中文：我能吞下玻璃而不伤身体。日本語：ひらがなとカタカナ", "한국어 텍스트",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵", "e\u0301 (a combining accent) \u200b zero-width",
    "bytes that look broken: \x00\x01\x7f\x80\xff Ã© Ã¼ \ufffd \U0010ffff",
    "<|endoftext|> as text, and <|not special|>", "1234567890 3.14159 0xDEADBEEF",
    "", " ", "\n", "a" * 3000,
]


def train_small(tmp_path: Path, text: str, vocab: int = 600, name: str = "tok", **kw):
    src = tmp_path / f"{name}.txt"
    src.write_text(text, encoding="utf-8")
    tok, info = tt.train([src], vocab, [], "gpt4", name=name, progress=False, **kw)
    return tok, info


@pytest.fixture(scope="module")
def english(tmp_path_factory):
    """A tokenizer trained on tiny Shakespeare's first 90%, saved and loaded back."""
    folder = tmp_path_factory.mktemp("english")
    tok, info = train_small(folder, SHAKESPEARE[:len(SHAKESPEARE) * 9 // 10], 800)
    tt.save(tok, folder / "tok", trained=info)
    return folder / "tok"


@pytest.mark.parametrize("trainer", ["rustbpe", "hf"])
def test_round_trip_of_any_utf8_in_any_script(tmp_path, trainer):
    tok, _ = train_small(tmp_path, SHAKESPEARE[:200_000], 500, trainer=trainer)
    assert tok.vocab_size == 500 and tok.eot_id == 499
    for text in MULTILINGUAL:
        ids = tok.encode_ordinary(text)
        assert tok.decode(ids) == text and tok.decode_bytes(ids) == text.encode()
        assert max(ids, default=0) < tok.eot_id  # a special token's text stays text
    assert tok.encode("x<|endoftext|>") == tok.encode_ordinary("x") + [tok.eot_id]
    rng = random.Random(0)  # random code points from every plane but the surrogates
    for _ in range(50):
        text = "".join(chr(rng.choice([rng.randrange(0x20, 0xD800),
                                       rng.randrange(0xE000, 0x110000)])) for _ in range(40))
        assert tok.decode(tok.encode_ordinary(text)) == text


def test_saved_folder_is_tiktoken_format_and_checked(english, tmp_path):
    import tiktoken.load

    ranks = tiktoken.load.load_tiktoken_bpe(str(english / tt.RANKS_FILE))  # tiktoken's own reader
    tok = tt.load_tokenizer(english)
    assert ranks == {t: i for i, t in enumerate(tok.tokens)} and len(ranks) == 799
    record = json.loads((english / tt.META_FILE).read_text())
    assert record["sha256"] == tok.sha256 and record["special"] == {"<|endoftext|>": 799}
    assert record["trained"]["trainer"] == "rustbpe" and record["trained"]["bytes"] > 900_000
    again = from_meta(json.loads(json.dumps(tok.meta())))  # what a meta.json carries
    assert again.sha256 == tok.sha256 and again.encode("to be") == tok.encode("to be")
    edited = {**tok.meta(), "pattern": tt.PATTERNS["gpt2"]}
    with pytest.raises(TokenizerError, match="fails its hash check"):
        from_meta(edited)
    (tmp_path / "broken").mkdir()
    with pytest.raises(TokenizerError, match="is not a trained tokenizer"):
        tt.load_tokenizer(tmp_path / "broken")


def synthetic_language(seed: int, words: int) -> str:
    """Text in a made-up language written in Cyrillic and Greek: Zipf-distributed words built from
    a fixed set of syllables, in sentences. Its statistics are a language's; GPT-2 never saw it."""
    rng = random.Random(0)
    syllables = [a + b for a in "бвгджзклмнпрстфхцчшщ" for b in "аеиоуыэюяαεηιου"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
               for _ in range(3000)]
    weights = [1 / (rank + 1) for rank in range(len(lexicon))]
    rng = random.Random(seed)
    sentences = []
    for _ in range(words // 8):
        sentence = rng.choices(lexicon, weights, k=rng.randint(4, 12))
        sentences.append(" ".join(sentence).capitalize() + rng.choice([".", ",", "?", "!"]))
    return " ".join(sentences)


def test_own_tokenizer_needs_fewer_tokens_than_gpt2_on_its_language(tmp_path):
    tok, _ = train_small(tmp_path, synthetic_language(1, 60_000), 2048)
    held_out = synthetic_language(2, 8_000)  # other sentences of the same language
    ours, gpt2 = tok.encode_ordinary(held_out), GPT2Tokenizer().encode_ordinary(held_out)
    size = len(held_out.encode())
    assert tok.decode(ours) == held_out
    assert size / len(ours) > 1.5 * size / len(gpt2), (size / len(ours), size / len(gpt2))


def test_training_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert tt.main([str(empty), "--out", str(tmp_path / "t"), "--no_progress"]) == 2
    assert "no text in" in capsys.readouterr().err
    assert tt.main(["--files", str(tmp_path / "missing*.txt"), "--out", "x"]) == 2
    assert "no such file, folder or match" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("some text")
    assert tt.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "t"), "--vocab_size=257",
                    "--special=<|user|>"]) == 2
    assert "smaller than the 256 byte tokens plus 2 special token(s); use at least 258" in \
        capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    assert tt.main([str(bad), "--out", str(tmp_path / "t"), "--no_progress"]) == 2
    assert f"{bad}:2: not a JSON object with a 'text' string" in capsys.readouterr().err
    assert tt.main([str(tmp_path / "a.txt")]) == 2
    assert "--out FOLDER is required" in capsys.readouterr().err


def test_a_folder_skips_binary_files_and_reads_compressed_text(tmp_path, capsys):
    """A documentation folder as Debian ships one: text, gzipped text, images, a Latin-1 file. The
    binary and non-UTF-8 files are skipped and counted; the .gz is read decompressed."""
    import gzip

    docs = tmp_path / "doc"
    (docs / "pkg").mkdir(parents=True)
    (docs / "pkg" / "README").write_text(SHAKESPEARE[:20_000])
    (docs / "pkg" / "changelog.gz").write_bytes(gzip.compress(b"zyzzyva quokka " * 400))
    (docs / "pkg" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(range(256)) * 40)
    (docs / "pkg" / "notes.txt").write_bytes("café naïve ".encode("latin-1") * 100)
    (docs / "pkg" / "broken.gz").write_bytes(b"not gzip at all")
    (docs / "pkg" / "utf16.txt").write_text("text in UTF-16 " * 100, encoding="utf-16")
    assert tt.main([str(docs), "--out", str(tmp_path / "t"), "--vocab_size", "400",
                    "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert (f"note: skipped 4 of 6 files, which are not UTF-8 text: 1 binary ({docs}/pkg/logo.png"
            f"), 2 not UTF-8 ({docs}/pkg/notes.txt, {docs}/pkg/utf16.txt), 1 unreadable "
            f"({docs}/pkg/broken.gz: ") in out
    record = json.loads((tmp_path / "t" / tt.META_FILE).read_text())["trained"]
    assert record["bytes"] == 20_000 + len("zyzzyva quokka " * 400) and record["n_files"] == 2
    assert record["skipped"] == {"binary": 1, "not UTF-8": 2, "unreadable": 1}
    tok = tt.load_tokenizer(tmp_path / "t")
    assert len(tok.encode_ordinary(" zyzzyva quokka")) <= 2  # learnt from the .gz's text
    assert not any("\ufffd".encode() in t for t in tok.tokens)


def test_text_that_is_mostly_replacement_characters_is_refused(tmp_path, capsys):
    """Invalid bytes past the part of a file looked at first, and U+FFFD already in documents,
    both end up as replacement characters in the text the trainer would see."""
    (tmp_path / "a.txt").write_bytes(b"fine text\n" * 7000 + bytes(range(128, 256)) * 800)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "\ufffd" * 500 + " ok"}) + "\n")
    assert tt.main([f"{tmp_path}/a.txt,{tmp_path}/b.jsonl", "--out", str(tmp_path / "t"),
                    "--no_progress"]) == 2
    err = capsys.readouterr().err
    replaced, chars = 128 * 800 + 500, 70_000 + 128 * 800 + 503  # a byte >= 0x80 alone: one each
    assert f"the text read is {replaced / chars:.1%} U+FFFD replacement characters " \
           f"({replaced:,} of {chars:,} characters; most in {tmp_path}/a.txt: {128 * 800:,})" \
        in err, err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("trainer", ["sentencepiece", "RustBPE"])
def test_an_unknown_trainer_is_refused_with_the_choices(tmp_path, capsys, trainer):
    (tmp_path / "a.txt").write_text("some text " * 50)
    out = tmp_path / "t"
    assert tt.main([str(tmp_path / "a.txt"), "--out", str(out), "--trainer", trainer]) == 2
    assert capsys.readouterr().err == (f"error: invalid options: --trainer={trainer!r}: use "
                                       "rustbpe or hf\n")
    assert not out.exists()


@pytest.mark.parametrize("pattern, says", [
    ("([unclosed", "unterminated character set at position 10"),
    ("(?<word>\\w+", "missing ) at position 11"),
    ("\\p{Klingon}", "unknown property at position")])
def test_a_bad_pattern_is_one_line_naming_it_and_where(tmp_path, capsys, pattern, says):
    (tmp_path / "a.txt").write_text("some text " * 50)
    for trainer in ("rustbpe", "hf"):
        assert tt.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "t"), "--no_progress",
                        "--pattern", pattern, "--trainer", trainer]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --pattern {pattern!r} is not a regex tiktoken can use: ")
        assert says in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("pattern, says", [
    ("\\w+", "leaves text unmatched (here \"\\x00\\x07\\t\\n\\r !#$"),
    ("", "matches empty text (at 'Hello, world')"), ("\\w*|\\W", "matches empty text")])
def test_a_pattern_that_would_lose_text_is_refused(tmp_path, capsys, pattern, says):
    """tiktoken encodes only the text the pattern matches, and cannot step past an empty match:
    such a pattern would drop text from every encoded document (or crash the encoder)."""
    (tmp_path / "a.txt").write_text("some text " * 50)
    assert tt.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "t"), "--no_progress",
                    "--pattern", pattern]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("trainer, pattern, says", [
    ("rustbpe", "(?<=a+)b|\\S+|\\s+", "rustbpe cannot (Invalid regex pattern: "),
    ("hf", "\\p{Script=Greek}+|\\S+|\\s+", "Oniguruma cannot (Oniguruma error: invalid ")])
def test_a_pattern_one_trainer_cannot_compile_names_the_other(tmp_path, capsys, trainer,
                                                              pattern, says):
    (tmp_path / "a.txt").write_text("some text " * 50)
    assert tt.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "t"), "--no_progress",
                    "--pattern", pattern, "--trainer", trainer]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert err.rstrip().endswith("pass --trainer " + ("hf" if trainer == "rustbpe" else "rustbpe"))


def test_bits_per_byte_is_loss_over_ln2_times_tokens_over_bytes(tmp_path):
    """Hand-checked: a char vocabulary whose characters take 1, 2 and 3 bytes."""
    from data.loader import Batches
    from engine.device import Runtime
    from engine.training.step import evaluate
    from model import GPT, ModelConfig

    chars = ["a", "é", "€"]  # 1, 2 and 3 bytes in UTF-8
    ids = np.random.default_rng(0).integers(0, 3, 400)
    from data.tokenizer import CharTokenizer
    meta = write_dataset(tmp_path, CharTokenizer(chars), ids, ids)
    meta["dir"] = str(tmp_path)
    sizes = token_bytes(meta)
    assert sizes.tolist() == [1, 2, 3]
    torch.manual_seed(0)
    model = GPT(ModelConfig(block_size=8, vocab_size=3, n_layer=1, n_head=1, n_embd=8))
    val = Batches(meta, "val", 4, 8, seed=0)
    starts = val.fixed(2, seed=1)
    rt = Runtime(torch.device("cpu"), torch.float32, False, [])
    out = evaluate(model, {"val": val}, {"val": starts}, rt, torch.from_numpy(sizes))
    bits = n_bytes = 0.0
    for s in starts:  # the definition: total bits of the targets over their total bytes
        x, y = val.windows(s)
        logits, _ = model(x, y)
        bits += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item() \
            / math.log(2)
        n_bytes += sizes[y.numpy()].sum()
    assert out["val_bpb"] == pytest.approx(bits / n_bytes, rel=1e-5)
    tokens = 2 * 4 * 8
    assert out["val_bpb"] == pytest.approx(out["val"] / math.log(2) * tokens / n_bytes, rel=1e-6)


def test_bits_per_byte_counts_the_same_bytes_whatever_the_tokenizer(english):
    """Two tokenizers of the same text: their token bytes add up to the text's bytes, so their
    bits per byte measure the same thing."""
    from data.tokenizer import CharTokenizer

    text = SHAKESPEARE[-20_000:] + " naïve — ☃"
    for tok in (CharTokenizer.from_text(text), GPT2Tokenizer(), tt.load_tokenizer(english)):
        ids = tok.encode_ordinary(text)
        sizes = token_bytes({"tokenizer": tok.meta(), "dir": ""})
        assert int(np.asarray(sizes)[ids].sum()) == len(text.encode()), tok.kind
        assert sizes[tok.eot_id] == 0 if hasattr(tok, "eot_id") else True


GPT2_SHAPE = ["--position=learned", "--qk_norm=false", "--attn_scale=0", "--logit_softcap=0",
              "--activation=gelu_tanh", "--unet_skips=false", "--smear=false"]


@pytest.fixture(scope="module")
def own_run(english, tmp_path_factory):
    """Documents in two scripts prepared as shards with the trained tokenizer, and a GPT-2-shaped
    tiny model trained on them: (dataset folder, run folder)."""
    import train
    from config import load_config
    from data.shards import main as prepare_main

    folder = tmp_path_factory.mktemp("own")
    words = SHAKESPEARE.split()
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for i in range(120):
            doc = " ".join(words[i * 50:i * 50 + 40 + i % 30])
            f.write(json.dumps({"text": doc + (" Ελληνικά 東京" if i % 5 == 0 else "")}) + "\n")
    from data.shards import Defaults
    assert prepare_main(Defaults("json", folder / "data"), [
        "--data-files", str(folder / "docs.jsonl"), "--tokenizer", str(english),
        "--shard-tokens", "3000", "--val-tokens", "1500", "--workers", "2", "--no-progress"]) == 0
    cfg, _ = load_config(["--config", "tiny", f"--dataset={folder / 'data'}", "--device=cpu",
                          "--max_iters=4", "--eval_interval=4", "--eval_iters=2",
                          "--block_size=32", f"--out_dir={folder / 'run'}", *GPT2_SHAPE])
    train.train(cfg)
    return folder / "data", folder / "run"


def test_prepared_data_names_the_tokenizer_and_decodes_to_the_documents(english, own_run):
    from data.dataset import Tokens, load_meta

    meta = load_meta(str(own_run[0]))
    tok = tt.load_tokenizer(english)
    assert meta["tokenizer"]["sha256"] == tok.sha256 and meta["tokenizer"]["name"] == "tok"
    assert meta["vocab_size"] == 800 and meta["settings"]["tokenizer"].endswith(tok.sha256)
    ids = np.concatenate([Tokens(meta, s, 8).files[0] for s in ("val", "train")])
    docs = [json.loads(line)["text"] for line in
            (own_run[0].parent / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    assert tok.decode(ids.tolist()).split("<|endoftext|>")[:3] == docs[:3]


def test_a_run_on_it_logs_bpb_and_its_checkpoint_carries_the_tokenizer(english, own_run):
    from engine import checkpoint

    ckpt = checkpoint.latest_checkpoint(own_run[1])
    meta = checkpoint.read_meta(ckpt)
    assert meta["tokenizer"]["sha256"] == tt.load_tokenizer(english).sha256
    evals = [json.loads(line) for line in (own_run[1] / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert evals and all(0 < r["val_bpb"] < r["val"] / math.log(2) for r in evals)  # > 1 B/token
    assert "val_bpb" in (own_run[1] / "metrics.csv").read_text().splitlines()[0]


def test_generate_serve_export_and_hellaswag_use_the_checkpoints_tokenizer(own_run, tmp_path,
                                                                           capsys):
    import generate
    from config import Config
    from engine import sources
    from engine.inference.sampling import generate_tokens
    from test_serve import WAIT_S, Server

    model, _, meta, _ = sources.load_source(str(own_run[1]), Config())
    tok = from_meta(meta["tokenizer"])
    prompt = "Ελληνικά: the king"
    idx = torch.tensor([tok.encode(prompt)])
    expected = tok.decode(generate_tokens(model.eval(), idx, 8, 0.0)[0, idx.size(1):].tolist())
    assert generate.main([f"--out_dir={own_run[1]}", "--prompt", prompt, "--max_new_tokens=8",
                          "--temperature=0", "--device=cpu"]) == 0
    assert prompt + expected in capsys.readouterr().out
    import httpx
    server = Server(own_run[1], tmp_path / "serve.log")
    try:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S).json()
    finally:
        server.stop()
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["prompt_tokens"] == len(idx[0])


def test_hf_export_holds_the_trained_tokenizer(own_run, tmp_path):
    import load_gpt2_weights
    from engine import checkpoint
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    assert load_gpt2_weights.main(["--export", str(own_run[1]), "--out", str(out),
                                   "--verify"]) == 0
    theirs = AutoTokenizer.from_pretrained(str(out))
    ours = from_meta(checkpoint.read_meta(checkpoint.latest_checkpoint(own_run[1]))["tokenizer"])
    for text in MULTILINGUAL + [SHAKESPEARE[:5000]]:  # a special token's text is that token
        assert theirs.encode(text) == ours.encode(text), text[:40]
        assert theirs.decode(theirs.encode(text)) == text
    assert theirs.eos_token_id == ours.eot_id
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == ours.eot_id
    assert load_gpt2_weights.main([str(out), "--out", str(tmp_path / "back")]) == 0  # import
    back = checkpoint.read_meta(checkpoint.latest_checkpoint(tmp_path / "back"))["tokenizer"]
    assert back["kind"] == "bpe" and back["sha256"] == ours.sha256  # the same tokenizer again


def test_hellaswag_scores_a_model_with_its_own_tokenizer(own_run, tmp_path, capsys):
    from engine import hellaswag
    from test_hellaswag import EXAMPLES

    data = tmp_path / "hs.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in EXAMPLES))
    assert hellaswag.main(["--model", str(own_run[1]), "--data", str(data), "--device",
                           "cpu"]) == 0
    assert f"| {len(EXAMPLES)} examples" in capsys.readouterr().out


def test_an_edited_tokenizer_names_the_fix_for_where_it_was_found(own_run, tmp_path, capsys):
    """A dataset's edited tokenizer is fixed by preparing the data again; a checkpoint's is not
    (its weights were trained on the ids of the recorded one): restore its meta.json."""
    import shutil

    import generate
    from config import ConfigError, load_config
    from data.dataset import load_meta
    from engine import checkpoint
    from engine.training.finetune import instruction_data

    run = shutil.copytree(own_run[1], tmp_path / "run")
    ckpt = checkpoint.latest_checkpoint(run)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["tokenizer"]["pattern"] = tt.PATTERNS["gpt2"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert generate.main([f"--out_dir={run}", "--prompt", "the", "--max_new_tokens=2",
                          "--device=cpu"]) == 2
    err = capsys.readouterr().err
    fix = (f"{ckpt}/meta.json was changed after the checkpoint was saved: restore it from a copy "
           "of the checkpoint, or copy its 'tokenizer' entry back from the meta.json the run took "
           "it from (its prepared dataset's, or for a finetune its base checkpoint's)")
    assert "fails its hash check" in err and err.rstrip().endswith(fix), err
    assert "prepare the data again" not in err
    cfg, _ = load_config(["--config", "tiny", f"--init_from={ckpt}", "--dataset=x.jsonl"])
    with pytest.raises(ConfigError, match="fails its hash check .*" + re.escape(fix)):
        instruction_data(cfg)
    data = load_meta(str(own_run[0]))
    data["tokenizer"]["pattern"] = tt.PATTERNS["gpt2"]
    with pytest.raises(TokenizerError, match="fails its hash check .*prepare the data again"):
        from_meta(data["tokenizer"])


def test_data_from_another_tokenizer_is_refused(own_run, tmp_path, capsys):
    """Resuming or finetuning the run on data made with another trained tokenizer: one line."""
    import train

    other, _ = train_small(tmp_path, SHAKESPEARE[:300_000], 800, name="other")
    from data.shakespeare.prepare import prepare
    prepare(tmp_path / "other_data", tokenizer=str(tt.save(other, tmp_path / "other")))
    code = train.main(["--config", "tiny", f"--dataset={tmp_path / 'other_data'}",
                       f"--init_from={own_run[1]}", f"--out_dir={tmp_path / 'ft'}",
                       "--max_iters=1", "--block_size=32", "--device=cpu", *GPT2_SHAPE])
    err = capsys.readouterr().err
    assert code != 0 and "use different trained tokenizers ('other' sha256" in err, err
    assert "prepare the data with the checkpoint's tokenizer (--tokenizer FOLDER)" in err


def test_to_loss_can_take_a_bits_per_byte_target(tmp_path):
    """bench.py to-loss --metric bpb reads our eval line's bpb; nanoGPT's char-level line (a
    byte a token) as loss / ln 2. A stand-in train.py prints the lines."""
    from engine.benchmarks.to_loss import follow

    (tmp_path / "train.py").write_text(
        'print("eval    10 | train 2.0 | val 1.9 | val ppl 6.69 | val bpb 1.2500")\n'
        'print("step 20: train loss 0.8, val loss 0.6931")\n'
        'print("eval    30 | train 1.5 | val 1.4 | val ppl 4.06 | val bpb 0.9000")\n')
    run = follow(tmp_path, [], target=1.0, metric="bpb")
    assert [point[:2] for point in run["curve"]] == [[10, 1.25], [20, pytest.approx(0.99993,
                                                                                   abs=1e-5)]]
    assert run["reached"][0] == 20 and run["status"] == "ok"
    assert follow(tmp_path, [], target=1.0)["reached"][:2] == [20, 0.6931]  # --metric loss


def test_extra_special_tokens_follow_endoftext(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(SHAKESPEARE[:50_000])
    tok, _ = tt.train([src], 400, ["<|user|>", "<|endoftext|>", "<|assistant|>"], "gpt2",
                      progress=False)
    assert tok.special == ["<|endoftext|>", "<|user|>", "<|assistant|>"]
    assert tok.vocab_size == 400 and len(tok.tokens) == 397 and tok.eot_id == 397
    assert tok.encode("<|user|>hi<|assistant|>") == [398, *tok.encode_ordinary("hi"), 399]
    assert tok.pattern == tt.PATTERNS["gpt2"] and 398 not in tok.encode_ordinary("<|user|>")
    sizes = token_bytes({"tokenizer": tok.meta()})
    assert sizes[397:].tolist() == [0, 0, 0] and sizes[:256].tolist() == [1] * 256


def test_single_file_preparation_takes_the_tokenizer(english, tmp_path, capsys):
    from data.shakespeare import prepare as single

    book = tmp_path / "book.txt"
    book.write_text("Ελληνικά και English. " * 200, encoding="utf-8")
    assert single.main(["--source", str(book), "--tokenizer", str(english),
                        "--out_dir", str(tmp_path / "book")]) == 0
    meta = json.loads((tmp_path / "book" / "meta.json").read_text())
    assert meta["tokenizer"]["sha256"] == tt.load_tokenizer(english).sha256
    ids = np.fromfile(tmp_path / "book" / "train.bin", dtype=np.uint16).tolist()
    assert from_meta(meta["tokenizer"]).decode(ids) == book.read_text()[:len(book.read_text())
                                                                         * 9 // 10]
    assert single.main(["--source", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("  \n")
    assert single.main(["--source", str(tmp_path / "blank.txt"), "--out_dir",
                        str(tmp_path / "blank")]) == 2
    assert "has no text to tokenize" in capsys.readouterr().err
