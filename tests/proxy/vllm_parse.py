"""TEST INSTRUMENT, run by vLLM's own interpreter (not pytest's): reads
{"tools": [...], "cases": [[format, tokenizer_dir, text], ...]} on stdin and
prints, per case, what vLLM's tool parser of that name makes of the text:
{"called", "calls": [[name, arguments_json]], "content"}.
"""

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager


def main() -> None:
    job = json.load(sys.stdin)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=job["tools"])
    out = []
    for fmt, tokenizer_dir, text in job["cases"]:
        parser = ToolParserManager.get_tool_parser(fmt)(AutoTokenizer.from_pretrained(tokenizer_dir), request.tools)
        info = parser.extract_tool_calls(text, request)
        calls = [[call.function.name, call.function.arguments] for call in info.tool_calls]
        out.append({"called": info.tools_called, "calls": calls, "content": info.content})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
