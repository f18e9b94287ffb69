"""The simulated engine's OpenAI request bodies: prompt length and prompt blocks (prefix cache) of a
request, the OpenAI-style error (`RequestError`, `error_response`) and the filler text of the
responses.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from fleetplan.sim.prefix_cache import prompt_block_hashes


class RequestError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status,
         "error": {"message": message, "type": err_type, "code": status}},
        status=status,
    )


def _count_words(text: str) -> int:
    return len(text.split())


def prompt_length(body: dict[str, Any], chat: bool) -> int:
    """Prompt tokens of an OpenAI request body (see the module docstring)."""
    for holder in (body, body.get("fleetplan") or {}):
        if isinstance(holder, dict) and holder.get("prompt_tokens") is not None:
            try:
                n = int(holder["prompt_tokens"])
            except (TypeError, ValueError) as exc:
                raise RequestError(400, f"prompt_tokens must be an integer, got {holder['prompt_tokens']!r}") from exc
            if n < 1:
                raise RequestError(400, f"prompt_tokens must be >= 1, got {n}")
            return n
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError(400, "messages must be a non-empty list")
        total = 0
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += _count_words(content)
            elif isinstance(content, list):
                total += sum(_count_words(str(p.get("text", ""))) for p in content if isinstance(p, dict))
            total += 4  # role and template tokens
        return max(1, total)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return max(1, len(prompt))
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif prompt and isinstance(prompt[0], list):
            return max(1, len(prompt[0]))
        else:
            raise RequestError(400, "batched prompts are not supported by the simulated engine")
    if not isinstance(prompt, str):
        raise RequestError(400, "prompt must be a string or a list of token ids")
    return max(1, _count_words(prompt))


def _block_ids(raw: object) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in raw):
        raise RequestError(400, "block_hashes must be a list of integers")
    return tuple(h & 0x7FFFFFFFFFFFFFFF for h in raw)


def prompt_blocks(body: dict[str, Any], chat: bool) -> tuple[int, ...] | None:
    """The prompt's 512-token block hashes for the prefix cache (fleetplan.sim.prefix_cache): the
    body's `block_hashes` (fleetplan extension, also in `"fleetplan": {...}`: a trace's hash_ids,
    for prompts sent as a `prompt_tokens` hint), else chained hashes of the prompt's tokens (token
    ids, or the words of a text prompt; chat: each message's role and 3 template tokens, then its
    words, as prompt_length counts them). None: a hint without hashes (nothing to cache)."""
    for holder in (body, body.get("fleetplan") or {}):
        if isinstance(holder, dict) and holder.get("block_hashes") is not None:
            return _block_ids(holder["block_hashes"])
    for holder in (body, body.get("fleetplan") or {}):
        if isinstance(holder, dict) and holder.get("prompt_tokens") is not None:
            return None
    if chat:
        toks: list[str] = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            toks += [f"<{m.get('role', '')}>", "<t>", "<t>", "<t>"]
            content = m.get("content")
            if isinstance(content, str):
                toks += content.split()
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict):
                        toks += str(part.get("text", "")).split()
        return prompt_block_hashes(toks) if toks else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt_block_hashes(prompt)
    if isinstance(prompt, str) and prompt.strip():
        return prompt_block_hashes(prompt.split())
    return None


_WORDS = ("the", "fleet", "plan", "token", "serve", "model", "batch", "queue")


def filler_text(n: int, offset: int) -> str:
    return "".join(" " + _WORDS[(offset + i) % len(_WORDS)] for i in range(n))
