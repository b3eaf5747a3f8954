"""The page `python bench.py tokenizer` writes (bench_results/tokenizer_NAME.md) from its numbers:
training throughput, bytes per token on held-out text, encoding throughput."""
from __future__ import annotations

import statistics

from engine.benchmarks.report import MIB, markdown_table, utc_now

LABELS = {"gpt2": "GPT-2 (50,257)", "corpus_rustbpe": "corpus, rustbpe",
          "corpus_hf": "corpus, HF BpeTrainer", "own": "its own training part"}


def machine_line(m: dict) -> str:
    avx512 = f"AVX-512 ({', '.join(m['avx512'])})" if m["avx512"] else "no AVX-512"
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    return (f"CPU {m['cpu']} model {m['model']}, {avx512}, {m['cpus']} CPUs (shared with other "
            f"jobs: 1-minute load average {m['load_at_start']} at the start, "
            f"{m['load_average']} at the end); Python {m['python']}, {versions}")


def training_section(r: dict, o) -> list[str]:
    runs, corpus = r["training"], r["corpus"]
    median = {t: statistics.median(x["mb_per_s"] for x in rs) for t, rs in runs.items()}
    rows = [[t, " / ".join(f"{x['mb_per_s']:.2f}" for x in rs), f"{median[t]:.2f}",
             f"{statistics.median(x['seconds'] for x in rs):.1f}",
             f"{statistics.median(x['process_s'] for x in rs):.1f}",
             f"{statistics.median(x['peak_rss'] for x in rs) / MIB:,.0f}",
             f"{rs[-1]['vocab_size']:,}"] for t, rs in runs.items()]
    ratio = median["rustbpe"] / median["hf"]
    verdict = ("met: rustbpe trains at least as fast" if ratio >= 1 else
               "not met: rustbpe trains slower")
    a = r["agreement"]
    return [
        "## Training throughput", "",
        f"The same {corpus['bytes']['train'] / MIB:.1f} MiB ({corpus['documents']['train']:,} "
        f"documents of {corpus['source']}), {o.vocab_size:,} ids, the {o.pattern} split "
        "pattern: `python -m data.train_tokenizer` with each trainer in a fresh process, "
        f"{len(runs['rustbpe'])} round(s) taking turns (rustbpe, hf, rustbpe, hf ...). MiB/s and "
        "seconds are the text read and trained on over train()'s own clock (reading the file "
        "through the same code, counting, merging); the process adds start-up and saving. Peak "
        "RSS: each process's own (wait4).", "",
        markdown_table(["trainer", "MiB/s, each round", "median MiB/s", "train s (median)",
                        "process s", "peak RSS MiB", "ids"], rows), "",
        f"rustbpe / HF BpeTrainer, median MiB/s: **{ratio:.2f}x**. The target (ours at least as "
        f"fast as HF tokenizers' BPE trainer, side by side) is {verdict}.", "",
        f"Agreement: of {a['merged_a']:,} merged tokens (rustbpe) and {a['merged_b']:,} (HF), "
        f"{a['shared']:,} are in both ({a['shared'] / max(a['merged_a'], 1):.1%}); among each "
        f"one's first {a['first']:,} merges, {a['shared_first']:,}"
        + ("; the two rank lists are identical, order included." if a["same_ranks"] else
           "; the rank lists differ in order or content."), ""]


def compression_section(r: dict, o) -> list[str]:
    labels = ["own", "corpus_rustbpe", "corpus_hf", "gpt2"]
    rows, notes = [], []
    for kind, row in r["bytes_per_token"].items():
        if "missing" in row:
            rows.append([kind, "not measured: " + row["missing"]] + [""] * 6)
            continue
        cells = [f"{row[k]['bytes_per_token']:.3f}" if k in row else "(the corpus')"
                 for k in labels]
        best = row.get("own", row["corpus_rustbpe"])["bytes_per_token"]
        trips = all(v["round_trip"] for v in row.values() if isinstance(v, dict)
                    and "round_trip" in v)
        rows.append([kind, f"{row['gpt2']['bytes'] / MIB:.2f} MiB, {row['documents']:,} docs",
                     f"{row['non_ascii_share']:.0%}", *cells,
                     f"{best / row['gpt2']['bytes_per_token']:.2f}x",
                     "yes" if trips else "**no**"])
        notes.append(f"- {kind}: {row['source']}" + (
            f"; its own tokenizer: rustbpe, {row['own']['vocab_size']:,} ids, trained on "
            f"{row['own']['trained_bytes'] / MIB:.2f} MiB" if "own" in row else
            "; its own tokenizer is the corpus'"))
    return [
        "## Bytes per token on held-out text", "",
        "UTF-8 bytes of held-out text per token (higher = fewer tokens for the same text), each "
        f"document encoded alone. Corpus tokenizers: the last training round's, {o.vocab_size:,}"
        f" ids, trained on the code corpus only. Own: rustbpe at {o.own_vocab:,} ids, trained on "
        "that kind's training part only. Round trip: decode(encode(doc)) == doc for every "
        "held-out document and every tokenizer in the row.", "",
        markdown_table(["text", "held out", "non-ASCII chars", "own", "corpus, rustbpe",
                        "corpus, HF", "GPT-2", "own (else corpus) / GPT-2", "round trip"], rows),
        "", *notes, ""]


def encoding_section(r: dict, o) -> list[str]:
    rows = []
    for kind, speeds in r["encode_mib_per_s"].items():
        own = "own" in r["bytes_per_token"][kind]
        for ours, theirs, how in (("trained", "gpt2", "encode_ordinary, 1 thread"),
                                  ("trained_batch", "gpt2_batch",
                                   f"encode_ordinary_batch, {r['machine']['cpus']} threads")):
            if ours not in speeds:
                continue
            a, b = statistics.median(speeds[ours]), statistics.median(speeds[theirs])
            every_doc = r["bytes_per_token"][kind]["gpt2"]["bytes"] / MIB
            rows.append([kind, how, f"{every_doc if 'batch' in ours else speeds['mib']:.2f}",
                         f"{a:.2f} ({'own' if own else 'corpus'})", f"{b:.2f}", f"{a / b:.2f}x"])
    return [
        "## Encoding throughput (tiktoken)", "",
        f"The held-out text of each kind (at most {o.encode_mb:g} MiB, as one string; the batch "
        f"rows: every held-out code document), {o.encode_reps} timed encodings per tokenizer in "
        "turns after one untimed, medians in MiB/s of text. Trained: the kind's own tokenizer "
        "(else the corpus' rustbpe one).", "",
        markdown_table(["text", "call", "MiB", "trained MiB/s", "GPT-2 MiB/s",
                        "trained / GPT-2"], rows), ""]


def caveats(o) -> list[str]:
    return [
        "## Read with it", "",
        "- Translated man pages keep English option names, commands and some untranslated "
        "paragraphs (the non-ASCII column), and pages share boilerplate (translation credits, "
        "licences): a tokenizer trained on the other pages is in-domain, so its figure flatters "
        "it beside GPT-2's, a general tokenizer's.",
        f"- The trained tokenizers split text with the {o.pattern} pattern, GPT-2 with its own: "
        "encoding speed differs with the pattern, the vocabulary and the text.",
        "- The CPUs were shared with other jobs (the load averages above): compare the ratios "
        "of runs taken in turns, not the absolute MiB/s.", ""]


def page(r: dict, o) -> str:
    lines = [f"# Tokenizer: training, bytes per token, encoding ({utc_now()})", "",
             machine_line(r["machine"]), "", f"`{r['command']}`", "",
             *training_section(r, o), *compression_section(r, o), *encoding_section(r, o),
             *caveats(o)]
    return "\n".join(lines)
