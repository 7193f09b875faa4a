"""The embedded default's tokenizer: a small byte-level BPE in Qwen3's format.

`build_demo_tokenizer` trains a byte-level BPE (the `tokenizers` library) on a
built-in synthetic corpus of shell, Python and agent-style text, adds Qwen3's
special tokens as single tokens, and writes an HF tokenizer directory that
`transformers.AutoTokenizer.from_pretrained` loads offline, with the chat
template from `chat_template.jinja`. Byte-level BPE without a normalizer maps
any text to ids and back exactly, which the token-capture proxy relies on.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: dropped by decode(skip_special_tokens=True).
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Markup tokens the model writes itself; Qwen3 keeps them on decode, so they are
# added as non-special tokens and the proxy's parsers can see them.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# What build_demo_tokenizer writes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What any HF tokenizer directory (the demo's or a real Qwen3 checkpoint's) may hold.
_HF_TOKENIZER_FILES = (
    *TOKENIZER_FILES,
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
)

_BYTE_ALPHABET_SIZE = 256
# Enough merges beyond the byte alphabet for the vocabulary to be worth having.
MIN_VOCAB_SIZE = _BYTE_ALPHABET_SIZE + len(CONTROL_TOKENS) + len(MARKUP_TOKENS) + 32
_CORPUS_SEED = 0
_CORPUS_DOCUMENTS = 600
_TEMPLATE_COPIES = 20


def load_chat_template() -> str:
    """The demo model's Jinja chat template (Qwen3 token format)."""
    # Next to this module (package data); works whether or not the package has an __init__.py.
    return Path(__file__).with_name("chat_template.jinja").read_text(encoding="utf-8")


_SHELL = (
    "ls -la",
    "cd {dir} && ls",
    "cat {file}",
    'grep -rn "{word}" {dir}',
    "python -m pytest -x -q {dir}",
    "git status",
    "git diff --stat",
    "sed -n '1,80p' {file}",
    "find . -name '*.py' | head -n 20",
    "pip install -e .",
    "echo $?",
    "mkdir -p {dir}/{word}",
    "wc -l {file}",
    "head -n 40 {file}",
    "python {file}",
    "rm -rf build/",
    "export PYTHONPATH=$PWD",
    "tail -f /var/log/{word}.log",
)
_WORDS = (
    "config",
    "parser",
    "server",
    "client",
    "tokens",
    "request",
    "response",
    "buffer",
    "value",
    "result",
    "index",
    "items",
    "count",
    "path",
    "data",
    "error",
    "model",
    "batch",
    "session",
    "reward",
    "tests",
    "utils",
    "main",
    "handler",
    "cache",
    "queue",
    "state",
    "output",
    "input",
    "message",
    "content",
    "name",
    "arguments",
    "command",
    "function",
    "string",
    "number",
    "object",
    "array",
    "schema",
    "user",
    "assistant",
    "system",
    "tool",
    "file",
    "line",
    "column",
    "offset",
    "length",
    "width",
    "height",
    "timeout",
    "retry",
    "logger",
    "status",
    "update",
    "delete",
    "create",
    "fetch",
    "parse",
    "render",
    "encode",
    "decode",
    "format",
    "check",
    "verify",
    "build",
    "install",
    "deploy",
    "release",
    "version",
)
_DIRS = ("src", "tests", "lib", "app", "scripts", "docs", "pkg/core", "legorl_jax/models")
_PROSE = (
    "I will look at the repository layout first.",
    "Let me run the tests to see what fails.",
    "The test fails because the {word} is None when the {word} is empty.",
    "I found the bug: `{word}` is read before it is set.",
    "Now I will fix the {word} handling in {file}.",
    "All tests pass now. The change is small and covered by a new test.",
    "The user wants the {word} to be validated before it is stored.",
    "Let's check whether the {word} function handles unicode: café, naïve, 日本語, ✓.",
    "First, read the error message carefully; then reproduce it with a minimal example.",
    "Done. Summary: fixed the off-by-one error in the {word} loop.",
    "The {word} on line {n} returns {n} instead of {m}; the expected value is {m}.",
    "Ran {n} tests in 0.{m}s: {n} passed, {m} failed.",
    "Could you explain why the {word} needs a {arg}? It seems that {word} already works.",
    "This should be faster, since the {word} is cached and only the {arg} changes.",
)
_PYTHON = (
    "def {word}({arg}: int) -> int:\n    return {arg} + 1\n",
    "import os\nimport sys\nfrom pathlib import Path\n",
    "class {Word}:\n    def __init__(self, {arg}):\n        self.{arg} = {arg}\n",
    "for i, {arg} in enumerate({word}):\n    print(i, {arg})\n",
    'if __name__ == "__main__":\n    main()\n',
    "try:\n    {word} = load({arg})\nexcept ValueError as exc:\n    raise RuntimeError(str(exc)) from exc\n",
    'with open({arg}, "r", encoding="utf-8") as f:\n    {word} = f.read()\n',
    "assert {word}({arg}) == [{n}, {m}], {word}\n",
    '{arg} = {{"{word}": {n}, "{arg}": [{m}, None, True, False]}}\n',
    '@pytest.mark.parametrize("{arg}", [{n}, {m}])\ndef test_{word}({arg}):\n    assert {word}({arg}) is not None\n',
    "async def {word}(self) -> list[str]:\n    return [x async for x in self.{arg}]\n",
    "return {{k: v for k, v in {arg}.items() if v is not None}}\n",
    "Traceback (most recent call last):\n  File \"{file}\", line {n}, in <module>\n    {word}()\nKeyError: '{arg}'\n",
)


def _fill(template: str, rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    return template.format(
        word=word,
        Word=word.capitalize(),
        arg=rng.choice(_WORDS),
        dir=rng.choice(_DIRS),
        file=f"{rng.choice(_DIRS)}/{rng.choice(_WORDS)}.py",
        n=rng.randint(0, 999),
        m=rng.randint(0, 99),
    )


def synthetic_corpus(documents: int = _CORPUS_DOCUMENTS, seed: int = _CORPUS_SEED) -> list[str]:
    """Deterministic agent-session-like text: prose, shell commands, code, tool-call JSON."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(documents):
        command = _fill(rng.choice(_SHELL), rng)
        call = json.dumps({"name": "bash", "arguments": {"command": command}}, ensure_ascii=False)
        corpus.append(
            "\n".join((_fill(rng.choice(_PROSE), rng), call, f"$ {command}", _fill(rng.choice(_PYTHON), rng)))
        )
    return corpus


def _train(corpus: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No normalizer and no prefix space: bytes in, the same bytes out.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        # The added tokens come after training; they count towards vocab_size.
        vocab_size=vocab_size - len(CONTROL_TOKENS) - len(MARKUP_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def _added_tokens_decoder(tokenizer: Tokenizer) -> dict[str, dict[str, object]]:
    entries = {}
    for token in (*CONTROL_TOKENS, *MARKUP_TOKENS):
        entries[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in CONTROL_TOKENS,
        }
    return entries


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(tokenizer),
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # Decoding must give back the exact text; no space clean-up.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 131072,
        "chat_template": load_chat_template(),
    }


def _write_json(path: Path, payload: object) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_tokenizer(out_dir: str | Path, *, corpus: Iterable[str] | None = None, vocab_size: int = 1024) -> Path:
    """Train the demo tokenizer and write it as an HF tokenizer directory.

    The built-in corpus always takes part; `corpus` adds text to it. The
    vocabulary, added tokens included, has `vocab_size` entries when the corpus
    offers enough merges (the built-in one fills about 1300) and fewer otherwise.
    The same inputs give byte-identical files. Returns the directory.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
    if isinstance(corpus, str):
        raise TypeError("corpus must be an iterable of str documents, not a single str")
    extra = [] if corpus is None else list(corpus)
    if not all(isinstance(doc, str) for doc in extra):
        raise TypeError("corpus must be an iterable of str documents")
    # The template's own prose goes in too, weighted, so every tools system turn
    # (hundreds of tokens per model call) encodes short.
    templates = [load_chat_template()] * _TEMPLATE_COPIES
    tokenizer = _train([*synthetic_corpus(), *templates, *extra], vocab_size)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(
        out / "special_tokens_map.json",
        {"additional_special_tokens": [IM_START, IM_END], "eos_token": IM_END, "pad_token": ENDOFTEXT},
    )
    return out


def copy_tokenizer_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the HF tokenizer files present in `src_dir` into `out_dir`, byte for byte.

    Copying rather than re-saving through `transformers` keeps the chat template
    and token table exactly as the model was trained with. Returns the names copied.
    """
    src, out = Path(src_dir), Path(out_dir)
    present = [name for name in _HF_TOKENIZER_FILES if (src / name).is_file()]
    if not present:
        raise FileNotFoundError(f"no tokenizer files in {src} (looked for {', '.join(_HF_TOKENIZER_FILES)})")
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        for name in present:
            shutil.copyfile(src / name, out / name)
    return present
