"""bench.py tokenizer: what training a byte-level BPE here costs and what it buys.

    python bench.py tokenizer --name zen4                  # ~100 MiB of code, 32,768 ids
    python bench.py tokenizer --mb 20 --rounds 1            # a quicker run
    python bench.py tokenizer --corpus 'my/*.jsonl'         # your own text instead

1. Training throughput: `python -m data.train_tokenizer` with --trainer rustbpe and with
   --trainer hf (Hugging Face tokenizers' BpeTrainer) on the same text, vocabulary size and split
   pattern, each in a fresh process, taking turns; each round's MiB/s, the medians, their ratio,
   each process's peak RSS, and how many of the two vocabularies' tokens agree.
2. Bytes per token on held-out text, per kind: code (every 10th document of the corpus, never
   trained on), English (the last 10% of data/tinyshakespeare.txt) and the languages of
   --languages (Debian's translated man pages, e.g. `apt-get install manpages-ru manpages-ja
   manpages-zh`, groff markup stripped; every 10th page held out), each for GPT-2, the corpus'
   tokenizers, and one trained on that kind's own training part; with the round trip
   decode(encode(text)) == text checked on every held-out document.
3. Encoding throughput through tiktoken: encode_ordinary on one thread, the trained tokenizer
   beside GPT-2's, in turns; and encode_ordinary_batch on every CPU.

The corpus (default: the .py/.md/.rst/.txt files of this Python's site-packages, one document
each) is written once under --work and reused.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterator

from config import opt
from data.bpe import GPT2Tokenizer
from data.train_tokenizer import documents, input_files, load_tokenizer, save, train
from engine.benchmarks.report import write_report
from engine.benchmarks.timing import REPO_ROOT
from engine.benchmarks.tokenizer_report import page
from engine.device import cpu_info, cpu_model

MIB = 2**20
HELD_OUT_EVERY = 10  # every 10th document (file, man page) is held out, never trained on
TRAINERS = ("rustbpe", "hf")
CODE_SUFFIXES = (".py", ".md", ".rst", ".txt")


@dataclass
class TokenizerBenchOptions:
    corpus: str = opt("", "text to train on: files, folders or globs, comma-separated (.jsonl: a "
                      "document per line); '' = this Python's site-packages .py/.md/.rst/.txt")
    mb: float = opt(100.0, "MiB of the corpus to train on (a tenth as much more is held out)")
    vocab_size: int = opt(32768, "the corpus tokenizers' ids (bytes + merges + <|endoftext|>)")
    pattern: str = opt("gpt4", "split pattern for every tokenizer trained: gpt4, gpt2 or a regex")
    rounds: int = opt(2, "training runs of each trainer, in turns")
    english: str = opt("data/tinyshakespeare.txt", "English text: trained on its first 90%, "
                       "held out its last 10%")
    languages: str = opt("ru,ja,zh_CN", "man page languages (folders under --man_root), "
                         "comma-separated; '' = none")
    man_root: str = opt("/usr/share/man", "where Debian's manpages-LANG packages put pages")
    own_vocab: int = opt(8192, "ids of the tokenizer trained on each kind's own few MiB")
    encode_mb: float = opt(4.0, "MiB of each held-out text timed for encoding (at most)")
    encode_reps: int = opt(3, "timed encodings of each text per tokenizer, in turns")
    work: str = opt("out/bench_tokenizer", "folder for the corpus (kept, reused) and tokenizers")
    results: str = opt("bench_results", "folder for tokenizer_NAME.{json,md}")
    name: str = opt("cpu", "NAME in the result files")


def site_documents() -> Iterator[str]:
    """The text files of this Python's site-packages, sorted by path, one document each."""
    root = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(root.rglob("*")):
        if path.suffix in CODE_SUFFIXES and path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                yield text


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass


def build_corpus(spec: str, mb: float, folder: Path) -> dict:
    """FOLDER/train.jsonl (mb MiB of documents) and FOLDER/heldout.jsonl (every 10th document
    met on the way); kept in FOLDER/corpus.json and reused while the spec and mb match."""
    record_path = folder / "corpus.json"
    wanted = {"source": spec or f"site-packages {CODE_SUFFIXES}", "mb": mb}
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if {k: record.get(k) for k in wanted} == wanted:
            return record
    folder.mkdir(parents=True, exist_ok=True)
    texts = documents(input_files(spec), "text", _NoBar()) if spec else site_documents()
    budget, sizes = int(mb * MIB), {"train": 0, "heldout": 0}
    counts = dict.fromkeys(sizes, 0)
    with open(folder / "train.jsonl", "w") as train_f, open(folder / "heldout.jsonl", "w") as held:
        for n, text in enumerate(unique(texts), 1):
            part = "heldout" if n % HELD_OUT_EVERY == 0 else "train"
            size = len(text.encode("utf-8", errors="replace"))
            if part == "train" and sizes["train"] + size > budget:
                break
            (held if part == "heldout" else train_f).write(json.dumps({"text": text}) + "\n")
            sizes[part] += size
            counts[part] += 1
    record = {**wanted, "bytes": sizes, "documents": counts}
    record_path.write_text(json.dumps(record, indent=1))
    return record


def unique(texts: Iterator[str]) -> Iterator[str]:
    """Each text once: a copy (a licence, a vendored file) would put held-out text in training."""
    seen = set()
    for text in texts:
        digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
        if digest not in seen:
            seen.add(digest)
            yield text


def read_jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.open() if line.strip()]


def train_process(trainer: str, corpus: Path, out: Path, o: TokenizerBenchOptions) -> dict:
    """`python -m data.train_tokenizer` in a fresh process: what its tokenizer.json records of
    the training, the process's wall time and its own peak RSS (from wait4)."""
    argv = [sys.executable, "-m", "data.train_tokenizer", str(corpus), f"--out={out}",
            f"--vocab_size={o.vocab_size}", f"--pattern={o.pattern}", f"--trainer={trainer}",
            "--no_progress"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}: {output[-500:]}")
    record = json.loads((out / "tokenizer.json").read_text())
    return {**record["trained"], "vocab_size": record["vocab_size"],
            "process_s": round(time.perf_counter() - started, 2),
            "peak_rss": usage.ru_maxrss * 1024, "printed": output.strip()}


def train_in_turns(o: TokenizerBenchOptions, corpus: Path, work: Path) -> dict[str, list[dict]]:
    """Each trainer o.rounds times, in turns: rustbpe, hf, rustbpe, hf, ..."""
    runs: dict[str, list[dict]] = {t: [] for t in TRAINERS}
    for round_ in range(o.rounds):
        for trainer in TRAINERS:
            run = train_process(trainer, corpus, work / f"corpus_{trainer}", o)
            runs[trainer].append(run)
            print(f"train {trainer} round {round_ + 1}: {run['bytes'] / MIB:.1f} MiB in "
                  f"{run['seconds']:.1f} s = {run['mb_per_s']} MiB/s, peak RSS "
                  f"{run['peak_rss'] / MIB:,.0f} MiB")
    return runs


def agreement(a: list[bytes], b: list[bytes], first: int = 1000) -> dict:
    """How many merged tokens (beyond the 256 bytes) two vocabularies share, all of them and
    among each one's first `first` merges."""
    merged_a, merged_b = a[256:], b[256:]
    return {"merged_a": len(merged_a), "merged_b": len(merged_b),
            "shared": len(set(merged_a) & set(merged_b)), "first": first,
            "shared_first": len(set(merged_a[:first]) & set(merged_b[:first])),
            "same_ranks": a == b}


# groff, simply: requests dropped, the text-bearing macros' arguments kept, escapes resolved
JOINED_MACROS = {"B", "I", "SM", "SB", "SH", "SS"}
ALTERNATING_MACROS = {"BR", "RB", "BI", "IB", "IR", "RI"}
NAMED_GLYPHS = {"em": "—", "en": "–", "aq": "'", "dq": '"', "co": "©", "bu": "•", "lq": "“",
                "rq": "”", "oq": "‘", "cq": "’", "hy": "-", "mi": "-", "ti": "~", "ha": "^",
                "rs": "\\", "ga": "`", "pl": "+", "mu": "×", "<=": "≤", ">=": "≥", "->": "→"}
SINGLE_ESCAPES = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'",
                  "`": "`", ".": "."}  # any other \X (\&, \|, \^, \c, \, \/ ...) prints nothing
ESCAPE = re.compile(r"\\(?:f(?:\[[^\]]*\]|\(..|.)|s[+-]?\d+|\*(?:\[[^\]]*\]|\(..|.)"
                    r"|\((..)|\[([^\]]*)\]|(.))")
ARGUMENT = re.compile(r'"([^"]*)"|(\S+)')


def _escape(match: re.Match) -> str:
    glyph = match.group(1) or match.group(2)
    if glyph:
        return NAMED_GLYPHS.get(glyph, "")
    return SINGLE_ESCAPES.get(match.group(3) or "", "")


def man_text(source: str) -> str:
    """A man page's text without its groff markup: comments and requests (.TH, .PP, .nf ...)
    dropped; the words of .SH/.B/.BR-like macros kept; escapes as the glyphs they print."""
    lines = []
    for line in source.splitlines():
        line = re.sub(r'\\".*', "", line)
        if line[:1] in (".", "'"):
            name, _, rest = line[1:].strip().partition(" ")
            args = [a or b for a, b in ARGUMENT.findall(rest)]
            if name in JOINED_MACROS:
                line = " ".join(args)
            elif name in ALTERNATING_MACROS:
                line = "".join(args)
            elif name == "IP" and args:
                line = args[0]
            else:
                continue
        line = ESCAPE.sub(_escape, line)
        if line.strip():
            lines.append(line)
    return "\n".join(lines) + "\n"


def man_pages(root: Path) -> tuple[list[str], dict]:
    """The text of every page under ROOT (a language's folder), sorted by path, each text once;
    pages that are a link (a symlink or .so) or not UTF-8 are skipped and counted."""
    pages, skipped = [], {"link": 0, "not_utf8": 0}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.is_symlink():
            skipped["link"] += 1
            continue
        raw = path.read_bytes()
        raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if source.lstrip().startswith(".so "):
            skipped["link"] += 1
            continue
        pages.append(man_text(source))
    return list(unique(p for p in pages if p.strip())), skipped


def held_out(docs: list[str]) -> tuple[list[str], list[str]]:
    """(training documents, every 10th document)."""
    return ([d for n, d in enumerate(docs, 1) if n % HELD_OUT_EVERY],
            [d for n, d in enumerate(docs, 1) if n % HELD_OUT_EVERY == 0])


def text_kinds(o: TokenizerBenchOptions, corpus_dir: Path) -> dict[str, dict]:
    """kind -> {train: documents or None (the corpus'), heldout: documents, source: words}."""
    english = Path(o.english).read_text(encoding="utf-8")
    cut = int(len(english) * 0.9)
    kinds = {"code": {"train": None, "heldout": read_jsonl(corpus_dir / "heldout.jsonl"),
                      "source": "every 10th document of the corpus (the others trained on)"},
             "English": {"train": [english[:cut]], "heldout": [english[cut:]],
                         "source": f"{o.english}: trained on its first 90%, held out the rest"}}
    for lang in filter(None, (s.strip() for s in o.languages.split(","))):
        folder = Path(o.man_root) / lang
        pages, skipped = man_pages(folder) if folder.is_dir() else ([], {})
        if len(pages) < HELD_OUT_EVERY:
            kinds[lang] = {"missing": f"{len(pages)} man pages under {folder}: install them "
                           f"(apt-get install manpages-{lang.split('_')[0].lower()})"}
            continue
        train_docs, heldout_docs = held_out(pages)
        kinds[lang] = {"train": train_docs, "heldout": heldout_docs, "skipped": skipped,
                       "source": f"{len(pages)} man pages under {folder}, groff stripped; "
                       f"every 10th held out"}
    return kinds


def train_own(docs: list[str], vocab: int, pattern: str, folder: Path):
    """A rustbpe tokenizer trained in this process on `docs` (written as a .jsonl)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok, info = train([path], vocab, [], pattern, progress=False, name=folder.name)
    save(tok, folder, trained=info)
    return tok, info


def bytes_per_token(tok, docs: list[str]) -> dict:
    """Text bytes per token over `docs`, each encoded alone, and whether each one round-trips."""
    n_bytes = n_tokens = 0
    round_trip = True
    for doc in docs:
        ids = tok.encode_ordinary(doc)
        n_bytes += len(doc.encode("utf-8"))
        n_tokens += len(ids)
        round_trip &= tok.decode(ids) == doc
    return {"bytes": n_bytes, "tokens": n_tokens, "round_trip": round_trip,
            "bytes_per_token": round(n_bytes / max(n_tokens, 1), 3)}


def compression(kinds: dict, tokenizers: dict, o: TokenizerBenchOptions, work: Path) -> dict:
    """kind -> {tokenizer label -> bytes_per_token()}, plus the kind's own tokenizer ('own')."""
    out = {}
    for kind, texts in kinds.items():
        if "missing" in texts:
            out[kind] = {"missing": texts["missing"]}
            continue
        row = {label: bytes_per_token(tok, texts["heldout"]) for label, tok in tokenizers.items()}
        if texts["train"] is not None:
            own, info = train_own(texts["train"], o.own_vocab, o.pattern, work / f"own_{kind}")
            row["own"] = {**bytes_per_token(own, texts["heldout"]), "vocab_size": own.vocab_size,
                          "trained_bytes": info["bytes"]}
            texts["own"] = own
        heldout = "".join(texts["heldout"])
        row["non_ascii_share"] = round(sum(ord(c) > 127 for c in heldout)
                                       / max(len(heldout), 1), 3)
        row["source"], row["documents"] = texts["source"], len(texts["heldout"])
        out[kind] = row
        print(f"{kind}: bytes/token " + ", ".join(
            f"{k} {v['bytes_per_token']}" for k, v in row.items() if isinstance(v, dict)
            and "bytes_per_token" in v))
    return out


def mib_per_s(fn, n_bytes: int) -> float:
    started = time.perf_counter()
    fn()
    return n_bytes / MIB / (time.perf_counter() - started)


def encode_speeds(kinds: dict, corpus_tok, gpt2, o: TokenizerBenchOptions) -> dict:
    """kind -> {label: MiB/s of each rep}: encode_ordinary on one thread, the kind's trained
    tokenizer and GPT-2's in turns on the same text (its first encode_mb MiB); code also through
    encode_ordinary_batch on every CPU."""
    out = {}
    for kind, texts in kinds.items():
        if "missing" in texts:
            continue
        text = "".join(texts["heldout"]).encode("utf-8")[:int(o.encode_mb * MIB)]
        text = text.decode("utf-8", errors="ignore")
        ours = texts.get("own", corpus_tok)
        runs = {"trained": lambda t=ours, s=text: t.encode_ordinary(s),
                "gpt2": lambda s=text: gpt2.encode_ordinary(s)}
        if kind == "code":
            docs, threads = texts["heldout"], os.cpu_count() or 1
            runs["trained_batch"] = lambda: corpus_tok.enc.encode_ordinary_batch(
                docs, num_threads=threads)
            runs["gpt2_batch"] = lambda: gpt2.enc.encode_ordinary_batch(docs, num_threads=threads)
        sizes = {k: len(text.encode()) if "batch" not in k
                 else sum(len(d.encode()) for d in texts["heldout"]) for k in runs}
        for fn in runs.values():
            fn()  # warm up: tiktoken builds its regex and caches on first use
        speeds: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(o.encode_reps):
            for label, fn in runs.items():
                speeds[label].append(round(mib_per_s(fn, sizes[label]), 2))
        out[kind] = {"mib": round(sizes["gpt2"] / MIB, 2), **speeds}
        print(f"encode {kind}: " + ", ".join(f"{k} {statistics.median(v):.2f} MiB/s"
                                             for k, v in speeds.items()))
    return out


def machine() -> dict:
    """The CPU (its name, family and AVX-512 flags) and the libraries' versions."""
    info = cpu_info()
    flags = sorted(f for f in info.get("flags", "").split() if f.startswith("avx512"))
    versions = {}
    for package in ("rustbpe", "tokenizers", "tiktoken"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {"cpu": cpu_model(), "model": info.get("model", "?"), "cpus": os.cpu_count(),
            "avx512": flags, "python": sys.version.split()[0], "versions": versions,
            "load_average": round(os.getloadavg()[0], 2)}


def run(o: TokenizerBenchOptions, command: str) -> int:
    work, load_at_start = Path(o.work), round(os.getloadavg()[0], 2)
    corpus_dir = work / (f"corpus_{o.mb:g}mb" if not o.corpus else f"corpus_own_{o.mb:g}mb")
    corpus = build_corpus(o.corpus, o.mb, corpus_dir)
    print(f"corpus: {corpus['bytes']['train'] / MIB:.1f} MiB to train on, "
          f"{corpus['bytes']['heldout'] / MIB:.1f} MiB held out ({corpus_dir})")
    runs = train_in_turns(o, corpus_dir / "train.jsonl", work)
    trained = {t: load_tokenizer(work / f"corpus_{t}") for t in TRAINERS}
    gpt2 = GPT2Tokenizer()
    kinds = text_kinds(o, corpus_dir)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        ratios = compression(kinds, {"gpt2": gpt2, "corpus_rustbpe": trained["rustbpe"],
                                     "corpus_hf": trained["hf"]}, o, Path(tmp))
        speeds = encode_speeds(kinds, trained["rustbpe"], gpt2, o)
    report = {"command": command, "machine": {**machine(), "load_at_start": load_at_start},
              "corpus": corpus, "training": runs,
              "agreement": agreement(trained["rustbpe"].tokens, trained["hf"].tokens),
              "bytes_per_token": ratios, "encode_mib_per_s": speeds,
              "peak_rss_this_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for path in write_report(report, page(report, o), o.results, f"tokenizer_{o.name}"):
        print(f"wrote {path}")
    return 0
