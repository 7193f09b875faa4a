"""System prompts and fixed messages (the `prompt` axis)."""

from __future__ import annotations

_FINISH = {
    True: "When the task is done, call the submit tool.",
    False: "When the task is done, reply with a short summary and no tool call.",
}

_TERSE = "You are a coding agent in {workdir}. Complete the task with the tools. {finish}"

_GUIDED = """You are a coding agent working in a Linux sandbox; the work directory is {workdir}.
Work in small steps:
1. Look around first: list files and read the ones the task mentions.
2. Make the change the task asks for, and nothing else.
3. Check your work by running the relevant command or test.
4. Keep tool calls focused; paths are relative to {workdir} unless absolute.
{finish}"""

PLAN_REQUEST = "Before using any tool, write a short numbered plan for this task. Do not act yet."
PLAN_GO = "Now carry out your plan, step by step, with the tools."

SUMMARY_REQUEST = (
    "The conversation is getting long. Summarise your progress so far for yourself: what the task is, "
    "what you found, which files you changed and how, what remains to do. Be specific and brief; "
    "do not call tools."
)
SUMMARY_PREFIX = "Summary of your earlier work on this task:\n"


def system_prompt(style: str, workdir: str, has_submit: bool) -> str:
    template = _TERSE if style == "terse" else _GUIDED
    return template.format(workdir=workdir, finish=_FINISH[has_submit])
