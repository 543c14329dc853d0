"""A random Qwen3.5 model folder with a chat setup of Qwen3.5's shape, built here (no hub):
a byte-level BPE tokenizer trained on a few sentences, with Qwen's special tokens
(``<|im_start|>``, ``<|im_end|>``) and its tags as single non-special tokens (``<think>``,
``</think>``, ``<tool_call>``, ...), and a chat
template written for these tests that renders what Qwen3.5's does: ChatML turns, the tools as
JSON in a system turn, XML-style calls (``<function=...>``, ``<parameter=...>``), tool answers
in ``<tool_response>``, and an assistant turn opened inside ``<think>`` when
``enable_thinking`` is true, or with an empty, closed one otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.random_checkpoints import make_model

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# single tokens that are text, not special, as in Qwen's tokenizers: decoding keeps them
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>"]
EOS = "<|im_end|>"

# (transformers renders with trim_blocks: a newline right after a tag is written as {{ nl }})
TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>{{ nl }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>{{ nl }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>{{ nl }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ nl }}<tool_call>\n<function={{ c.function.name }}>"
    "{% for k, v in c.function.arguments | items %}{{ nl }}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>{% endfor %}{{ nl }}</function>\n"
    "</tool_call>{% endfor %}<|im_end|>{{ nl }}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>{{ nl }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}"
    "{% if enable_thinking is defined and enable_thinking is true %}<think>{{ nl }}"
    "{% else %}<think>{{ nl }}{{ nl }}</think>{{ nl }}{{ nl }}{% endif %}{% endif %}")

CORPUS = [
    "The grass is green. The sky is blue. What is the weather in Paris today?",
    "It is sunny and warm in Oslo, with a light wind from the west.",
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
    "You have access to the following functions: get_weather, get_time. Reply in the format.",
    '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}',
    "Let me think step by step about the question before I answer it.",
]


def make_chat_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tokenizer and a random Qwen3.5 (as shipped, vision tower and all) sized to it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out_dir))
    vocab = len(fast)
    make_model("qwen3_5_vl", out_dir, seed, vocab_size=vocab,
               eos_token_id=fast.convert_tokens_to_ids(EOS),
               pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"))
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert config.get("chat_template") or (out_dir / "chat_template.jinja").is_file()
    return out_dir
