"""OpenAI-compatible request bodies, with kvsieve's `kv_policy` field.

Field names, defaults and bounds follow OpenAI's API. Extensions, as in vLLM
and SGLang: `kv_policy`, `ignore_eos`, `return_token_ids`. The OpenAI Python
client sends `extra_body` keys at the top level; a literal `extra_body` object
in the JSON is accepted too.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Request(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored,
    # as OpenAI-compatible servers do; fields we cannot honour are rejected
    # explicitly below.
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    seed: Optional[int] = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    kv_policy: Optional[Union[str, dict[str, Any]]] = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    extra_body: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _lift_extra_body(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            inner = data["extra_body"]
            data = {**inner, **{k: v for k, v in data.items() if k != "extra_body"}}
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Literal[False, None] = None
    tools: Optional[list[Any]] = Field(default=None, max_length=0)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str]]
    max_tokens: Optional[int] = Field(default=16, ge=1)
    echo: Literal[False] = False
    logprobs: Literal[None] = None
    suffix: Literal[None] = None

    @model_validator(mode="after")
    def _single_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (n=1); send several requests")
            self.prompt = self.prompt[0]
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens
