"""Generate a tiny, random, fully local chat model for end-to-end tests and the demo.

No model weights can be downloaded on the machines this project runs on, yet the proxy has to be
tested against a real inference engine. This module writes a directory that vLLM and
transformers load like any Hugging Face checkpoint:

- a byte-level BPE tokenizer trained on generated text about a toy tool-using arithmetic task,
  wrapped as `PreTrainedTokenizerFast`, with a ChatML chat template that renders tools,
  hermes-style `<tool_call>` blocks and tool results;
- a randomly initialised two-layer `Qwen2ForCausalLM` in float32, saved as safetensors.

The weights are random, so the model's output is noise: it exercises token ids, logprobs,
streaming and tool plumbing, never the quality of an answer. The same seed always gives
byte-identical files, so tests can compare token ids across runs and engines.

torch, transformers and tokenizers are imported inside `build_tiny_model` so that importing the
`proxy` package never needs them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# The order fixes the ids: the trainer gives special tokens the first ids, 0 to 4.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)

# vLLM pads vocabularies for its kernels; keeping the embedding a multiple of 64 matches what
# real checkpoints ship and lets the tokenizer's vocabulary grow later without new shapes.
VOCAB_MULTIPLE = 64
# Rotary positions have no weights: the same seed gives the same weights whatever this says,
# and vLLM serves any context up to it (--max-model-len). Real agent CLIs open with 18-49 k-token
# prompts on this 512-token vocabulary, so the model allows far more than the tests need.
MAX_POSITIONS = 131_072
NUM_HEADS = 4
# vLLM's CPU attention has kernels only for some head sizes (32, 64, 80, ..., 256, 512) and
# computes Qwen2's head size as hidden_size / heads, ignoring any `head_dim` in the config.
MIN_HEAD_DIM = 32
CORPUS_SENTENCES = 4000

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# ChatML, written for this module. Assistant tool calls become hermes-style blocks (the format
# vLLM's `hermes` tool parser reads back); `arguments` may arrive as a JSON string (OpenAI wire
# format) or as an object (vLLM parses it before rendering), so both are handled. Content is
# never trimmed: turn N's prompt must stay a textual prefix of turn N+1's.
# transformers renders templates with trim_blocks, which drops a newline right after `%}`; such
# newlines are therefore written as `{{ '\n' }}`, and the source is one line so that no `-`
# whitespace control is needed anywhere.
CHAT_TEMPLATE = (
    "{% set first_is_system = messages and messages[0].role == 'system' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{{ messages[0].content if first_is_system else '" + DEFAULT_SYSTEM_PROMPT + "' }}"
    "\n\n# Tools\n\n"
    "You may call one or more functions. Their signatures are inside <tools></tools>:\n"
    "<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\n"
    "For each call, reply with a JSON object holding the function's name and arguments "
    "inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif first_is_system %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and first_is_system %}"
    "{# Rendered above, merged with the tools when there are any. #}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ fn.name | tojson }}, "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}"
    "{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Plain words of the toy task, so that the trainer finds enough merges to fill the vocabulary:
# digits are split one by one (see the tokenizer below), so numbers alone give almost none.
# (One string split into words reads better here than a list literal of 85 entries.)
_WORDS = (  # noqa: SIM905
    "what is the sum product of and by then tell me answer result please compute calculate "
    "number numbers integer integers value values first second total add added adding multiply "
    "multiplied multiplying plus times equals call calls calling tool tools function functions "
    "name arguments parameters properties required description type object string returned "
    "returns error invalid unknown user assistant system helpful you are I will can could should "
    "let us check again done thanks okay sure here it was not a an to in on with for from"
).split()


def arithmetic_tool(name: str) -> dict[str, Any]:
    """The toy world's tool `name` ("add" or "multiply"), as an OpenAI tool definition."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.capitalize()} two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


def _toy_corpus(rng: random.Random, count: int) -> Iterator[str]:
    """Yield `count` sentences from the toy arithmetic-with-tools world the tests talk about.

    The tokenizer only needs plausible merges, so the text mixes plain questions, the JSON of
    tool calls and results, chat-format fragments and word salad, all with random numbers.
    """
    ops = [("add", "plus", "+"), ("multiply", "times", "*")]
    for _ in range(count):
        a, b = rng.randint(-99, 999), rng.randint(0, 999)
        name, word, sign = rng.choice(ops)
        result = a + b if name == "add" else a * b
        kind = rng.randrange(9)
        if kind == 0:
            yield f"What is {a} {word} {b}?"
        elif kind == 1:
            yield f"Please {name} {a} and {b}, then tell me the answer."
        elif kind == 2:
            arguments = json.dumps({"a": a, "b": b})
            call = f'{{"name": "{name}", "arguments": {arguments}}}'
            yield f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"
        elif kind == 3:
            yield json.dumps({"result": result})
        elif kind == 4:
            yield f"{a} {sign} {b} = {result}. The answer is {result}."
        elif kind == 5:
            yield json.dumps(arithmetic_tool(name))
        elif kind == 6:
            role = rng.choice(["system", "user", "assistant", "tool"])
            yield f"{IM_START}{role}\n{DEFAULT_SYSTEM_PROMPT}{IM_END}\n"
        elif kind == 7:
            yield f"I will call {name} with a={a} and b={b}. The tool returned {result}."
        else:
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            yield " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","])


def build_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """Write a tiny random chat model (tokenizer, config, safetensors weights) to `out_dir`.

    The result loads with transformers' `AutoModelForCausalLM` and `AutoTokenizer` and serves
    with vLLM, whose `hermes` tool-call parser reads its tool calls. The same arguments always
    produce byte-identical files. Returns `out_dir`.

    `vocab_size` is the tokenizer's target: the default 512 is reached exactly, while much
    larger targets stop early when the small corpus runs out of merges (1024 gives about 680).
    The model's embedding is padded up to a multiple of 64, so it may hold a few ids that no
    token has. `hidden_size` must be a multiple of 128: with 4 attention heads that gives a head
    size vLLM's CPU attention has kernels for (a head size of 16 fails at the first request).
    `max_positions` bounds the context vLLM may serve; the weights do not depend on it.
    """
    # Heavy imports stay here: `import proxy` must work in an environment without torch.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size <= 0 or hidden_size % (NUM_HEADS * MIN_HEAD_DIM) != 0:
        raise ValueError(f"hidden_size must be a multiple of 128, got {hidden_size}")
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed 256 bytes plus the specials, got {vocab_size}")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(
        out_dir, seed=seed, vocab_size=vocab_size, max_positions=max_positions
    )

    # --- model -----------------------------------------------------------------------------
    token_count = len(tokenizer)
    padded_vocab = -(-token_count // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = Qwen2Config(
        vocab_size=padded_vocab,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        # Qwen2 has no BOS in its prompts; like Qwen's own configs, BOS names <|endoftext|>.
        bos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        dtype="float32",
    )
    save_quietly(seeded_model(Qwen2ForCausalLM, config, seed), out_dir)
    return out_dir


def reweighted_copy(model_dir: Path, out_dir: Path, *, seed: int) -> Path:
    """A copy of a generated model (tokenizer and config alike) with other random weights:
    a second policy sharing the first one's tokenizer (a teacher for `trajstore.teacher`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, out_dir / path.name)
    config = AutoConfig.from_pretrained(model_dir)
    save_quietly(seeded_model(AutoModelForCausalLM.from_config, config, seed), out_dir)
    return out_dir


def moved_policy(model_dir: Path, out_dir: Path) -> Path:
    """A second checkpoint of a generated model: every weight of `model_dir`'s moved by seeded
    noise (what a trainer's step gives), its tokenizer alongside; a policy to switch to."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def build_tiny_moe(out_dir: Path, *, seed: int = 0, experts: int = 8, top_k: int = 2) -> Path:
    """A tiny Qwen3-MoE-shaped chat model (2 MoE layers of `experts` experts, top-`top_k`)
    with the generated tokenizer of `seed`: for routing replay (`trainer.routing`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir, seed=seed, vocab_size=512, max_positions=MAX_POSITIONS)
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a config attribute
        vocab_size=-(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=NUM_HEADS, num_key_value_heads=2,
        head_dim=128 // NUM_HEADS, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT), eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT), dtype="float32",
    )  # fmt: skip
    save_quietly(seeded_model(Qwen3MoeForCausalLM, config, seed), out_dir)
    return out_dir


def seeded_model(model_class: Any, config: Any, seed: int) -> Any:
    """`model_class(config)` with random weights that depend on `seed` alone.

    fork_rng restores the caller's global torch RNG afterwards: seeding here must not change
    the random stream of whatever test or program calls us. Parameters are created in torch's
    default dtype, which a caller may have changed; initialising in float32 keeps the files
    identical whatever it is.
    """
    import torch

    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            return model_class(config)
        finally:
            torch.set_default_dtype(default_dtype)


def build_tokenizer(
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    max_positions: int = MAX_POSITIONS,
    specials: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """Train the tiny byte-level BPE tokenizer and save it (with `chat_template`) to `out_dir`.

    `specials` get the first ids, in order; they must start with `SPECIAL_TOKENS` (a vision
    model adds its image tokens after them). Returns the `PreTrainedTokenizerFast`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if specials[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
        raise ValueError("specials must start with SPECIAL_TOKENS")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Byte-level BPE with Qwen2's normalizer and pre-tokenizer. transformers 5's AutoTokenizer
    # (which vLLM uses) loads any `model_type: qwen2` checkpoint as Qwen2Tokenizer whatever
    # tokenizer_config.json says, and that class rebuilds the pipeline from vocab and merges with
    # its own NFC + regex split. Training with the same pipeline makes tokenizer.json, the
    # generic fast class and Qwen2Tokenizer encode every string identically. The regex is taken
    # from transformers rather than restated so the two cannot drift apart.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        # All 256 bytes, so any UTF-8 text (and any id sequence decoded back) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # A private Random keeps the corpus a function of `seed` alone, whatever else uses `random`.
    corpus = list(_toy_corpus(random.Random(seed), CORPUS_SENTENCES))
    bpe.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    # The config below names special tokens by position in SPECIAL_TOKENS; fail loudly if a
    # tokenizers release ever stops giving them the first ids in order.
    for expected_id, token in enumerate(specials):
        if bpe.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} got id {bpe.token_to_id(token)}, not {expected_id}")

    # transformers leaves these constructors unannotated; "unused-ignore" keeps the comment
    # harmless where mypy runs without transformers installed.
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, TOOL_CALL_START, TOOL_CALL_END, *specials[5:]],
        model_max_length=max_positions,
        chat_template=chat_template,
    )
    tokenizer.save_pretrained(out_dir)
    _make_tokenizer_config_portable(out_dir)
    return tokenizer


def save_quietly(model: Any, out_dir: Path) -> None:
    """`model.save_pretrained(out_dir)` without its progress bar (the global switch restored)."""
    from transformers.utils import logging as hf_logging

    # save_pretrained draws a progress bar for one tiny shard; keep test output clean, and put
    # the global switch back as it was.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        model.save_pretrained(out_dir)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call,unused-ignore]


def _make_tokenizer_config_portable(out_dir: Path) -> None:
    """Rewrite the saved tokenizer_config.json so transformers 4 and 5 both load it alike.

    transformers 5 writes a class name, an `extra_special_tokens` list and a separate
    chat_template.jinja that older loaders do not understand. The generic fast class, the
    `additional_special_tokens` key and a `chat_template` entry load everywhere, and keep the
    template in one place.
    """
    config_path = out_dir / "tokenizer_config.json"
    template_path = out_dir / "chat_template.jinja"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    if template_path.exists():
        config["chat_template"] = template_path.read_text(encoding="utf-8")
        template_path.unlink()
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")


def main(argv: list[str] | None = None) -> None:
    """Command line: `python -m proxy.tiny_model OUT_DIR [--seed N] [--vocab-size N] ...`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--max-positions", type=int, default=MAX_POSITIONS)
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir, seed=args.seed, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        max_positions=args.max_positions,
    )  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()
