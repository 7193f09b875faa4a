"""TEST INSTRUMENT: tokenizers and chat templates in the shapes users bring,
built here in milliseconds (nothing downloaded):

- a Llama-3-style tokenizer (`<|start_header_id|>` headers, `<|eot_id|>` turn
  ends, `<|python_tag|>`) with a template in the spirit of Llama 3.1's JSON
  tool calling: tools listed as JSON in the system turn, calls written as
  `{"name": .., "parameters": {..}}` after `<|python_tag|>`, `; ` between them;
- a ChatML template that renders no tools (as SmolLM2-Instruct's does);
- a tool to offer in requests (OpenAI's shape).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}

LLAMA_SPECIAL = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)

LLAMA3_JSON_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
    {{- 'To call a function, answer with {"name": function name, "parameters": its arguments as an object}; '
        'separate several calls with "; ".\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson }}{{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- if message.tool_calls %}
            {{- '<|python_tag|>' }}
            {%- for call in message.tool_calls %}
                {%- if not loop.first %}{{- '; ' }}{%- endif %}
                {{- '{"name": "' + call.function.name + '", "parameters": ' }}
                {{- call.function.arguments | tojson }}{{- '}' }}
            {%- endfor %}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ChatML that never reads `tools`, for the demo tokenizer's `<|im_start|>` / `<|im_end|>`.
CHATML_NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    'You are a helpful assistant. {"name": "bash", "parameters": {"command": "ls -la; pwd"}}',
    "To call a function, answer with its name and parameters as an object.",
    "Run a shell command. List the files. a.txt b.txt README.md src/main.py",
] * 20


def build_llama_style_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE with Llama 3's special tokens and `LLAMA3_JSON_TEMPLATE`, saved as an HF directory."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL])
    fast: Any = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = LLAMA3_JSON_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


def with_template(tokenizer_dir: Path, template: str, out_dir: Path) -> Path:
    """A copy of the HF tokenizer in `tokenizer_dir` whose chat template is `template`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    return out_dir
