"""Generate a tiny, random, fully local vision-language model (Idefics3 shaped) for tests.

Images go through the proxy to a real engine and come back as samples a trainer rebuilds the
vision inputs of; that needs a model vLLM serves with images, and no weights can be downloaded
here. This module writes one the way `trajstore.tiny_model` writes the text model:

- the same byte-level BPE tokenizer, with Idefics3's image tokens (`<fake_token_around_image>`,
  `<image>`, `<global-img>`, `<end_of_utterance>`) as specials after the text model's;
- a ChatML template that renders each image part as `<image>`, which the engine (and the
  processor) expands to `<fake_token_around_image><global-img>`, `<image>` once per image
  feature (`IMAGE_SEQ_LEN`), then `<fake_token_around_image>`;
- Idefics3's image processor (PIL), set to one 56 x 56 view per image (no tiles), saved with
  the tokenizer as one processor;
- a randomly initialised `Idefics3ForConditionalGeneration`: a Llama of the text model's shape
  (two layers, hidden 128), a one-layer SigLIP-like vision tower and the pixel-shuffle
  connector, float32 safetensors, a few MB.

Why Idefics3 and not Qwen2-VL: vLLM 0.32's Qwen2-VL, Qwen2.5-VL, LLaVA, Pixtral and Gemma 3
import torchvision, which the CPU build cannot load (PyPI's wheels are CUDA builds); Idefics3's
model and processor need only PIL. Without tiles each image is one run of one placeholder id,
which is what `store.images.image_spans` locates. The same seed always gives the same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trajstore.tiny_model import (
    ENDOFTEXT,
    IM_END,
    NUM_HEADS,
    SPECIAL_TOKENS,
    VOCAB_MULTIPLE,
    build_tokenizer,
    save_quietly,
    seeded_model,
)

FAKE_IMAGE = "<fake_token_around_image>"
IMAGE = "<image>"
GLOBAL_IMAGE = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
#: The text model's specials (ids 0-4, as in the text model), then the image ones (5-8).
VLM_SPECIAL_TOKENS = (*SPECIAL_TOKENS, FAKE_IMAGE, IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE)
#: The id the engine repeats once per image feature (`TRAJSTORE_IMAGE_TOKEN_ID` for this model).
IMAGE_TOKEN_ID = VLM_SPECIAL_TOKENS.index(IMAGE)

IMAGE_SIZE = 56  #: every image is resized to one square view of this side (no tiles)
PATCH_SIZE = 14
SCALE_FACTOR = 2  #: the connector's pixel shuffle: 2 x 2 patches make one feature
#: Features (placeholder ids) per image: (56 / 14)^2 / 2^2.
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2

# The parts loop is written over `message.content` itself, so that vLLM detects the "openai"
# content format and hands the template the parts (an image as {"type": "image"}).
_CONTENT = (
    "{% if message.content is string %}{{ message.content }}"
    "{% elif message.content %}{% for part in message.content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type in ('image', 'image_url') %}" + IMAGE +
    "{% endif %}{% endfor %}{% endif %}"
)  # fmt: skip

#: ChatML with images; tools and tool calls rendered as the text model's template does.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n" + _CONTENT +
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '{{ \'\\n\' }}<tool_call>\n{"name": {{ fn.name | tojson }}, "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}"
    "{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # fmt: skip


def build_tiny_vlm(
    out_dir: Path, *, seed: int = 0, hidden_size: int = 128, max_positions: int = 8192
) -> Path:
    """Write a tiny random Idefics3 model (processor, tokenizer, config, weights) to `out_dir`.

    It loads with transformers' `AutoProcessor` and `Idefics3ForConditionalGeneration` and
    serves with vLLM (`VllmServer`), images included. Returns `out_dir`.
    """
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(
        out_dir,
        seed=seed,
        max_positions=max_positions,
        specials=VLM_SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)

    padded_vocab = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    ids = {token: VLM_SPECIAL_TOKENS.index(token) for token in VLM_SPECIAL_TOKENS}
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": padded_vocab,
            "hidden_size": hidden_size,
            "intermediate_size": 4 * hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": NUM_HEADS,
            "num_key_value_heads": 2,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": True,
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
        },
        scale_factor=SCALE_FACTOR,
        image_token_id=ids[IMAGE],
        tie_word_embeddings=True,
        pad_token_id=ids[ENDOFTEXT],
    )
    save_quietly(seeded_model(Idefics3ForConditionalGeneration, config, seed), out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """Command line: `python -m trajstore.tiny_vlm OUT_DIR [--seed N]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_vlm(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
