"""generate.py --chat (engine/inference/chat.py): a reply is greedy decoding of the template's
prompt stopped at the end-of-text token (not printed); turns, /reset and /exit; a conversation
that outgrows the context loses its oldest turns, the system message kept; a checkpoint without a
template is refused; generate_tokens' stop_ids."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch

import generate
from config import Config
from conftest import ROOT, tiny_model_config
from data.chat_template import ChatTemplate, TemplateError
from data.tokenizer import CharTokenizer
from engine import saving
from engine.inference.chat import Chat, converse
from engine.inference.sampling import generate_tokens
from model import GPT

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ:.,!?\n"))


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A tiny random model with a chat template (the end of text: id len(CHARS))."""
    tok = CharTokenizer(CHARS, eot=True)
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=tok.vocab_size, block_size=64)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():  # make the end token likely after a few characters
        model.lm_head.weight[tok.eot_id] *= 40
    out = tmp_path_factory.mktemp("chat")
    meta = {"tokenizer": tok.meta(), "template": ChatTemplate().meta()}
    return saving.save(out, 1, model, cfg, meta), model, tok


def test_one_turn_is_greedy_decoding_of_the_template_stopped_at_the_end(chat_ckpt, capsys):
    path, model, tok = chat_ckpt
    assert generate.main(["--checkpoint", str(path), "--chat", "--prompt", "Hi there",
                          "--temperature=0", "--max_new_tokens=30", "--device=cpu"]) == 0
    printed = capsys.readouterr().out
    ids = ChatTemplate().prompt(tok, [{"role": "user", "content": "Hi there"}])
    out = generate_tokens(model.eval(), torch.tensor([ids]), 30, temperature=0)[0, len(ids):]
    out = out.tolist()
    expected = out[:out.index(tok.eot_id)] if tok.eot_id in out else out
    assert printed == tok.decode(expected) + "\n"
    assert "<|endoftext|>" not in printed


def test_a_checkpoint_without_a_template_is_refused(tmp_path, capsys):
    cfg = Config()
    cfg.model = tiny_model_config(vocab_size=len(CHARS), block_size=16)
    path = saving.save(tmp_path, 1, GPT(cfg.model), cfg,
                           {"tokenizer": CharTokenizer(CHARS).meta()})
    assert generate.main(["--checkpoint", str(path), "--chat", "--prompt", "hi",
                          "--device=cpu"]) == 2
    assert "has no chat template (its meta.json has no \"template\")" in capsys.readouterr().err


def fake_chat(block_size: int = 64, system: str = "", reply: str = "ok") -> tuple[Chat, list]:
    """A Chat whose 'model' answers `reply`; the prompts it was given are recorded."""
    tok = CharTokenizer(CHARS, eot=True)
    model = GPT(tiny_model_config(vocab_size=tok.vocab_size, block_size=block_size))
    prompts, notes = [], []

    def sample(idx, n, stop_ids, on_token):
        prompts.append(tok.decode(idx[0].tolist()))
        for t in tok.encode(reply) + [tok.eot_id, tok.stoi["x"]]:
            on_token(torch.tensor([[t]]))
        return idx

    chat = Chat(model, tok, ChatTemplate(), sample, max_new_tokens=8, system=system,
                notes=notes.append)
    return chat, prompts, notes


def test_turns_reset_and_exit():
    chat, prompts, notes = fake_chat(block_size=256, system="Be brief.")
    written = []
    converse(chat, ["Hi\n", "Again\n", "/reset\n", "New\n", "/exit\n", "never\n"],
             written.append)
    assert "".join(written) == "ok\nok\nok\n"  # the end token and what follows are not printed
    assert prompts == ["System: Be brief.\nUser: Hi\nAssistant: ",
                       "System: Be brief.\nUser: Hi\nAssistant: ok<|endoftext|>\nUser: Again\n"
                       "Assistant: ",
                       "System: Be brief.\nUser: New\nAssistant: "]
    assert notes == ["(a new conversation)"]


def test_a_long_conversation_drops_its_oldest_turns_keeping_the_system_message():
    chat, prompts, notes = fake_chat(block_size=64, system="S")
    converse(chat, ["one\n", "two\n", "three\n"], lambda text: None)
    assert prompts[-1].startswith("System: S\nUser: t") and "one" not in prompts[-1]
    assert prompts[-1].endswith("User: three\nAssistant: ")
    assert any("oldest message(s) were dropped" in n for n in notes)
    chat.reset()
    with pytest.raises(TemplateError, match="send a shorter one"):
        chat.reply("x" * 80, lambda text: None)
    assert chat.messages == [{"role": "system", "content": "S"}]


def test_generation_stops_once_every_row_sampled_a_stop_id():
    torch.manual_seed(0)
    model = GPT(tiny_model_config(vocab_size=37, block_size=32)).eval()
    idx = torch.randint(0, 37, (1, 4))
    full = generate_tokens(model, idx, 20, temperature=0)[0, 4:].tolist()
    stop = full[5]
    cut = generate_tokens(model, idx, 20, temperature=0, stop_ids={stop})[0, 4:].tolist()
    assert cut == full[:full.index(stop) + 1]


@pytest.mark.skipif(not sys.stdin or sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_terminal_session(chat_ckpt):
    path, _, _ = chat_ckpt
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "generate.py", "--checkpoint", str(path), "--chat",
                             "--temperature=0", "--max_new_tokens=10", "--device=cpu"],
                            cwd=ROOT, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    seen = b""

    def read_until_prompts(n: int, timeout: float = 60) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(b"you> ") < n and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:
                    return

    read_until_prompts(1)
    os.write(leader, b"Hi\n")
    read_until_prompts(2)  # the reply, then the next prompt
    os.write(leader, b"/exit\n")
    assert proc.wait(timeout=60) == 0
    os.close(leader)
    assert b"/reset starts over" in seen and seen.count(b"you> ") >= 2
