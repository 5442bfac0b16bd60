"""Random prompts of about N tokens for the served model, without a local tokenizer.

Two forms (chosen by `sits.bench.probe.plan_prompts`):
- token ids (for /v1/completions, which accepts a list of token ids as the prompt): the
  server's /tokenize turns `WORDS` into ids once; each prompt is N ids drawn uniformly from
  that pool. The prompt has exactly N tokens, contains no special tokens (the pool comes from
  plain words tokenized without them), and random draws make shared prefixes vanishingly rare,
  so the prefix cache does not flatter the numbers.
- text (for /v1/chat/completions, or a server without /tokenize): N' random words from `WORDS`
  joined by spaces, where N' = round((N - overhead) / tokens_per_word) is calibrated on the
  server itself from the `usage.prompt_tokens` of two probe requests (which includes a chat
  template's tokens in `overhead`). The prompt then has about N tokens.
Draws come from the `random.Random` the caller passes (seeded), in schedule order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common English words (one token each in most vocabularies when preceded by a space).
_WORDS_TEXT = """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education foot boy age policy music market sense nation plan college interest death
    experience effect use class control care field development role effort rate heart drug
    show leader light voice wife police mind price report decision son view relationship town
    road arm difference value building action model season society tax director position
    player record paper space ground form event official matter center couple site project
    activity star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie north love
    support technology step baby computer type attention film tree source organization hair
    window evidence population shot range rock river garden green small large early young
    important few public bad same able black white short open simple whole free hard clear
"""
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True, slots=True)
class TokenIdPrompts:
    """Prompts of exactly N token ids drawn from `pool`.

    Attributes:
        pool: distinct token ids of ordinary text (no special tokens), sorted.
    """

    pool: tuple[int, ...]

    mode = "token_ids"

    def make(self, num_tokens: int, rng: random.Random) -> list[int]:
        """A prompt of `num_tokens` ids (> 0) drawn uniformly from the pool."""
        return [self.pool[rng.randrange(len(self.pool))] for _ in range(num_tokens)]

    def describe(self) -> dict[str, object]:
        """What the report records about the prompts."""
        return {"mode": self.mode, "pool_size": len(self.pool)}


@dataclass(frozen=True, slots=True)
class TextPrompts:
    """Text prompts of random words sized by a linear model of the server's token count.

    Attributes:
        tokens_per_word: prompt tokens added per word (> 0), measured on the server.
        overhead_tokens: prompt tokens with no words (template, BOS), measured too.
        calibrated: False when the server reported no usage and a guess is used instead.
    """

    tokens_per_word: float
    overhead_tokens: float
    calibrated: bool = True

    mode = "text"

    def num_words(self, num_tokens: int) -> int:
        """Words needed for a prompt of about `num_tokens` tokens (at least 1)."""
        return max(1, round((num_tokens - self.overhead_tokens) / self.tokens_per_word))

    def make(self, num_tokens: int, rng: random.Random) -> str:
        """A prompt of about `num_tokens` tokens: random words joined by spaces."""
        return random_words(self.num_words(num_tokens), rng)

    def describe(self) -> dict[str, object]:
        """What the report records about the prompts."""
        return {
            "mode": self.mode,
            "tokens_per_word": round(self.tokens_per_word, 4),
            "overhead_tokens": round(self.overhead_tokens, 2),
            "calibrated": self.calibrated,
        }


def random_words(num_words: int, rng: random.Random) -> str:
    """`num_words` random words from `WORDS` joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))
