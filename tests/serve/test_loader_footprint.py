"""What loading a model for serving brings into the process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from legorl_jax.serve.loader import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_serving_never_imports_torch(tiny_model_dir: Path) -> None:
    # torch costs the engine process a quarter GB of resident memory it never uses.
    script = (
        "import sys\n"
        "from legorl_jax.serve.loader import load_served_model\n"
        f"served = load_served_model({str(tiny_model_dir)!r}, max_slots=2, max_len=64)\n"
        "served.engine.shutdown()\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"


def test_the_fast_tokenizer_reads_what_autotokenizer_reads(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    text = 'Hi <|im_start|>user\n<tool_call>{"a": 1}</tool_call> über 😀<|im_end|>'
    assert ours.encode(text) == auto.encode(text)
    assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    assert (ours.eos_token_id, ours.all_special_ids, ours.chat_template) == (
        auto.eos_token_id,
        auto.all_special_ids,
        auto.chat_template,
    )
