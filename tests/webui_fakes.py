"""A scripted model for the web page's browser tests (JITKERN_ENGINE_FACTORY=tests.webui_fakes:make_engine).

The real engine front of tests/server_fakes.py, answering every chat from the start of a fixed markdown
script (code fence, emphasis, lists, links, and HTML that must be shown as text, never run), except when the
last user turn contains ENDLESS_MARKER: that one gets a stream that never ends by itself (for the stop button).
"""
from __future__ import annotations

import os

from engine.async_engine import AsyncEngine
from tests.server_fakes import FakeLLMEngine

CODE_BLOCK = 'def add(a, b):\n    return a + b  # <b>not bold</b> & "quoted"'
MARKDOWN_ANSWER = (
    "Here is **bold**, *italic* and `inline code`.\n"
    "\n"
    "```python\n" + CODE_BLOCK + "\n```\n"
    "\n"
    "- first item\n"
    "- second item\n"
    "\n"
    "1. one\n"
    "2. two\n"
    "\n"
    "See [the docs](https://example.com/docs) and [bad](javascript:alert(1)).\n"
    '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">\n'
    "Done.")
ENDLESS_MARKER = "please ramble"
ENDLESS_TEXT = " tick tock and on it goes,"
USER_TURN = "<|im_start|>user"          # SmolLM2's chat template


class WebUIFakeEngine(FakeLLMEngine):
    def __init__(self, **kwargs):
        super().__init__(script=MARKDOWN_ANSWER, **kwargs)   # the script ends with EOS
        self.endless = self.tokenizer.encode(ENDLESS_TEXT, add_special_tokens=False)
        self._endless_by_request: dict[str, bool] = {}

    def _is_endless(self, req) -> bool:
        rid = req.request_id
        if rid not in self._endless_by_request:
            # Only the conversation's last user turn counts (an earlier endless turn stays in the history).
            last_turn = self.tokenizer.decode(req.prompt_token_ids).rsplit(USER_TURN, 1)[-1]
            self._endless_by_request[rid] = ENDLESS_MARKER in last_turn
        return self._endless_by_request[rid]

    def next_token(self, req) -> int:
        k = len(req.output_token_ids)
        if self._is_endless(req):
            return self.endless[k % len(self.endless)]
        return self.script[min(k, len(self.script) - 1)]


def make_engine(settings) -> AsyncEngine:
    max_len = settings.max_model_len or 4096
    return AsyncEngine(engine=WebUIFakeEngine(
        max_model_len=max_len, num_blocks=max(64, 2 * max_len // 16), block_size=16,
        step_delay=float(os.environ.get("JITKERN_FAKE_STEP_DELAY", "0.02"))))
