"""Cost of streaming tool-call parsing: microseconds per streamed delta (4 characters, about one
token) for each parser on a scripted output of growing length. Each delta re-parses the text so
far (``tool_calls/parsers.py``: one pure function of the text, so streamed == non-streamed), so
the cost grows with the output; this prints how much.

Run: ``PYTHONPATH=. python benchmarks/tool_parser_cost.py``
"""

from __future__ import annotations

import json
import time

from pagedllm.entrypoints.openai.tool_calls.parsers import (
    HermesToolParser,
    Llama3ToolParser,
    MistralToolParser,
    ToolCallStream,
    ToolParser,
)


def scripted(parser: ToolParser, n_items: int) -> str:
    """One tool call whose arguments hold ``n_items`` small objects, in the parser's format."""
    args = json.dumps({"items": [{"id": i, "text": "word " * 5} for i in range(n_items)]})
    if isinstance(parser, HermesToolParser):
        return f'<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
    if isinstance(parser, Llama3ToolParser):
        return f'{{"name": "f", "parameters": {args}}}'
    return f'[TOOL_CALLS][{{"name": "f", "arguments": {args}}}]'


def per_delta_us(parser: ToolParser, text: str, step: int = 4) -> float:
    """Mean microseconds of one ``ToolCallStream.delta`` over the whole text, ``step`` chars each."""
    stream = ToolCallStream(parser)
    cuts = list(range(step, len(text), step)) + [len(text)]
    t0 = time.perf_counter()
    for cut in cuts:
        stream.delta(text[:cut], final=cut == len(text))
    return (time.perf_counter() - t0) / len(cuts) * 1e6


def main() -> None:
    for parser in (HermesToolParser(), Llama3ToolParser(), MistralToolParser()):
        for n_items in (5, 40, 160):
            text = scripted(parser, n_items)
            us = min(per_delta_us(parser, text) for _ in range(3))
            print(f"{type(parser).__name__:18s} {len(text):6d} chars: {us:7.1f} us/delta")


if __name__ == "__main__":
    main()
