"""bench.py tokenizer end to end on a tiny corpus, a tiny man page tree and a small vocabulary;
and the groff stripping it reads translated man pages with."""
from __future__ import annotations

import gzip
import json
import random

import bench
from engine.benchmarks.tokenizer import man_text

WORDS = ("def", "return", "self", "value", "import", "tokens", "class", "for", "in", "range",
         "yield", "None", "lambda", "print", "merge", "pair", "count", "bytes")
RUSSIAN = ("список", "файлов", "каталог", "вывести", "содержимое", "параметры", "команда",
           "строка", "файл", "время", "размер", "права")


def lines_of(words: tuple[str, ...], seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "\n"
                   for _ in range(n))


def man_tree(root, lang: str, pages: int) -> None:
    folder = root / lang / "man1"
    folder.mkdir(parents=True)
    for i in range(pages):
        source = (f'.\\" a comment\n.TH PAGE{i} 1\n.SH ИМЯ\npage{i} \\- '
                  + lines_of(RUSSIAN, 100 + i, 20) + ".PP\n\\fBвывести\\fP \\-l\n")
        (folder / f"page{i}.1.gz").write_bytes(gzip.compress(source.encode()))


def test_tokenizer_bench_writes_consistent_reports(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"f{i:02d}.py").write_text(lines_of(WORDS, i, 60))
    english = tmp_path / "english.txt"
    english.write_text(lines_of(("the", "king", "shall", "speak", "my", "lord", "thou"), 7, 400))
    man_tree(tmp_path / "man", "ru", 20)
    rc = bench.main(["tokenizer", "--corpus", str(corpus), "--mb", "0.05", "--vocab_size", "320",
                     "--own_vocab", "300", "--rounds", "1", "--languages", "ru,xx",
                     "--man_root", str(tmp_path / "man"), "--english", str(english),
                     "--encode_reps", "1", "--work", str(tmp_path / "work"),
                     "--results", str(tmp_path / "results"), "--name", "t"])
    assert rc == 0
    report = json.loads((tmp_path / "results" / "tokenizer_t.json").read_text())
    page = (tmp_path / "results" / "tokenizer_t.md").read_text()
    assert report["corpus"]["bytes"]["train"] <= 0.05 * 2**20
    assert report["corpus"]["documents"]["heldout"] >= 1
    for trainer in ("rustbpe", "hf"):
        (run,) = report["training"][trainer]
        assert run["vocab_size"] == 320 and run["bytes"] == report["corpus"]["bytes"]["train"]
    agreement = report["agreement"]
    assert agreement["merged_a"] == agreement["merged_b"] == 320 - 256 - 1
    assert 0 < agreement["shared"] <= agreement["merged_a"]
    ratios = report["bytes_per_token"]
    assert "apt-get install manpages-xx" in ratios["xx"]["missing"]
    for kind in ("code", "English", "ru"):
        cells = [v for v in ratios[kind].values() if isinstance(v, dict)]
        assert len(cells) == (3 if kind == "code" else 4)
        assert all(c["bytes_per_token"] > 1 and c["round_trip"] for c in cells), cells
    assert ratios["ru"]["own"]["vocab_size"] == 300
    assert ratios["ru"]["non_ascii_share"] > 0.5
    assert set(report["encode_mib_per_s"]) == {"code", "English", "ru"}
    assert "rustbpe / HF BpeTrainer" in page and "| ru |" in page and "xx" in page


def test_man_text_keeps_the_words_and_drops_the_markup():
    source = ('.\\" comment\n.TH LS 1 2022 "GNU"\n.SH "ИМЯ"\nls \\- список\n.PP\n'
              '.BR ls (1),\n\\fB\\-a\\fP, \\fI\\,файл\\/\\fR \\(em конец\\&.\n.nf\n')
    assert man_text(source) == "ИМЯ\nls - список\nls(1),\n-a, файл — конец.\n"
