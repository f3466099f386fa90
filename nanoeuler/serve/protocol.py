"""The OpenAI API as this server speaks it: request schemas, chat rendering, stop strings, response pieces.

Requests are pydantic models (FastAPI validates them and publishes them in /openapi.json). Types are
strict: `"max_tokens": "5"` is an error, not 5. Fields the OpenAI API has and we do not use
(presence_penalty, user, ...) are accepted and ignored; unknown fields are ignored too. Extensions, as vLLM
has them: `top_k`, `ignore_eos`.

Chat messages are rendered with the model's chat template exactly as the `chat` REPL renders its
conversation (chat_template.py: the checkpoint's own template, else the SPEC Alpaca template, in which a
system message goes in front of the next instruction), earlier turns dropped oldest first when they do
not fit the server's window (infer/chat.py's Chat.context); a last turn that does not fit alone is refused
(400). `developer` messages are system messages.

Tools (serve/tool_calls.py): the request's `tools` go to the template as its `tools` variable (transformers'
`apply_chat_template(tools=...)`) unless `tool_choice` is "none"; an assistant message's `tool_calls` go as
transformers takes them (`arguments` a JSON object, parsed from OpenAI's string) and `tool` messages with their
`tool_call_id`. `chat_template_kwargs` are the template's other variables (vLLM's and llama-server's field).
`tool_choice` "required" or a named function constrains the reply to one call of those functions in the
template's format (tool_calls.call_grammar); `response_format` "json_object" / "json_schema" constrains it to
JSON (infer/grammar.py; both need the `grammar` extra, else 400).
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..errors import UserError

MAX_STOP = 4
DONE = "data: [DONE]\n\n"  # a stream's last event


def _whole(v):
    """JSON has one number type: 2.0 is accepted where an integer is expected (JSON Schema agrees), 2.5 not."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_whole)]


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


Stop = Optional[Union[str, list[str]]]


class JSONSchemaFormat(_Base):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")  # None: any JSON object
    strict: Optional[bool] = None


class ResponseFormat(_Base):
    """OpenAI's response_format: "text" (free), "json_object" (any JSON object) or "json_schema" (a value valid
    under its schema); the two JSON kinds are enforced while decoding (infer/grammar.py)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_kind(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self

    def reply_schema(self) -> dict | None:
        """The schema replies must follow; None (json_object): any JSON object."""
        return self.json_schema.schema_ if self.json_schema is not None else None


class _Generation(_Base):
    """The fields both completion routes share (sampling, stopping, streaming)."""
    model: str
    max_tokens: Optional[Int] = Field(None, ge=0)  # None: the route's default (completions 16, as OpenAI), capped
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[Int] = Field(None, ge=0)
    n: Int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Stop = None
    seed: Optional[Int] = Field(None, ge=0)  # choice i samples with seed + i, below 2**64 (the route checks)
    ignore_eos: bool = False  # vLLM's extension: generate past </s> (benchmarks: a fixed number of tokens)
    response_format: Optional[ResponseFormat] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None


class CompletionRequest(_Generation):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[Int] = Field(None, ge=0, le=20)
    echo: bool = False


class TextPart(_Base):
    type: Literal["text"]
    text: str


class FunctionCall(_Base):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCall(_Base):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Base):
    """A chat message: every role carries its content, a string or a non-empty list of text parts (a message
    without one would render as an empty turn), except an assistant's that makes tool calls."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[None, str, Annotated[list[TextPart], Field(min_length=1)]] = None
    name: Optional[str] = None
    tool_calls: Optional[Annotated[list[ToolCall], Field(min_length=1)]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _content_unless_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs its content (only an assistant's making tool_calls may have none)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages make tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class Function(_Base):
    """A function tool as the client wrote it: fields beyond these (`strict`, ...) reach the template too. Its
    name as OpenAI defines one (letters, digits, _ and -, at most 64; dots too, as MCP tools have them): a call
    names the function it makes, so an empty name or one with quotes or spaces could not be parsed back."""
    model_config = ConfigDict(strict=True, extra="allow")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict] = None


class Tool(_Base):
    type: Literal["function"]
    function: Function


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[Int] = Field(None, ge=0, le=20)  # only with logprobs: true, as OpenAI has it
    tools: Optional[list[Tool]] = None
    tool_choice: Union[None, Literal["none", "auto", "required"], NamedToolChoice] = None
    chat_template_kwargs: Optional[dict] = None

    def offered_tools(self) -> list[dict]:
        """The tools the model is offered (none with tool_choice "none"), as the template takes them."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self) -> list[dict] | None:
        """The functions the reply must call one of (tool_choice "required": any offered, a named function:
        that one), as the template takes them; None when the reply is free to call or not."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if not self.tools:
            raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, "a reply is either a forced tool call or constrained by response_format, not both",
                           param="response_format")
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if choice == "required":
            return tools
        named = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return named

    def template_variables(self) -> dict:
        """The chat template's variables besides the conversation: chat_template_kwargs, and tools if offered."""
        from ..chat_template import RESERVED
        kwargs = self.chat_template_kwargs or {}
        if taken := [k for k in (*RESERVED, "tools") if k in kwargs]:
            raise APIError(400, f"chat_template_kwargs may not set {taken[0]!r}", param="chat_template_kwargs")
        tools = self.offered_tools()
        return {**kwargs, "tools": tools} if tools else dict(kwargs)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools_named_once(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):   # (a call, and tool_choice, name the function they mean)
            raise ValueError(f"two tools are named {next(n for n in names if names.count(n) > 1)!r}")
        return self


class TokenizeRequest(_Base):
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(_Base):
    tokens: list[int]


def stop_list(stop: Stop) -> list[str]:
    """The request's stop strings as a list (at most 4, none empty)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise UserError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise UserError("stop sequences must not be empty")
    return stops


# ---- chat ----------------------------------------------------------------------------------------
def chat_messages(messages: list[Message]) -> list[dict]:
    """The request's messages as a chat template takes them ({"role", "content"}, an assistant's "tool_calls",
    a tool's "tool_call_id"); the last must be the user's or a tool's result."""
    if messages[-1].role not in ("user", "tool"):
        raise UserError("the last message must come from the user (or be a tool's result)")
    return [template_message(m) for m in messages]


def template_message(m: Message) -> dict:
    """One message as transformers' chat templates take it: tool call arguments a JSON object, not a string."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None and m.role == "tool":
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": call_arguments(c)}}
                             for c in m.tool_calls]
    return out


def call_arguments(c: ToolCall) -> dict:
    try:
        args = json.loads(c.function.arguments)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise APIError(400, f"tool call {c.id!r}: arguments must be a JSON object, got {c.function.arguments[:40]!r}",
                       param="messages")
    return args


def render_chat(model, tok, messages: list[Message], max_tokens: int, ctx_len: int,
                variables: dict | None = None) -> tuple[list[int], dict]:
    """The conversation as prompt ids for a window of ctx_len positions, the way the `chat` REPL builds it:
    the oldest exchanges dropped (system messages stay) until it leaves room for the reply -> (ids, notes).
    notes say what did not fit, when something did not: {"dropped_turns": exchanges dropped,
    "prompt_truncated_tokens": tokens of the whole conversation's rendering not in ids}. A last turn that
    does not fit even alone (the REPL would keep its end) is refused: APIError 400 context_length_exceeded.
    variables: the template's other variables (ChatRequest.template_variables)."""
    from ..chat_template import prompt_ids
    from ..infer.chat import Chat
    chat = Chat(model, tok, max_new_tokens=max(1, max_tokens), ctx_len=ctx_len, template_vars=variables)
    conversation = chat_messages(messages)
    ids = chat.context(list(conversation))
    if chat.cut:
        raise APIError(400, f"the last message is {len(ids) + chat.cut} tokens with the system messages; a prompt "
                            f"may take {len(ids)} of this server's {ctx_len} context positions (the rest is room "
                            f"for the reply): shorten it", param="messages", code="context_length_exceeded")
    if not chat.dropped_turns:
        return ids, {}
    return ids, {"dropped_turns": chat.dropped_turns,
                 "prompt_truncated_tokens": len(prompt_ids(tok, conversation, variables)) - len(ids)}


# ---- responses -----------------------------------------------------------------------------------
class APIError(Exception):
    """A request refused or failed: its HTTP status and the fields of its OpenAI error object (error_body)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    """An OpenAI error object, the body of every error reply."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse(obj) -> str:
    """One server-sent event carrying obj as JSON."""
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


# ---- text out ------------------------------------------------------------------------------------
def token_text(tok, token: int) -> str:
    """A token as a string for logprobs: its text, or 'bytes:\\xe2\\x82' when it is not whole UTF-8."""
    b = tok.token_bytes(token)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


class TextStream:
    """Token ids -> text pieces for one choice: never splits a UTF-8 character (session.StreamDecoder)
    and ends at the first stop string, holding back text that might be the start of one.

        stops ["\\n\\n"]: feed "a\\n" -> "a" (the "\\n" waits), feed "\\nb" -> "" and stopped
    """

    def __init__(self, tok, stops: list[str]):
        from ..infer.session import StreamDecoder
        self.dec, self.stops = StreamDecoder(tok), stops
        self.held = ""
        self.length = 0       # characters sent so far
        self.stopped = False  # a stop string was found

    def feed(self, token: int) -> str:
        return self._push(self.dec.feed(token))

    def feed_many(self, tokens: list[int]) -> str:
        """feed of each token, joined (one decoding of their bytes)."""
        return self._push(self.dec.feed_many(tokens))

    def flush(self) -> str:
        """The rest at the end of generation (a cut-off character becomes U+FFFD)."""
        out = self._push(self.dec.flush())
        if not self.stopped:
            out += self.held
            self.length += len(self.held)
            self.held = ""
        return out

    def _push(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            self.length += cut
            return text[:cut]
        keep = 0
        for s in self.stops:  # the longest end of text that starts a stop string
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if s.startswith(text[-n:]):
                    keep = n
                    break
        out, self.held = text[:len(text) - keep], text[len(text) - keep:]
        self.length += len(out)
        return out
