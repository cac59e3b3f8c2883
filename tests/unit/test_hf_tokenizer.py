"""A model folder's tokenizer (kvstore.conductor.hf_tokenizer) and chat templates
(kvstore.conductor.chat_template): round trips, incremental decoding equal to the
full decode, template rendering against transformers, and the errors (no network)."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("tokenizers")

from hf_folder import CHAT_TEMPLATE, SENTENCES, write_tokenizer
from kvstore.conductor.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate
from kvstore.conductor.hf_tokenizer import HfTokenizer, TokenizerError
from kvstore.conductor.tokenizer import ByteTokenizer, load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello! How are you? ☕"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(folder):
    return HfTokenizer.from_folder(folder)


@pytest.mark.parametrize("text", ["", "plain ascii", "café ☕ 日本語 🚀", "  two  spaces\n\ttab",
                                  "words the tokenizer never saw: zyzzyva qwxj"])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id          # add_bos_token
    assert tok.decode(ids) == text             # BOS is special: skipped


def test_special_tokens_and_stops(tok, folder):
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.stop_token_ids == (tok.eos_token_id,)
    assert tok.vocab_size == 400
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1, 9]}))
    try:
        with_gen = HfTokenizer.from_folder(folder, vocab_size=512)
    finally:
        (folder / "generation_config.json").unlink()
    assert with_gen.stop_token_ids == (tok.eos_token_id, 7, 9)
    assert with_gen.vocab_size == 512            # the model's, when given


def test_add_bos_token_decides_when_set(tmp_path):
    write_tokenizer(tmp_path, add_bos_token=False)
    t = HfTokenizer.from_folder(tmp_path)
    assert t.bos_token_id not in t.encode("The quick brown fox")
    write_tokenizer(tmp_path, add_bos_token=None, add_eos_token=None)   # the post-processor's
    t = HfTokenizer.from_folder(tmp_path)
    assert t.encode("fox")[0] == t.bos_token_id


def _check_stream(tok, ids, rng):
    d = tok.stream_decoder()
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice((1, 1, 1, 2, 3))
        pieces.append(d.feed(ids[i:i + n]))
        i += n
    released = "".join(pieces)
    pieces.append(d.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert tok.decode(ids).startswith(released)     # no correction was needed at the end
    return pieces


def test_stream_decoder_equals_full_decode(tok):
    rng = random.Random(5)
    for text in SENTENCES + ["🚀🚀 ☕"]:
        pieces = _check_stream(tok, tok.encode(text), rng)
        assert not any("\ufffd" in p for p in pieces)    # never half a character
    for _ in range(200):       # arbitrary ids: specials, half characters, invalid bytes
        _check_stream(tok, [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))],
                      rng)
    d = tok.stream_decoder()
    emoji = tok.encode("🚀")[1:]
    assert len(emoji) > 1 and [d.feed([t]) for t in emoji][:-1] == [""] * (len(emoji) - 1)
    d.flush()
    assert d.feed(tok.encode("ok")) + d.flush() == "ok"      # starts over after flush


def test_stream_decoder_with_sentencepiece_style_decoders(tmp_path):
    """Llama-2 style: Metaspace spaces, byte fallback, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "<0xE2>": 4, "<0x98>": 5,
             "<0x95>": 6, "▁": 7}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t = HfTokenizer(raw, {"unk_token": "<unk>"})
    ids = [1, 2, 3, 7, 4, 5, 6, 2, 1]
    assert t.decode(ids) == "hello world! ☕ world hello"
    rng = random.Random(1)
    for _ in range(100):
        _check_stream(t, [rng.choice(range(1, 8)) for _ in range(rng.randrange(1, 20))], rng)
    assert [t.stream_decoder().feed(ids[:k])[-1:] for k in (1, 5, 6)] == ["o", "", ""]


def test_chat_prompt_equals_transformers(tok, folder):
    transformers = pytest.importorskip("transformers")
    ht = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = tok.chat_prompt(MESSAGES)
    theirs = ht.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    assert tok.encode(SENTENCES[1]) == ht(SENTENCES[1])["input_ids"]
    assert tok.chat_template.render(MESSAGES, add_generation_prompt=False) == \
        ht.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)


def test_template_rendering():
    t = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    assert t.render(MESSAGES[1:]) == "<s><|user|>\nHello! How are you? ☕</s>\n<|assistant|>\n"
    assert t.render(MESSAGES[1:], add_generation_prompt=False).endswith("</s>\n")
    with pytest.raises(ChatTemplateError, match="unsupported role tool"):
        t.render([{"role": "tool", "content": "x"}])
    js = ChatTemplate("{% for m in messages %}{{ m | tojson }}{% if loop.index == 1 %}"
                      "{% break %}{% endif %}{% endfor %}")
    assert js.render([{"role": "user", "content": "é<&>"}, {"role": "user", "content": "b"}]) \
        == '{"role": "user", "content": "é<&>"}'
    assert ChatTemplate("{{ bos_token }}|{{ tools is none }}").render([]) == "|True"


@pytest.mark.parametrize("source, match", [
    ("{{ messages.__class__.__mro__ }}", "failed"),              # the sandbox
    ("{{ ''.__class__.__subclasses__() }}", "failed"),
    ("{% set _ = messages.append(1) %}", "failed"),              # immutable
    ("{{ messages[0].content.upper() }}{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10) %}{{ 'x' * 1000000 }}{% endfor %}", "rendered over"),
])
def test_template_sandbox_and_limits(source, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source).render([{"role": "user", "content": "a"}])


def test_template_that_does_not_compile():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_folder_errors(tmp_path):
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        HfTokenizer.from_folder(tmp_path)
    write_tokenizer(tmp_path, eos_token="<|not-a-token|>")
    with pytest.raises(TokenizerError, match="eos_token '<|not-a-token|>' is not in the vocab"):
        HfTokenizer.from_folder(tmp_path)
    write_tokenizer(tmp_path, chat_template="{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        HfTokenizer.from_folder(tmp_path)
    write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(TokenizerError, match="eos_token_id"):
        HfTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        HfTokenizer.from_folder(tmp_path)


def test_no_chat_template(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    t = HfTokenizer.from_folder(tmp_path)
    with pytest.raises(NoChatTemplate, match="no chat template"):
        t.chat_prompt(MESSAGES)
    with pytest.raises(NoChatTemplate):
        ByteTokenizer(256).chat_prompt(MESSAGES)


def test_template_beside_the_config(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert HfTokenizer.from_folder(tmp_path).chat_template.render(MESSAGES) == "Be brief.!"
    write_tokenizer(tmp_path, chat_template=[{"name": "default", "template": "D"},
                                             {"name": "tool_use", "template": "T"}])
    assert HfTokenizer.from_folder(tmp_path).chat_template.render(MESSAGES) == "D"


def test_lone_surrogate_is_a_unicode_error(tok):
    with pytest.raises(UnicodeEncodeError):
        tok.encode("a\ud800")
    with pytest.raises(UnicodeEncodeError):
        tok.chat_prompt([{"role": "user", "content": "\udfff"}])


def test_load_tokenizer_choices(folder, tmp_path):
    assert isinstance(load_tokenizer("tiny", "", 2048), ByteTokenizer)
    assert isinstance(load_tokenizer(str(folder), "byte", 2048), ByteTokenizer)
    assert isinstance(load_tokenizer(str(folder), "", 400), HfTokenizer)
    assert isinstance(load_tokenizer("tiny", str(folder), 2048), HfTokenizer)
    with pytest.raises(TokenizerError, match="--tokenizer byte"):
        load_tokenizer(str(tmp_path), "", 400)
