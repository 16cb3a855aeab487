"""Tokenizers: HF `tokenizer.json` loading, the tiny character-level task tokenizer, ChatML prompts.

Every looprl checkpoint carries a `tokenizer.json` in the HF `tokenizers` format (DESIGN.md §2),
for the real Ouro models (SmolLM2 byte-level BPE) and for the tiny task models alike. Both share
Ouro's special ids, which the sampler and the prompt formats rely on:

    0 `<|endoftext|>` (padding)   1 `<|im_start|>`   2 `<|im_end|>` (end of turn: stops sampling)

Some shipped Ouro configs wrongly say bos = eos = pad = 0; the end of turn is id 2, and
`TextTokenizer` takes it from the vocabulary (`<|im_end|>`) unless overridden.

ChatML prompts (Ouro's chat template, no default system prompt):

    chatml:   `<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`
    thinking: the same, followed by `<think>\\n` (Ouro-*-Thinking models)
    compact:  `<|im_start|>{text}<|im_end|><|im_start|>` (tiny models only: the ChatML markers,
              ids 1 and 2, without the role names, so a short prompt costs 3 tokens of framing)

The character tokenizer (`build_char_tokenizer`) maps each character of `CHAR_TOKENIZER_CHARS` to
one id after the four specials (`<unk>` at 3): 58 ids, so it fits the tiny model's vocab of 64.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models

from looprl.errors import ConfigError, TaskError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
END_OF_TURN_ID = IM_END_ID
PAD_ID = ENDOFTEXT_ID
THINK_OPEN = "<think>\n"

PROMPT_STYLES = ("chatml", "thinking", "compact")

# The tiny tokenizer's characters, in id order from 4 (changing the order changes the ids of a
# saved checkpoint's tokenizer.json, which stays valid because it travels with the checkpoint).
CHAR_TOKENIZER_CHARS = ("\n !$%()*+,-./0123456789:<=>?" + "abcdefghijklmnopqrstuvwxyz")
_CHAR_SPECIALS = (ENDOFTEXT, IM_START, IM_END, UNK)


def chat_prompt(user_text: str, style: str = "chatml") -> str:
    """Return `user_text` framed as one ChatML user turn plus the assistant's generation prompt.

    Args:
      user_text: the user's message (no special tokens inside).
      style: `chatml` (Ouro instruct models), `thinking` (Ouro Thinking models: ends with
        `<|im_start|>assistant\\n<think>\\n`) or `compact` (tiny task models; see module doc).
    Raises:
      ConfigError: unknown style.
    """
    if style == "chatml":
        return f"{IM_START}user\n{user_text}{IM_END}\n{IM_START}assistant\n"
    if style == "thinking":
        return f"{IM_START}user\n{user_text}{IM_END}\n{IM_START}assistant\n{THINK_OPEN}"
    if style == "compact":
        return f"{IM_START}{user_text}{IM_END}{IM_START}"
    raise ConfigError(f"prompt style: expected one of {PROMPT_STYLES}, found {style!r}")


class TextTokenizer:
    """A `tokenizers.Tokenizer` with looprl's conventions: no implicit special tokens, strict ids.

    `encode` never adds BOS/EOS (prompts carry their ChatML markers as text, which the tokenizer
    maps to their special ids); `decode` keeps special tokens unless asked to skip them.

    Attributes:
      tokenizer: the wrapped `tokenizers.Tokenizer`.
      end_of_turn_id: id that ends a completion (2, `<|im_end|>`, for Ouro and the tiny models).
      pad_id: id used for padding (0, `<|endoftext|>`).
      vocab_size: number of ids including added tokens.
    """

    def __init__(self, tokenizer, end_of_turn_id: int | None = None, pad_id: int | None = None):
        """Wrap `tokenizer`; `end_of_turn_id`/`pad_id` default to the ids of `<|im_end|>`/`<|endoftext|>`.

        Raises:
          ConfigError: no override is given and the vocabulary lacks the token.
        """
        self.tokenizer = tokenizer
        self.end_of_turn_id = self._special_id(IM_END, end_of_turn_id)
        self.pad_id = self._special_id(ENDOFTEXT, pad_id)
        self.unk_id = tokenizer.token_to_id(UNK)

    def _special_id(self, token: str, override: int | None) -> int:
        if override is not None:
            return int(override)
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ConfigError(f"tokenizer has no {token!r} token; pass its id explicitly")
        return found

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, strict: bool = True) -> list[int]:
        """Return the token ids of `text` (special-token strings map to their ids; nothing added).

        Raises:
          TaskError: `strict` and the text holds characters the vocabulary cannot encode (the
            character tokenizer would map them to `<unk>`); the message names them.
        """
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if strict and self.unk_id is not None and self.unk_id in ids:
            vocab = self.tokenizer.get_vocab()
            plain = text
            for special in (ENDOFTEXT, IM_START, IM_END, UNK):
                plain = plain.replace(special, "")
            bad = sorted({c for c in plain if c not in vocab})
            raise TaskError(f"text holds characters outside the tokenizer's vocabulary: {bad!r} "
                            f"(text {text[:80]!r})")
        return list(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Return the text of `ids` (special tokens kept unless `skip_special_tokens`)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_completion(self, ids: Sequence[int]) -> str:
        """Return the text of a completion: ids up to (excluding) the first end of turn, specials dropped."""
        ids = [int(i) for i in ids]
        if self.end_of_turn_id in ids:
            ids = ids[:ids.index(self.end_of_turn_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as an HF `tokenizer.json` to `path` (a file path)."""
        self.tokenizer.save(os.fspath(path))

    def to_json(self) -> str:
        """Return the HF `tokenizer.json` text."""
        return self.tokenizer.to_str()


def load_tokenizer(path: str | os.PathLike, end_of_turn_id: int | None = None,
                   pad_id: int | None = None) -> TextTokenizer:
    """Load an HF `tokenizer.json` (a file, or a directory holding one) as a `TextTokenizer`.

    Raises:
      ConfigError: the file is missing or is not a valid tokenizer.json, or lacks the end-of-turn
        / pad tokens and no override is given.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer file not found: {path}")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ConfigError(f"{path}: not a valid tokenizer.json ({e})") from e
    return TextTokenizer(tok, end_of_turn_id=end_of_turn_id, pad_id=pad_id)


def tokenizer_from_json(text: str) -> TextTokenizer:
    """Build a `TextTokenizer` from `tokenizer.json` text (as stored in a checkpoint).

    Raises:
      ConfigError: the text is not a valid tokenizer.json.
    """
    try:
        json.loads(text)
        tok = Tokenizer.from_str(text)
    except Exception as e:
        raise ConfigError(f"not a valid tokenizer.json ({e})") from e
    return TextTokenizer(tok)


def build_char_tokenizer(chars: str = CHAR_TOKENIZER_CHARS) -> TextTokenizer:
    """Return the character-level tokenizer: ids 0-3 the specials, then one id per character.

    It is a `tokenizers` BPE model with no merges (so every character is its own token), `<unk>`
    for characters outside `chars`, and a `Fuse` decoder (decode concatenates, no spaces added).

    Raises:
      ConfigError: `chars` repeats a character or contains a special token's text.
    """
    if len(set(chars)) != len(chars):
        raise ConfigError(f"char tokenizer: repeated characters in {chars!r}")
    vocab = {tok: i for i, tok in enumerate(_CHAR_SPECIALS)}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _CHAR_SPECIALS])
    tok.decoder = decoders.Fuse()
    return TextTokenizer(tok)


def coverage_note(tokenizer_json: str, vocab_size: int) -> str | None:
    """None when the tokenizer's ids (added tokens included) number the model's vocabulary
    `vocab_size` (its embedding rows); else one line naming both counts: ids past the
    tokenizer's are sampled but cannot be decoded, ids past the model's cannot be fed to it.
    An invalid `tokenizer_json` gives None (its loading reports it)."""
    try:
        n = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    except Exception:  # tokenizers raises a bare Exception subclass
        return None
    if n < vocab_size:
        return (f"the tokenizer covers {n} ids, the model's vocabulary has {vocab_size}: ids "
                f"{n}..{vocab_size - 1} cannot be decoded (embedding rows no token uses, as "
                f"where a vocabulary is padded to a round size; `generate` shows a sampled one "
                f"as <id N: not in the tokenizer>)")
    if n > vocab_size:
        return (f"the tokenizer has {n} ids, the model's vocabulary only {vocab_size}: ids "
                f"{vocab_size}..{n - 1} cannot be fed to the model")
    return None
