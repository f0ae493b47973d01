"""`pyinfer chat` end to end: the real REPL through a pseudo-terminal (pexpect), the scripted mode, the
context limit and the one-line errors. Content checks use the real default model (SmolLM2-135M-Instruct) at
temperature 0; everything else a tiny random checkpoint, so the file stays fast."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.apps.chat import REPEAT_PERIOD
from pyinfer.hub.pull import SMALLEST_MODEL, pull

REPO = Path(__file__).resolve().parents[1]
PROMPT = "\n> "  # the REPL's prompt, at the start of a line
CONCISE = "You are a concise assistant. Answer in one sentence."
WORDS = "the quick brown fox jumps over the lazy dog sphinx of black quartz judge my vow".split()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from hf_tiny import build

    folder = tmp_path_factory.mktemp("tiny") / "hf"
    build("llama_silu", str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder) -> Path:
    from pyinfer.converters.convert_hf_to_powergguf import convert

    out = tiny_folder.parent / "tiny.gguf"
    convert(str(tiny_folder), str(out), outtype="f32")
    return out


@pytest.fixture(scope="module")
def smollm() -> Path:
    return pull(SMALLEST_MODEL, progress=False)


@pytest.fixture
def env(tmp_path) -> dict:
    """A private cache (readline history, converted checkpoints) and a terminal without escape codes."""
    return dict(os.environ, PYINFER_CACHE=str(tmp_path / "cache"), TERM="dumb")


def chat_args(model: Path, *extra: str) -> list[str]:
    return ["-m", "pyinfer", "chat", "-m", str(model), "--temp", "0", "-t", "2", *extra]


def spawn(env: dict, model: Path, *extra: str) -> pexpect.spawn:
    # a runner that starts the suite in the background leaves SIGINT ignored, and children inherit that:
    # a user's terminal delivers it, so the child gets the default back
    child = pexpect.spawn(sys.executable, chat_args(model, *extra), cwd=REPO, env=env, encoding="utf-8",
                          codec_errors="replace",  # the terminal echoes what is typed, invalid UTF-8 too
                          timeout=90, dimensions=(50, 4000),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect(PROMPT)
    return child


def say(child: pexpect.spawn, text: str) -> str:
    """Sends one line; returns what the REPL printed before the next prompt (echo removed)."""
    child.sendline(text)
    child.expect(PROMPT)
    out = child.before.replace("\r\n", "\n")
    echo, _, rest = out.partition("\n")
    assert echo == text.split("\n")[-1]
    return rest


def exit_status(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    assert child.signalstatus is None
    return child.exitstatus


def scripted(env: dict, model: Path, lines: list[str], *extra: str) -> subprocess.CompletedProcess:
    """stdin is a pipe, not a TTY: one message per line. Bytes, so "\\r" in random answers survives."""
    return subprocess.run([sys.executable, *chat_args(model, *extra)], cwd=REPO, env=env, capture_output=True,
                          input="".join(line + "\n" for line in lines).encode(), timeout=120)


# ---- the real model: content ----

def test_conversation_reset_save_load(smollm, env, tmp_path):
    child = spawn(env, smollm, "-sys", CONCISE, "-c", "1024", "-n", "48")
    assert "Paris" in say(child, "What is the capital of France?")
    assert "Seine" in say(child, "What river flows through it?")  # "it" is Paris: needs the first turn
    stats = say(child, "/stats")
    assert "2 turns, 4 messages kept" in stats and "context 0/" not in stats
    saved = tmp_path / "conv.json"
    assert f"[saved 4 messages to {saved}]" in say(child, f"/save {saved}")
    data = json.loads(saved.read_text(encoding="utf-8"))
    assert data["system"] == CONCISE
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"] * 2
    assert data["messages"][0]["content"] == "What is the capital of France?"
    assert "Paris" in data["messages"][1]["content"] and "Seine" in data["messages"][3]["content"]

    assert "[conversation cleared]" in say(child, "/reset")
    assert "0 messages kept" in say(child, "/stats")
    assert "Seine" not in say(child, "What river flows through it?")  # no Paris to refer to any more
    say(child, "/reset")
    assert f"[loaded 4 messages from {saved}]" in say(child, f"/load {saved}")
    assert "Paris" in say(child, "What is the most famous tower there?")  # "there" comes from the file
    child.sendeof()  # Ctrl-D
    assert exit_status(child) == 0


def test_ctrl_c_stops_an_answer_and_the_session_goes_on(smollm, env):
    child = spawn(env, smollm, "-sys", "You are a helpful assistant.", "-c", "1024")
    child.sendline("Count from 1 to 300, separated by commas.")
    child.expect(r"(\d+\D+){4}")  # the answer is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(PROMPT)
    assert "Paris" in say(child, "What is the capital of France?")
    child.sendintr()  # Ctrl-C at an empty prompt leaves
    assert exit_status(child) == 0


# ---- the REPL on a tiny random model ----

def test_slash_commands_and_their_errors(tiny, env, tmp_path):
    child = spawn(env, tiny, "-c", "512", "-n", "4")
    assert "/save FILE" in say(child, "/help")
    assert say(child, "/frobnicate now").strip() == "error: unknown command /frobnicate (try /help)"
    assert say(child, f"/load {tmp_path / 'none.json'}").strip().startswith("error: cannot load")
    assert say(child, f"/save {tmp_path / 'no' / 'dir.json'}").strip().startswith("error: cannot save")
    assert say(child, "/save").strip() == "error: /save needs a file name"
    child.send("typed but not sent")
    child.expect("typed but not sent")
    child.sendintr()  # Ctrl-C with text on the line drops the text, not the session
    child.expect(PROMPT)
    assert "[system prompt set; conversation cleared]" in say(child, "/system Be brief.")
    say(child, "gamma")
    out = tmp_path / "c.json"
    say(child, f"/save {out}")
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["system"] == "Be brief." and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "gamma"
    say(child, "/reset")
    assert "[loaded 2 messages" in say(child, f"/load {out}")
    say(child, "delta")  # the loaded conversation continues
    out2 = tmp_path / "c2.json"
    say(child, f"/save {out2}")
    data2 = json.loads(out2.read_text(encoding="utf-8"))
    assert data2["messages"][:2] == data["messages"] and data2["messages"][2]["content"] == "delta"
    child.sendline("/exit")
    assert exit_status(child) == 0


def test_multiline_message_is_one_turn(tiny, env, tmp_path):
    child = spawn(env, tiny, "-c", "512", "-n", "4")
    child.sendline("alpha \\")
    child.expect(r"\n\. ")
    say(child, "beta")
    say(child, f"/save {tmp_path / 'm.json'}")
    messages = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))["messages"]
    assert messages[0] == {"role": "user", "content": "alpha \nbeta"} and len(messages) == 2
    child.sendeof()
    assert exit_status(child) == 0


def test_context_full_drops_oldest_turns_with_a_notice(tiny, env):
    child = spawn(env, tiny, "-c", "160", "-n", "24")
    notices = 0
    for i in range(8):
        out = say(child, " ".join(WORDS[i:] + WORDS[:i]))
        assert "error" not in out and "Traceback" not in out
        notices += "[context full: dropped the oldest turn" in out
        stats = say(child, "/stats")
        used = int(stats.split("context ")[1].split("/")[0])
        assert 0 < used <= 160
    assert notices >= 3
    kept = say(child, "/stats").split(" messages kept")[0].rsplit(" ", 1)[1]
    out = say(child, " ".join(WORDS * 12))  # longer than the whole context on its own
    assert out.strip().startswith("error: message too long") and len(out.strip().splitlines()) == 1
    assert f"{kept} messages kept" in say(child, "/stats")  # nothing was dropped for it
    assert "error" not in say(child, "still here")
    child.sendline("/exit")
    assert exit_status(child) == 0


def test_runaway_answer_ends_with_a_notice(smollm, env):
    """-n -1: a looping answer stops soon (a repeat penalty below 1 makes any model loop), and one that
    fills the context says so."""
    res = scripted(env, smollm, ["Tell me about France."], "--json", "--repeat-penalty", "0.1", "-c", "4096")
    turn = json.loads(res.stdout.decode())
    assert turn["ending"] == "repeat" and turn["generated_tokens"] < 400, turn
    assert "[answer stopped: it kept repeating itself]" in res.stderr.decode()
    res = scripted(env, smollm, ["Write a long story about a dragon and a knight."], "--json", "-c", "96")
    turn = json.loads(res.stdout.decode())
    assert turn["ending"] == "context" and turn["prompt_tokens"] + turn["generated_tokens"] == 96, turn
    assert "[answer cut: the context is full" in res.stderr.decode()


@given(st.lists(st.integers(0, 50), min_size=1, max_size=REPEAT_PERIOD, unique=True), st.integers(0, 40),
       st.lists(st.integers(51, 99), max_size=20))
def test_repeats_itself_finds_loops_and_only_loops(piece, extra, head):
    from pyinfer.apps.chat import REPEAT_MIN_TOKENS, REPEAT_TIMES, repeats_itself

    times = max(REPEAT_TIMES, -(-REPEAT_MIN_TOKENS // len(piece)))  # enough whole pieces to count
    assert repeats_itself(head + piece * (times + extra // len(piece)))
    assert repeats_itself(head + piece[1:] + piece * times)  # a loop may start anywhere in its piece
    assert not repeats_itself(head + piece * times + [100])  # the loop was broken
    assert not repeats_itself(piece * (times - 1))  # one piece too few
    assert not repeats_itself(list(range(200)))


# ---- scripted mode ----

def test_scripted_json_reuses_the_kv_cache(tiny, env):
    from pyinfer.apps.chat import ChatSession
    from pyinfer.engine.driver import Model
    from pyinfer.engine.sampling import SamplerParams

    lines = ["the quick brown fox", "judge my vow", "sphinx of black quartz"]
    res = scripted(env, tiny, lines, "--json", "-c", "512", "-n", "12", "--kv-type", "f32")
    assert res.returncode == 0, res.stderr
    turns = [json.loads(line) for line in res.stdout.decode().splitlines()]
    assert [t["user"] for t in turns] == lines
    for t in turns:
        assert set(t) == {"user", "assistant", "prompt_tokens", "cached_tokens", "generated_tokens", "prompt_ms",
                          "generation_ms", "tokens_per_second", "dropped_turns", "ending"}
        assert 0 <= t["generated_tokens"] <= 12 and t["dropped_turns"] == 0 and t["prompt_ms"] > 0
    assert turns[-1]["generated_tokens"] > 0
    assert turns[0]["cached_tokens"] == 0
    # the whole first prompt (everything up to the answer) is reused, only the rest is processed
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"] and turns[2]["cached_tokens"] > 0

    # oracle: the last answer computed from an empty cache is the same
    session = ChatSession(Model(tiny, n_ctx=512, n_threads=2, kv_type="f32"), params=SamplerParams(temperature=0),
                          n_predict=12)
    for t in turns[:-1]:
        session.messages += [{"role": "user", "content": t["user"]}, {"role": "assistant", "content": t["assistant"]}]
    assert session.reply(lines[-1]) == turns[-1]["assistant"]
    assert session.last.cached_tokens == 0

    plain = scripted(env, tiny, lines, "-c", "512", "-n", "12", "--kv-type", "f32")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.decode() == "".join(t["assistant"] + "\n" for t in turns)


def test_scripted_context_limit_and_too_long_message(tiny, env):
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(6)] + [" ".join(WORDS * 12), "/stats", "still here"]
    res = scripted(env, tiny, lines, "--json", "-c", "160", "-n", "24")
    err = res.stderr.decode()
    assert res.returncode == 0 and "Traceback" not in err
    turns = [json.loads(line) for line in res.stdout.decode().splitlines()]  # /stats went to stderr
    assert [t["user"] for t in turns] == lines[:6] + ["still here"]
    assert sum(t["dropped_turns"] > 0 for t in turns) >= 2
    assert "[context full: dropped the oldest turn" in err
    assert sum(line.startswith("error: message too long") for line in err.splitlines()) == 1
    assert "last answer:" in err


def test_hf_folder_is_converted_into_the_cache(tiny_folder, env):
    res = scripted(env, tiny_folder, ["hello"], "--json", "-c", "256", "-n", "4")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.decode().splitlines()) == 1
    assert len(list((Path(env["PYINFER_CACHE"]) / "converted").glob("*.powergguf"))) == 1


# ---- errors: one line, exit status 1 ----

@pytest.mark.parametrize("what", ["missing", "garbage", "template"])
def test_bad_model_or_template_is_one_line(what, tiny, env, tmp_path):
    model, extra = tmp_path / "missing.gguf", []
    if what == "garbage":
        model = tmp_path / "x.gguf"
        model.write_bytes(os.urandom(1024))
    elif what == "template":
        model, extra = tiny, ["--chat-template-file", str(tmp_path / "nope.jinja")]
    res = scripted(env, model, ["hello"], *extra)
    err = res.stderr.decode().strip()
    assert res.returncode == 1 and res.stdout == b""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err
    assert {"missing": "missing.gguf", "garbage": "not a valid GGUF", "template": "nope.jinja"}[what] in err


# ---- issue 14: a line that is not UTF-8 is one error line, and the session goes on ----

def test_scripted_line_not_utf8_is_reported_and_skipped(tiny, env):
    res = subprocess.run([sys.executable, *chat_args(tiny, "-n", "4")], cwd=REPO, env=env, capture_output=True,
                         input=b"caf\xe9 au lait\nhello\n", timeout=120)
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "error: line 1 is not valid UTF-8 text (byte 0xe9 at character 3)" in err and "Traceback" not in err
    assert res.stdout.count(b"\n") == 1  # the second line was answered (a random answer may hold other breaks)


def test_repl_line_not_utf8_is_reported_and_skipped(tiny, env):
    child = spawn(env, tiny, "-n", "4")
    os.write(child.child_fd, b"\xff\xfe hi\n")
    child.expect("error: the line is not valid UTF-8 text")
    child.expect(PROMPT)
    say(child, "hello")
    child.sendeof()
    assert exit_status(child) == 0
