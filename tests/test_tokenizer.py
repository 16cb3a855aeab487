"""The character tokenizer, ChatML prompt formats and tokenizer.json round trips."""
import pytest

from looprl.errors import ConfigError, TaskError
from looprl.tokenizer import (CHAR_TOKENIZER_CHARS, END_OF_TURN_ID, build_char_tokenizer,
                              chat_prompt, load_tokenizer, tokenizer_from_json)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_special_ids_match_ouro(tok):
    assert [tok.tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.end_of_turn_id == END_OF_TURN_ID == 2
    assert tok.pad_id == 0


def test_vocab_fits_the_tiny_model(tok):
    assert tok.vocab_size == 4 + len(CHAR_TOKENIZER_CHARS) == 58
    assert tok.vocab_size <= 64


def test_one_id_per_character_and_specials_in_text(tok):
    ids = tok.encode("<|im_start|>12 + 3<|im_end|><|im_start|>= 15<|im_end|>")
    digit = lambda c: tok.tokenizer.token_to_id(c)
    assert ids == [1, digit("1"), digit("2"), digit(" "), digit("+"), digit(" "), digit("3"), 2,
                   1, digit("="), digit(" "), digit("1"), digit("5"), 2]


@pytest.mark.parametrize("text", ["12 + 7 - 3", "= 19 - 3 = 16", "a\nb  c", "(4 * 5) / 2 = 10",
                                  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_unknown_character_is_an_error_not_dropped(tok):
    with pytest.raises(TaskError, match="'H'"):
        tok.encode("Hello")
    assert tok.encode("Hello", strict=False)[0] == tok.unk_id == 3


def test_decode_completion_stops_at_end_of_turn(tok):
    ids = tok.encode("= 16<|im_end|>= 99")
    assert tok.decode_completion(ids) == "= 16"
    assert tok.decode_completion(tok.encode("= 16")) == "= 16"


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path)  # a directory holding tokenizer.json
    text = "<|im_start|>83 + 71<|im_end|><|im_start|>= 154<|im_end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.end_of_turn_id == 2
    assert tokenizer_from_json(tok.to_json()).encode(text) == tok.encode(text)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(bad)


def test_chat_prompt_formats():
    assert chat_prompt("q") == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt("q", "thinking") == ("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
                                            "<think>\n")
    assert chat_prompt("q", "compact") == "<|im_start|>q<|im_end|><|im_start|>"
    with pytest.raises(ConfigError, match="prompt style"):
        chat_prompt("q", "alpaca")


def test_chatml_prompt_ids(tok):
    ids = tok.encode(chat_prompt("1 + 2", "thinking"))
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n")
