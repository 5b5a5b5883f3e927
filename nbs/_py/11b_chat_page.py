# %% [markdown]
# # The browser chat page
#
# > One page at `/` that chats with the server: plain HTML, CSS and JavaScript files in the package, inlined into one page whose Content-Security-Policy allows exactly that script and that style.

# %% [markdown]
# One static page at `/`: a conversation, a box to type in, *Stop*, the reply's tokens per
# second, and an engine panel (running and waiting requests, and the KV block map drawn one
# pixel per block: grey free, blue cached prefix, green held) polled from
# `/v1/engine/stats`. A tools box in the settings takes an OpenAI `tools` list as JSON
# (checked as it is typed, with an error that says what is wrong) and a tool choice; a reply's
# tool calls show as blocks of their own, the function's name and its arguments as indented
# JSON, each with a box to send its result back as a `tool` message, after which the model
# answers from the results. Model output is untrusted text: the page only ever sets
# `textContent`, never HTML, and its Content-Security-Policy allows no script but its own
# (pinned by hash), so even a mistake could not run a `<script>` the model wrote.
#
# The page is three plain files in the package, `forge_engine/server/static/`, edited as what
# they are (not exported from this notebook; `pyproject.toml` ships them as package data):
#
# | file | what it holds |
# |---|---|
# | `chat.html` | the page, with `%STYLE%` and `%SCRIPT%` where the other two go |
# | `chat.css` | the layout: the conversation on the left, the engine panel on the right |
# | `chat.js` | a request and its SSE stream, *Stop*, the tools box, tool call blocks, the engine stats, the block map |
#
# They are read once, at import, with `importlib.resources` (so they are found wherever the
# package is installed), and inlined into one page: one request loads it all, and the CSP can
# name the script and the style by the SHA-256 of their bytes instead of allowing a source.

# %%
#| default_exp server.chat_page

# %%
#| export
from __future__ import annotations

import base64
import hashlib
from importlib.resources import files

# %%
#| hide
import re

# %%
#| export
STATIC = files("forge_engine.server") / "static"  # package data, beside the server's modules


def static_text(name: str) -> str:
    "A file of the chat page, its bytes as they are (no newline translation: the CSP hashes those bytes)."
    return (STATIC / name).read_bytes().decode("utf-8")


CHAT_STYLE, CHAT_SCRIPT, CHAT_HTML = (
    static_text("chat.css"),
    static_text("chat.js"),
    static_text("chat.html"),
)


def csp_hash(code: str) -> str:
    "A Content-Security-Policy source that allows exactly this inline code."
    return "'sha256-" + base64.b64encode(hashlib.sha256(code.encode()).digest()).decode() + "'"


CHAT_PAGE = CHAT_HTML.replace("%STYLE%", CHAT_STYLE).replace("%SCRIPT%", CHAT_SCRIPT)
CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {csp_hash(CHAT_SCRIPT)}; "
    f"style-src {csp_hash(CHAT_STYLE)}; connect-src 'self'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

# %%
assert (
    "innerHTML" not in CHAT_SCRIPT
    and "insertAdjacentHTML" not in CHAT_SCRIPT
    and "document.write" not in CHAT_SCRIPT
)
assert (
    CHAT_PAGE.count("<script>") == 1
    and csp_hash(CHAT_SCRIPT) in CHAT_PAGE_HEADERS["Content-Security-Policy"]
)

# %% [markdown]
# The hashes in the policy are those of what the page inlines, byte for byte: a browser
# computes them from the text between `<script>` and `</script>` (and `<style>`), so an
# edit to either file changes the page and its policy together.

# %%
inline_script = re.search(r"<script>(.*)</script>", CHAT_PAGE, re.S).group(1)
inline_style = re.search(r"<style>(.*)</style>", CHAT_PAGE, re.S).group(1)
assert (inline_script, inline_style) == (CHAT_SCRIPT, CHAT_STYLE)
assert "%STYLE%" not in CHAT_PAGE and "%SCRIPT%" not in CHAT_PAGE
policy = CHAT_PAGE_HEADERS["Content-Security-Policy"]
assert (
    f"script-src {csp_hash(inline_script)};" in policy
    and f"style-src {csp_hash(inline_style)};" in policy
)
assert (STATIC / "chat.js").read_bytes() == inline_script.encode()
