"""eval.py and engine/evaluation/: choice log-likelihoods through the KV cache (shared prefixes)
against each row read whole and against transformers' GPT2LMHeadModel on an exported tiny random
GPT-2; batched generation against one prompt at a time without a cache; HellaSwag as a task of
the suite against engine/hellaswag.py; bits per byte against the model's own loss; Wilson and
pass@k against their definitions; checkers; the report and --compare; each bad input's line."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import eval as eval_script
from config import Config
from conftest import tiny_default_model_config, tiny_model_config
from data import instruct_tasks
from data.bpe import GPT2Tokenizer
from data.chat_template import ChatTemplate
from data.tokenizer import CharTokenizer
from engine import hellaswag, hf, saving
from engine.evaluation import checkers, prompts, stats
from engine.evaluation.generation import generate_batch
from engine.evaluation.runner import Settings, run_task
from engine.evaluation.scoring import bits_per_byte, choice_logprobs
from engine.evaluation.tasks import Task, TaskError, load_tasks
from engine.inference.sampling import generate_tokens
from model import GPT

GPT2 = GPT2Tokenizer()
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?'\n"))
ITEMS = [  # (context, choices): choices of different token lengths, contexts of several
    ("The capital of France is", [" Paris", " Rome, the eternal city", " a"]),
    ("Two plus two equals", [" four", " five or six", " 22", " fish"]),
    ("", [" Once upon a time", " Hello"]),  # an empty context: read after <|endoftext|>
    ("A long context " * 12 + "ends", [" here", " there and then everywhere at once"]),
]


def random_model(cfg, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():  # every bias and gain random too, so a misplaced one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def requests(tok, items=ITEMS):
    return [(tok.encode_ordinary(c) or [tok.eot_id], [tok.encode_ordinary(x) for x in cs])
            for c, cs in items]


@pytest.fixture(scope="module")
def gpt2_shaped(tmp_path_factory):
    """A tiny random GPT-2 (GPT-2's vocabulary, every flag at GPT-2's reference path) and the
    same weights in transformers, through the project's Hugging Face export."""
    from transformers import GPT2LMHeadModel

    model = random_model(tiny_model_config(vocab_size=GPT2.vocab_size, block_size=32,
                                           n_embd=32))
    out = tmp_path_factory.mktemp("hf") / "export"
    hf.write_hf_dir(model, out, tokenizer={"kind": "gpt2"})
    return model, GPT2LMHeadModel.from_pretrained(str(out)).eval()


def test_choice_logprobs_equal_transformers_and_each_row_read_whole(gpt2_shaped):
    model, reference = gpt2_shaped
    reqs = requests(GPT2)
    cached = choice_logprobs(model, reqs, batch_rows=5)  # batches split between questions
    whole = choice_logprobs(model, reqs, kv_cache=False)
    for (context, choices), ours, theirs in zip(reqs, cached, whole):
        expected = []
        for choice in choices:
            ids = (context + choice)[-(model.config.block_size + 1):]
            with torch.no_grad():
                logp = torch.log_softmax(reference(torch.tensor([ids[:-1]])).logits[0], -1)
            n = len(choice)
            expected.append(float(logp[-n:].gather(1, torch.tensor(ids[-n:])[:, None]).sum()))
        assert [n for _, n in ours] == [len(c) for c in choices]
        assert [lp for lp, _ in ours] == pytest.approx(expected, abs=1e-4)
        assert [lp for lp, _ in theirs] == pytest.approx(expected, abs=1e-4)
        for norm in (lambda lp, n: lp, lambda lp, n: lp / n):  # acc and acc_norm pick the same
            ranked = [norm(lp, n) for lp, n in ours]
            ranked_hf = [norm(lp, len(c)) for lp, c in zip(expected, choices)]
            assert ranked.index(max(ranked)) == ranked_hf.index(max(ranked_hf))


def test_shared_prefixes_equal_rows_read_whole_on_the_default_models_techniques():
    """Rotary, the smear (it reads the token before, from the cache), U-net skips..."""
    tok = CharTokenizer(CHARS)
    cfg = tiny_default_model_config()
    cfg.vocab_size, cfg.block_size = tok.vocab_size, 24
    model = random_model(cfg, seed=1)
    items = [("abc de", ["f", "fgh ij", "xy"]), ("Q: what? A:", [" yes", " no"]),
             ("long " * 8, ["a b c d e f g h i j k l", "z"])]  # past the context: cropped
    reqs = [(tok.encode(c), [tok.encode(x) for x in cs]) for c, cs in items]
    for rows in (2, 64):
        cached = choice_logprobs(model, reqs, batch_rows=rows)
        whole = choice_logprobs(model, reqs, kv_cache=False)
        assert [[n for _, n in q] for q in cached] == [[n for _, n in q] for q in whole]
        assert [lp for q in cached for lp, _ in q] == pytest.approx(
            [lp for q in whole for lp, _ in q], abs=1e-4)


def test_batched_generation_equals_one_prompt_at_a_time_without_a_cache():
    tok = CharTokenizer(CHARS)
    cfg = tiny_default_model_config()
    cfg.vocab_size, cfg.block_size = tok.vocab_size, 32
    model = random_model(cfg, seed=2)
    texts = ["a", "hello the", "xyz xyz xyz", "Q: abc?\nA:", "the end of a longer prompt here"]
    ids = [tok.encode(t) for t in texts]
    outs = generate_batch(model, tok, ids, max_new_tokens=6, batch_rows=3)
    for prompt, (c,) in zip(ids, outs):
        one = generate_tokens(model, torch.tensor([prompt[-26:]]), 6, temperature=0,
                              kv_cache=False)
        assert c.tokens == one[0, len(prompt[-26:]):].tolist()
        assert c.text == tok.decode(c.tokens) and c.finish == "length"
    # stop strings cut the text; a stop token ends a completion and is not in it
    stop_at = outs[1][0].text[2]
    cut = generate_batch(model, tok, ids[1:2], 6, stop_strings=[stop_at])[0][0]
    assert cut.finish == "stop" and cut.text == outs[1][0].text[:outs[1][0].text.index(stop_at)]
    full = outs[1][0].tokens
    ended = generate_batch(model, tok, ids[1:2], 6, stop_ids={full[3]})[0][0]
    assert ended.tokens == full[:full.index(full[3])] and ended.finish == "stop"


def test_samples_per_prompt_are_seeded_and_independent_rows():
    tok = CharTokenizer(CHARS)
    model = random_model(tiny_model_config(vocab_size=tok.vocab_size, block_size=32), seed=3)
    ids = [tok.encode("abc"), tok.encode("hello")]

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [[c.tokens for c in cs] for cs in generate_batch(
            model, tok, ids, 8, samples=4, temperature=1.0, generator=g)]

    first = draw(0)
    assert first == draw(0) and first != draw(1)
    assert [len(s) for s in first] == [4, 4] and len({tuple(t) for t in first[0]}) > 1


def test_hellaswag_as_a_suite_task_equals_engine_hellaswag(tmp_path):
    from test_hellaswag import EXAMPLES

    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    model = random_model(tiny_model_config(vocab_size=GPT2.vocab_size, block_size=64,
                                           n_embd=32), seed=4)
    task = load_tasks("hellaswag", hellaswag_path=str(path))[0]
    result = run_task(model, GPT2, None, task, Settings(shots=0))
    expected = hellaswag.evaluate(model, GPT2, hellaswag.load_examples(path))
    assert result["metrics"]["acc"] == expected["acc"]
    assert result["metrics"]["acc_norm"] == expected["acc_norm"]
    assert result["n"] == 3 and result["metric"] == "acc_norm"


def test_bits_per_byte_equal_the_models_own_loss():
    tok = CharTokenizer(CHARS)
    model = random_model(tiny_model_config(vocab_size=tok.vocab_size, block_size=16), seed=5)
    text = "the quick brown fox jumps over the lazy dog. " * 3
    ids = [tok.start_id] + tok.encode(text)
    r = bits_per_byte(model, ids, len(text.encode()), batch_rows=3)
    total = 0.0
    for s in range(0, len(ids) - 1, 16):  # each window of 16 predictions, read whole
        w = torch.tensor(ids[s:s + 17])
        total += model(w[None, :-1], w[None, 1:])[1].item() * (len(w) - 1)
    assert r["bpb"] == pytest.approx(total / math.log(2) / len(text), rel=1e-5)
    assert (r["tokens"], r["bytes"]) == (len(text), len(text))


def test_wilson_and_pass_at_k_against_their_definitions():
    z = stats.Z95
    assert stats.wilson(0, 10) == pytest.approx((0.0, z * z / (10 + z * z)))
    assert stats.wilson(10, 10)[1] == pytest.approx(1.0)
    assert stats.wilson(5, 10)[0] == pytest.approx(1 - stats.wilson(5, 10)[1])  # symmetric
    assert stats.wilson(43, 50) == pytest.approx((0.73814, 0.93049), abs=1e-5)
    for n, c, k in [(10, 3, 1), (10, 3, 5), (6, 0, 2), (6, 5, 2), (5, 2, 5)]:
        draws = list(itertools.combinations([1] * c + [0] * (n - c), k))
        assert stats.pass_at_k(n, c, k) == pytest.approx(sum(map(any, draws)) / len(draws))
    assert stats.pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_checkers_and_a_users_checker_module(tmp_path, monkeypatch):
    assert checkers.exact({"answer": "thgin"}, " thgin ") is True
    assert checkers.number({"answer": "1,234"}, "it is 12 then 1234.") is True
    assert checkers.number({"answer": 7}, "seven") is False
    (tmp_path / "my_checks.py").write_text(
        "def palindrome(problem, completion):\n    t = completion.strip()\n"
        "    return len(t) > 0 and t == t[::-1]\n"
        "def broken(problem, completion):\n    raise KeyError('wanted')\n")
    monkeypatch.chdir(tmp_path)
    check = checkers.resolve("my_checks:palindrome")
    assert check({}, " abba") and not check({}, "abc")
    assert checkers.resolve(str(tmp_path / "my_checks.py") + ":palindrome")({}, "aa")
    with pytest.raises(checkers.CheckerError, match="raised KeyError: 'wanted'"):
        checkers.reward(checkers.resolve("my_checks:broken"), {}, "x")


def test_builtin_tasks_are_seeded_and_keep_their_test_split_out_of_training_data(tmp_path):
    for name in ("add", "copy8"):
        test = instruct_tasks.problems(name, "test", 100, seed=3)
        assert test == instruct_tasks.problems(name, "test", 100, seed=3)
        assert test != instruct_tasks.problems(name, "test", 100, seed=4)
        train = instruct_tasks.problems(name, "train", 2000, seed=3)
        assert not {p["prompt"] for p in test} & {p["prompt"] for p in train}
    assert all(int(p["answer"]) == sum(map(int, p["prompt"][8:-1].split(" + ")))
               for p in instruct_tasks.problems("add", "test", 50))
    train_file, val_file = instruct_tasks.write_task("add", tmp_path, n_val=20, n_train=30)
    rows = [json.loads(line) for line in val_file.read_text().splitlines()]
    assert len(rows) == 20 and rows[0] == {"instruction": rows[0]["instruction"],
                                           "output": rows[0]["output"]}
    # eval's reverse task is the finetuning files' held-out words
    _, val = instruct_tasks.write_task("reverse", tmp_path)
    held = {json.loads(line)["instruction"] for line in val.read_text().splitlines()}
    assert {p["prompt"] for p in load_tasks("reverse")[0].problems} == held


def test_few_shot_prompts_plain_and_through_a_chat_template():
    tok = CharTokenizer(CHARS, eot=True)
    task = Task("t", "generate", [{"prompt": "Say a", "answer": "a"},
                                  {"prompt": "Say b", "answer": "b"}], source="test", shots=1)
    shots = prompts.pick_shots(task, 0, 1, seed=0)
    assert shots == [task.problems[1]] and prompts.pick_shots(task, 0, 0, 0) == []
    plain = prompts.generation_prompt(task, task.problems[0], shots, tok)
    assert tok.decode(plain) == "Say b\nAnswer: b\n\nSay a\nAnswer:"
    chat = prompts.generation_prompt(task, task.problems[0], shots, tok, ChatTemplate())
    assert tok.decode(chat) == ("User: Say b\nAssistant: b<|endoftext|>\nUser: Say a\n"
                                "Assistant: ")
    assert prompts.stops(task, tok, ChatTemplate()) == ({tok.eot_id}, [])


@pytest.fixture(scope="module")
def char_ckpt(tmp_path_factory):
    """A tiny random character model saved as one of our checkpoints (no chat template)."""
    tok = CharTokenizer(CHARS)
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=tok.vocab_size, block_size=64)
    model = random_model(cfg.model, seed=6)
    out = tmp_path_factory.mktemp("char_ckpt")
    return saving.save(out, 3, model, cfg, {"tokenizer": tok.meta()})


def write_lines(path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_eval_py_end_to_end_a_report_card_and_compare(char_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checks.py").write_text("def has_a(problem, completion):\n"
                                        "    return 'a' in completion\n")
    mine = write_lines(tmp_path / "mine.jsonl",
                       {"task": {"name": "has_a", "checker": "checks:has_a", "shots": 1,
                                 "max_new_tokens": 5}},
                       {"prompt": "Say a"}, {"prompt": "Say b"}, {"prompt": "Say c"})
    pick = write_lines(tmp_path / "pick.jsonl", {"context": "a b", "choices": [" c", " d"],
                                                 "label": 0},
                       {"context": "x", "choices": [" yes", " no", " maybe"], "label": 2})
    (tmp_path / "notes.txt").write_text("the quick brown fox. " * 20)
    args = ["--checkpoint", str(char_ckpt), "--tasks", f"reverse,add,{mine},{pick},notes.txt",
            "--limit", "4", "--threads=1"]
    assert eval_script.main([*args, "--out", "a"]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    rows = {r["task"]: r for r in report["tasks"]}
    assert list(rows) == ["reverse", "add", "has_a", "pick", "notes"]
    assert rows["reverse"]["n"] == 4 and rows["reverse"]["shots"] == 3
    assert "'+'" in rows["add"]["skipped"]  # a character model has no digits
    assert rows["has_a"]["n"] == 3 and rows["pick"]["n"] == 2
    assert set(rows["pick"]["metrics"]) == {"acc", "acc_norm", "acc_char"}
    assert rows["notes"]["metrics"]["bytes"] == 420 and rows["notes"]["value"] > 0
    low, high = rows["reverse"]["ci95"]
    assert low <= rows["reverse"]["value"] <= high
    assert report["tokenizer"]["kind"] == "char" and len(report["tokenizer"]["sha256"]) == 64
    assert report["model"]["n_layer"] == 2 and report["step"] == 3
    assert report["config"]["model"]["n_embd"] == 16  # the checkpoint's whole stored config
    assert "| reverse | generate | pass@1 |" in (tmp_path / "a.md").read_text()
    # sampled: 4 completions a problem, pass@1 and pass@4 from the unbiased estimator
    assert eval_script.main([*args[:3], mine, "--samples=4", "--temperature=1.0",
                             "--pass-k=1,4", "--out", "b", "--threads=1"]) == 0
    sampled = json.loads((tmp_path / "b.json").read_text())["tasks"][0]
    assert sampled["samples"] == 4 and sampled["metrics"]["pass@4"] >= sampled["value"]
    capsys.readouterr()
    assert eval_script.main(["--compare", "a.json", "b.json"]) == 0
    table = capsys.readouterr().out
    assert "| has_a | pass@1 |" in table and "| reverse | pass@1 |" in table
    assert "only in A" in table


BAD = [  # (what is written, --tasks, the error's start)
    (None, "revrse", "error: unknown task 'revrse' (did you mean reverse?)"),
    (None, "gone.jsonl", "error: task file gone.jsonl not found"),
    (['{"prompt": "a", "answer": "b"}', "{not json"], "t.jsonl",
     "error: t.jsonl:2: not valid JSON"),
    ([{"task": {"kind": "essay"}}, {"prompt": "a"}], "t.jsonl",
     "error: t.jsonl:1: unknown task kind 'essay'"),
    ([{"task": {"shot": 2}}, {"prompt": "a"}], "t.jsonl",
     "error: t.jsonl:1: unknown task setting 'shot' (did you mean shots?)"),
    ([{"context": "a", "choices": [" b", " c"], "label": 2}], "t.jsonl",
     "error: t.jsonl:1: label 2 is not the index of one of its 2 choices"),
    ([{"question": "a"}], "t.jsonl", "error: t.jsonl:1: a problem needs \"context\""),
    ([{"task": {"checker": "no_such_module:f"}}, {"prompt": "a"}], "t.jsonl",
     "error: task t: checker 'no_such_module:f': its module does not import "
     "(ModuleNotFoundError"),
    ([{"task": {"checker": "boom_checks:boom"}}, {"prompt": "a"}, {"prompt": "b"}], "t.jsonl",
     "error: task t, t.jsonl:2: its checker raised ZeroDivisionError"),
]


@pytest.mark.parametrize("lines,tasks,expected", BAD)
def test_bad_tasks_get_one_line(char_ckpt, tmp_path, monkeypatch, capsys, lines, tasks,
                                expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "boom_checks.py").write_text("def boom(problem, completion):\n    return 1 / 0\n")
    if lines is not None:
        write_lines(tmp_path / tasks, *lines)
    assert eval_script.main(["--checkpoint", str(char_ckpt), "--tasks", tasks,
                             "--threads=1"]) == 2
    err = capsys.readouterr().err.splitlines()  # a banner maybe, then the error, no traceback
    assert err[-1].startswith(expected) and not any("Traceback" in e for e in err), err


def test_bad_options_and_reports_get_one_line(char_ckpt, tmp_path, capsys):
    assert eval_script.main(["--checkpoint", str(char_ckpt), "--samples=4"]) == 2
    assert "would repeat one greedy answer" in capsys.readouterr().err
    assert eval_script.main(["--checkpoint", str(char_ckpt), "--pass-k=8"]) == 2
    assert "--pass-k='8': give k values from 1 to --samples (1)" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("[1, 2]")
    assert eval_script.main(["--compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "is not an eval.py report" in capsys.readouterr().err
    assert eval_script.main(["--checkpoint", str(char_ckpt), "--format=chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_few_shot_examples_that_do_not_fit_are_dropped_earliest_first():
    tok = CharTokenizer(CHARS)
    task = Task("t", "generate", [{"prompt": f"Say {c}", "answer": c} for c in "abcde"],
                source="test")
    shots = task.problems[1:4]

    def build(few):
        return prompts.generation_prompt(task, task.problems[0], few, tok)

    whole = len(build(shots))
    assert prompts.fitted(build, shots, whole) == (build(shots), 3)
    assert prompts.fitted(build, shots, whole - 1) == (build(shots[1:]), 2)
    assert prompts.fitted(build, shots, 3) == (build([]), 0)  # too long even alone: no shots


def test_lm_evals_items_are_the_contexts_eval_py_scores(tmp_path):
    from engine.benchmarks import lmeval

    path, items = lmeval.write_items(GPT2, 5, tmp_path)
    task = load_tasks("add_choice", seed=1337, limit=5)[0]
    for i, (item, problem) in enumerate(zip(items, task.problems)):
        context, choices = prompts.choice_request(
            task, problem, prompts.pick_shots(task, i, task.shots, 1337), GPT2)
        assert GPT2.decode(context) == item["context"] and item["context"].count("Answer:") == 4
        assert [GPT2.decode(c) for c in choices] == item["choices"]
    config = lmeval.TASK_YAML.format(items=path)
    assert 'doc_to_text: "{{context}}"' in config and f"test: {path}\n" in config
    assert [json.loads(line) for line in path.read_text().splitlines()] == items


def test_bench_eval_page_puts_each_models_result_under_it():
    from engine.benchmarks import evaluation

    def report(name, value, skipped=False):
        task = {"task": "add", "kind": "generate", "metric": "pass@1", "value": value,
                "ci95": [0.1, 0.9], "n": 10, "seconds": 2.0}
        return {"checkpoint": f"out/{name}/ckpt_0000001", "step": 1, "parameters": 1000,
                "tokenizer": {"kind": "gpt2"}, "format": "plain", "seconds": 3.0,
                "process_seconds": 4.0, "shell": "python eval.py ...",
                "tasks": [{**task, "skipped": "no digits"} if skipped else task]}

    page = {"machine": "CPU X", "load_average": [1.0, 2.0], "date": "today", "command": "c",
            "reports": [report("a", 0.5), report("b", 0.25, skipped=True)],
            "agreement": None, "lmeval": None}
    text = evaluation.markdown(page)
    assert "| task | metric | a | b |" in text
    assert "| add | pass@1 | 50.0% [10.0, 90.0] (2.0 s) | skipped |" in text
    assert "| a | 1 | 1,000 | gpt2 | plain | 3.0 | 4.0 |" in text
